#!/usr/bin/env bash
# The agent loop through 1, 2 and 4 gateway instances sharing one Redis, the
# client sending each turn to the next instance (so consecutive turns of a
# family never reach the same instance), in front of two simulated cards.
# Every run is salted and starts a fresh Redis. Needs redis-server.
# Usage: FAMILIES=4 TURNS=6 CONTEXT=20000 bench/instances.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-4}; TURNS=${TURNS:-6}; CONTEXT=${CONTEXT:-20000}; TIME_SCALE=${TIME_SCALE:-0.05}
cargo build --release -q
bin=$PWD/target/release/prefixgate
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
$bin sim-replica --port 18801 --time-scale "$TIME_SCALE" >/dev/null 2>&1 &
$bin sim-replica --port 18802 --time-scale "$TIME_SCALE" >/dev/null 2>&1 &
for n in 1 2 4; do
  redis-server --port 0 --unixsocket "$tmp/r$n.sock" --save "" --appendonly no >/dev/null 2>&1 &
  until redis-cli -s "$tmp/r$n.sock" ping >/dev/null 2>&1; do sleep 0.1; done
  urls=()
  for i in $(seq 1 "$n"); do
    port=$((18810 + 10 * n + i))
    PREFIXGATE_STORE_INSTANCE="gw$i" $bin serve --store "redis+unix://$tmp/r$n.sock" \
      --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$((port + 100))" \
      --replica a=http://127.0.0.1:18801 --replica b=http://127.0.0.1:18802 >/dev/null 2>&1 &
    urls+=("http://127.0.0.1:$port")
  done
  for u in "${urls[@]}"; do
    admin=${u%:*}:$(( ${u##*:} + 100 ))
    until [ "$(curl -s "$admin/admin/v1/replicas" | grep -o '"health":"up"' | wc -l)" = 2 ]; do sleep 0.3; done
  done
  echo "=== $n instance(s)"
  $bin bench agent-loop --base-url "$(IFS=,; echo "${urls[*]}")" --label "$n-instances" \
    --families "$FAMILIES" --turns "$TURNS" --context-tokens "$CONTEXT" --turn-tokens 300 --max-tokens 8
  pkill -f "redis\+unix://$tmp/r$n.sock" || true
done
