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
bin=$PWD/target/release/prefixgate
source bench/lib.sh
bench_init
# 20 tokens at 10 tok/s: every stream lasts ~2 s, so CONC streams are open at once.
start_sim a --decode-tps 10
start_sim b --decode-tps 10
start_gateway soak "$bin" --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}" "${persist[@]}"
gw=${GW_PID[soak]}; base=${GW_URL[soak]}; admin=${GW_ADMIN[soak]}
wait_replicas_up "$admin" 2 || exit 1
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
sample() { echo "$(date +%s) rss_kib=$(awk '/VmRSS/ {print $2}' /proc/$gw/status) fds=$(ls /proc/$gw/fd | wc -l) inflight=$(curl -s "$admin/metrics" | awk '/^prefixgate_inflight_requests/ {s+=$2} END {print s}')"; }
echo "before: $(sample)"
( while kill -0 $gw 2>/dev/null; do sleep 5; echo "during: $(sample)"; done ) &
wrk -t2 -c"$CONC" -d"${DURATION}s" --timeout 30s --latency -s "$lua" "$base"
# Streams still closing: wait until nothing is in flight (60 s at most).
for _ in $(seq 1 300); do
  [ "$(curl -s "$admin/metrics" | awk '/^prefixgate_inflight_requests/ {s+=$2} END {print s+0}')" = 0 ] && break
  sleep 0.2
done
echo "after: $(sample)"
curl -s "$admin/metrics" | grep -E '^prefixgate_requests_total' 
if [ -n "$DATA_DIR" ]; then
  kill -TERM $gw; wait $gw 2>/dev/null
  echo "persisted: $(du -sk "$DATA_DIR" | cut -f1) KiB in $DATA_DIR"
fi
