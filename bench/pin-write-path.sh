#!/usr/bin/env bash
# The pin write path's cost: requests/s through three gateways side by side,
# one persisting pins to sled (--data-dir), one to a shared Redis (--store),
# one in memory only, in front of the same two instant simulated replicas.
# Every request is a new prompt, so every request writes a pin. Needs wrk
# and redis-server (apt-get install -y wrk redis-server).
# Usage: bench/pin-write-path.sh [seconds-per-round] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; rounds=${2:-3}
cargo build --release -q
bin=$PWD/target/release/prefixgate
source bench/lib.sh
bench_init
tmp=$BENCH_TMP
start_sim a --time-scale 0
start_sim b --time-scale 0
reps="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
start_gateway sled "$bin" --data-dir "$tmp/db" $reps
start_gateway memory "$bin" $reps
start_redis "$tmp/redis.sock"
start_gateway redis "$bin" --store "redis+unix://$tmp/redis.sock" $reps
for gw in sled memory redis; do wait_replicas_up "${GW_ADMIN[$gw]}" 2; done
cat > "$tmp/post.lua" <<'LUA'
-- Each wrk thread gets its own id, so no two requests share a prompt.
local threads = 0
setup = function(thread) thread:set("tid", threads); threads = threads + 1 end
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":"question ' .. counter .. ' ' .. math.random(1e9) .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions", {["content-type"] = "application/json"}, body)
end
LUA
for r in $(seq 1 "$rounds"); do
  for gw in sled redis memory; do
    rps=$(wrk -t2 -c32 -d"${secs}s" -s "$tmp/post.lua" "${GW_URL[$gw]}" | awk '/Requests\/sec/ {print $2}')
    echo "round $r $gw $rps req/s"
  done
done
echo "pins persisted: sled $(curl -s "${GW_ADMIN[sled]}/admin/v1/pins?limit=1" | grep -o '"total":[0-9]*'), redis $(redis-cli -s "$tmp/redis.sock" hlen prefixgate:pins)"
