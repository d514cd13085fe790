#!/usr/bin/env bash
# Requests/s through two builds of the gateway side by side, each started on
# a database holding a million pins, in front of the same two instant
# simulated replicas; rounds alternate between them. Every request is a new
# prompt: a pin lookup and a pin write on a full table.
# Usage: BEFORE=/path/to/old/prefixgate [BEFORE_SEED=/path/to/old/seed_pins] bench/million-pins.sh [secs] [rounds]
# (build the old revision in a worktree: cargo build --release --examples).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; rounds=${2:-3}; pins=${PINS:-1000000}
cargo build --release -q --bin prefixgate --example seed_pins
after=target/release/prefixgate; after_seed=target/release/examples/seed_pins
before=${BEFORE:?set BEFORE to the old binary}; before_seed=${BEFORE_SEED:-$(dirname "$before")/examples/seed_pins}
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
urls="http://127.0.0.1:18301 http://127.0.0.1:18302"
$before_seed "$tmp/before" "$pins" $urls >/dev/null
$after_seed "$tmp/after" "$pins" $urls >/dev/null
$after sim-replica --port 18301 --time-scale 0 >/dev/null 2>&1 &
$after sim-replica --port 18302 --time-scale 0 >/dev/null 2>&1 &
reps="--replica a=http://127.0.0.1:18301 --replica b=http://127.0.0.1:18302"
PREFIXGATE_HEALTH_INTERVAL_MS=1000 $before serve --listen 127.0.0.1:18311 --admin-listen 127.0.0.1:18321 --data-dir "$tmp/before" $reps >/dev/null 2>&1 &
bpid=$!
PREFIXGATE_HEALTH_INTERVAL_MS=1000 $after serve --listen 127.0.0.1:18312 --admin-listen 127.0.0.1:18322 --data-dir "$tmp/after" $reps >/dev/null 2>&1 &
apid=$!
for port in 18321 18322; do
  until curl -sf "http://127.0.0.1:$port/metrics" | grep -q '^prefixgate_pins{replica="a"} [1-9]'; do sleep 0.5; done
done
cat > "$tmp/post.lua" <<'LUA'
local threads = 0
setup = function(thread) thread:set("tid", threads); threads = threads + 1 end
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model":"sim-model","max_tokens":1,"messages":[{"role":"system","content":"s"},{"role":"user","content":"q ' .. tid .. ' ' .. counter .. ' ' .. os.time() .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions", {["content-type"] = "application/json"}, body)
end
LUA
for r in $(seq 1 "$rounds"); do
  for target in "before 18311" "after 18312"; do
    set -- $target
    out=$(wrk -t2 -c32 -d"${secs}s" --latency -s "$tmp/post.lua" "http://127.0.0.1:$2")
    echo "round $r $1 $(echo "$out" | awk '/Requests\/sec/ {print $2}') req/s p50 $(echo "$out" | awk '$1=="50%" {print $2}') p99 $(echo "$out" | awk '$1=="99%" {print $2}')"
  done
done
echo "RSS after the rounds: before $(ps -o rss= -p $bpid) KiB, after $(ps -o rss= -p $apid) KiB"
