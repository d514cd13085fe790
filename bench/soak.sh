#!/usr/bin/env bash
# Soak: holds CONC concurrent streaming requests (each ~2 s of decoding on a
# simulated replica) against the gateway for DURATION, sampling the gateway's
# memory and open file descriptors every 5 s; wrk reports throughput and
# latency percentiles. Loopback only; stops by itself. Not run in CI (the
# short version is `cargo test --test it reliability::a_short_load_run`).
# Usage: CONC=1000 DURATION=180 bench/soak.sh
# With DATA_DIR=/some/dir the gateway persists (sled): pins and events are
# written behind the requests, as in production.
set -uo pipefail
cd "$(dirname "$0")/.."
CONC=${CONC:-1000}; DURATION=${DURATION:-180}; DATA_DIR=${DATA_DIR:-}
persist=()
if [ -n "$DATA_DIR" ]; then rm -rf "$DATA_DIR"; persist=(--data-dir "$DATA_DIR"); fi
ulimit -n 65536 2>/dev/null || true
cargo build --release -q || exit 1
bin=target/release/prefixgate
trap 'kill $(jobs -p) 2>/dev/null' EXIT
# 20 tokens at 10 tok/s: every stream lasts ~2 s, so CONC streams are open at once.
$bin sim-replica --port 18501 --decode-tps 10 >/dev/null 2>&1 &
$bin sim-replica --port 18502 --decode-tps 10 >/dev/null 2>&1 &
$bin serve --listen 127.0.0.1:18510 --admin-listen 127.0.0.1:18520 \
  --replica a=http://127.0.0.1:18501 --replica b=http://127.0.0.1:18502 "${persist[@]}" >/dev/null 2>&1 &
gw=$!
sleep 2
lua=$(mktemp)
cat > "$lua" <<'LUA'
local threads = 0
setup = function(thread) thread:set("tid", threads); threads = threads + 1 end
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model":"sim-model","max_tokens":20,"stream":true,"messages":[{"role":"user","content":"soak ' .. tid .. '-' .. counter .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions", {["content-type"] = "application/json"}, body)
end
LUA
sample() { echo "$(date +%s) rss_kib=$(awk '/VmRSS/ {print $2}' /proc/$gw/status) fds=$(ls /proc/$gw/fd | wc -l) inflight=$(curl -s 127.0.0.1:18520/metrics | awk '/^prefixgate_inflight_requests/ {s+=$2} END {print s}')"; }
echo "before: $(sample)"
( while kill -0 $gw 2>/dev/null; do sleep 5; echo "during: $(sample)"; done ) &
wrk -t2 -c"$CONC" -d"${DURATION}s" --timeout 30s --latency -s "$lua" http://127.0.0.1:18510
sleep 3
echo "after: $(sample)"
curl -s 127.0.0.1:18520/metrics | grep -E '^prefixgate_requests_total' 
if [ -n "$DATA_DIR" ]; then
  kill -TERM $gw; wait $gw 2>/dev/null
  echo "persisted: $(du -sk "$DATA_DIR" | cut -f1) KiB in $DATA_DIR"
fi
