#!/usr/bin/env bash
# Requests/s through two builds of the gateway side by side, each started on
# a database holding a million pins, in front of the same two instant
# simulated replicas; rounds alternate between them. Every request is a new
# prompt: a pin lookup and a pin write on a full table.
# Usage: BEFORE=/path/to/old/prefixgate [BEFORE_SEED=/path/to/old/seed_pins] bench/million-pins.sh [secs] [rounds]
#        [CONVERSATIONS=1000000] [MESSAGES=40] [EAGER=1 | FLOOR=1] bench/million-pins.sh load
# (build the old revision in a worktree: cargo build --release --examples).
#
# `bench/million-pins.sh load`: instead, what a table of CONVERSATIONS
# (1,000,000) conversations of MESSAGES (40) messages costs, every boundary
# marked (examples/pin_sizes): its memory, its size on disk, how long a
# restart takes before it routes (pages read on first touch) and before
# every page is read (the background loader); EAGER=1 also times reading
# the whole table first (the startup before pins::pages); FLOOR=1 instead
# times only the same number of keys put into a map sized for them, no disk
# (what no layout undercuts on the machine). The database is
# written once to target/pins-CONVERSATIONSxMESSAGES (1M x 40: ~4 GiB, ~1
# minute, the in-memory table ~5 GiB) and kept: a second run measures the
# load only. A gateway keeps such a table only with pins.max_pins at least
# CONVERSATIONS x MESSAGES.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = load ]; then
  c=${CONVERSATIONS:-1000000}; m=${MESSAGES:-40}
  CARGO_PROFILE_RELEASE_LTO=false cargo build --release -q --example pin_sizes
  CONVERSATIONS=$c MESSAGES=$m DIR=$PWD/target/pins-${c}x$m EAGER=${EAGER:-} target/release/examples/pin_sizes
  exit 0
fi
secs=${1:-10}; rounds=${2:-3}; pins=${PINS:-1000000}
cargo build --release -q --bin prefixgate --example seed_pins
after=$PWD/target/release/prefixgate; after_seed=$PWD/target/release/examples/seed_pins
before=${BEFORE:?set BEFORE to the old binary}; before_seed=${BEFORE_SEED:-$(dirname "$before")/examples/seed_pins}
source bench/lib.sh
bench_init
tmp=$BENCH_TMP
SIM_BIN=$after start_sim a --time-scale 0
SIM_BIN=$after start_sim b --time-scale 0
urls="${SIM_URL[a]} ${SIM_URL[b]}"
$before_seed "$tmp/before" "$pins" $urls >/dev/null
$after_seed "$tmp/after" "$pins" $urls >/dev/null
reps="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
PREFIXGATE_HEALTH_INTERVAL_MS=1000 start_gateway before "$before" --data-dir "$tmp/before" $reps
PREFIXGATE_HEALTH_INTERVAL_MS=1000 start_gateway after "$after" --data-dir "$tmp/after" $reps
bpid=${GW_PID[before]}; apid=${GW_PID[after]}
for gw in before after; do
  wait_replicas_up "${GW_ADMIN[$gw]}" 2
  until curl -sf "${GW_ADMIN[$gw]}/metrics" | grep -q '^prefixgate_pins{replica="a"} [1-9]'; do sleep 0.5; done
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
  for gw in before after; do
    out=$(wrk -t2 -c32 -d"${secs}s" --latency -s "$tmp/post.lua" "${GW_URL[$gw]}")
    echo "round $r $gw $(echo "$out" | awk '/Requests\/sec/ {print $2}') req/s p50 $(echo "$out" | awk '$1=="50%" {print $2}') p99 $(echo "$out" | awk '$1=="99%" {print $2}')"
  done
done
echo "RSS after the rounds: before $(ps -o rss= -p $bpid) KiB, after $(ps -o rss= -p $apid) KiB"
