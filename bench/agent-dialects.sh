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
bin=$PWD/target/release/prefixgate
source bench/lib.sh
bench_init
start_sim a --time-scale "$TIME_SCALE"
start_sim b --time-scale "$TIME_SCALE"
reps="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
start_gateway shape "$bin" --policy shape $reps
start_gateway roundrobin "$bin" --policy roundrobin $reps
for policy in shape roundrobin; do wait_replicas_up "${GW_ADMIN[$policy]}" 2; done
for api in chat responses messages; do
  for policy in shape roundrobin; do
    echo "=== api=$api policy=$policy"
    $bin bench agent-loop --base-url "${GW_URL[$policy]}" --api "$api" --label "$api/$policy" \
      --families "$FAMILIES" --turns "$TURNS" --context-tokens "$CONTEXT" --turn-tokens 300 --max-tokens 8
  done
done
