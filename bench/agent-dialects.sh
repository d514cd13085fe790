#!/usr/bin/env bash
# The agent loop in each API (chat, Responses, Messages) through two
# gateways side by side, one routing by shape and one round robin, in front
# of the same two simulated replicas (the seed's cards: 122,636 KV tokens,
# 4,100 prefill tokens/s, time scaled by TIME_SCALE). Every run is salted, so
# no run measures another's cache. Prints the bench reports.
# Usage: FAMILIES=2 TURNS=12 CONTEXT=20000 TIME_SCALE=0.05 bench/agent-dialects.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-2}; TURNS=${TURNS:-12}; CONTEXT=${CONTEXT:-20000}; TIME_SCALE=${TIME_SCALE:-0.05}
cargo build --release -q
bin=target/release/prefixgate
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
$bin sim-replica --port 18601 --time-scale "$TIME_SCALE" >/dev/null 2>&1 &
$bin sim-replica --port 18602 --time-scale "$TIME_SCALE" >/dev/null 2>&1 &
reps="--replica a=http://127.0.0.1:18601 --replica b=http://127.0.0.1:18602"
$bin serve --listen 127.0.0.1:18611 --admin-listen 127.0.0.1:18621 --policy shape $reps >/dev/null 2>&1 &
$bin serve --listen 127.0.0.1:18612 --admin-listen 127.0.0.1:18622 --policy roundrobin $reps >/dev/null 2>&1 &
# Wait until both gateways have seen both replicas up (a replica probed
# before its port opened is down until it passes `health.rise` probes).
for port in 18621 18622; do
  until [ "$(curl -s "http://127.0.0.1:$port/admin/v1/replicas" | grep -o '"health":"up"' | wc -l)" = 2 ]; do sleep 0.5; done
done
for api in chat responses messages; do
  for target in "shape 18611" "roundrobin 18612"; do
    set -- $target
    echo "=== api=$api policy=$1"
    $bin bench agent-loop --base-url "http://127.0.0.1:$2" --api "$api" --label "$api/$1" \
      --families "$FAMILIES" --turns "$TURNS" --context-tokens "$CONTEXT" --turn-tokens 300 --max-tokens 8
  done
done
