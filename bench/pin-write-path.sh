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
bin=target/release/prefixgate
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
$bin sim-replica --port 18101 --time-scale 0 >/dev/null 2>&1 &
$bin sim-replica --port 18102 --time-scale 0 >/dev/null 2>&1 &
reps="--replica a=http://127.0.0.1:18101 --replica b=http://127.0.0.1:18102"
$bin serve --listen 127.0.0.1:18111 --admin-listen 127.0.0.1:18121 --data-dir "$tmp/db" $reps >/dev/null 2>&1 &
$bin serve --listen 127.0.0.1:18112 --admin-listen 127.0.0.1:18122 $reps >/dev/null 2>&1 &
redis-server --port 0 --unixsocket "$tmp/redis.sock" --save "" --appendonly no >/dev/null 2>&1 &
until redis-cli -s "$tmp/redis.sock" ping >/dev/null 2>&1; do sleep 0.1; done
$bin serve --listen 127.0.0.1:18113 --admin-listen 127.0.0.1:18123 --store "redis+unix://$tmp/redis.sock" $reps >/dev/null 2>&1 &
sleep 2
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
  for target in "sled 18111" "redis 18113" "memory 18112"; do
    set -- $target
    rps=$(wrk -t2 -c32 -d"${secs}s" -s "$tmp/post.lua" "http://127.0.0.1:$2" | awk '/Requests\/sec/ {print $2}')
    echo "round $r $1 $rps req/s"
  done
done
echo "pins persisted: sled $(curl -s 'http://127.0.0.1:18121/admin/v1/pins?limit=1' | grep -o '"total":[0-9]*'), redis $(redis-cli -s "$tmp/redis.sock" hlen prefixgate:pins)"
