#!/usr/bin/env bash
# Sessions at the KV wall on simulated vLLM-like replicas (issue 31): two
# replicas of SIM_KV (12,000) KV tokens each (capacity from their metrics,
# a pool of blocks with LRU eviction of cached prefixes), FAMILIES (4)
# agent families sharing a 500-token system prompt, a first turn of ~2,000
# tokens and 1,500 new tokens a turn for 6 turns (~9,500 at the end: two
# fit a replica at first, one at the end). Every arm in one run, each on a
# fresh gateway unless said:
#   hold-cold    the hold on, a gateway that has learned nothing
#   hold-warm    the same gateway, a second set of new families once the
#                first idled out (it has learned what they grow to)
#   off          the hold off (sessions.max_wait_ms=0)
#   two-hold / two-off   two families, below the wall
#   by-hand      two families at a time by hand, through the off gateway
# Settings: sessions.idle_ms=1000, sessions.hold_min_tokens=512.
# Prints each arm's wall time and the bench report (warm p50/p90, cached).
# BIN=path/to/prefixgate runs that build instead of building this tree.
# GATEWAY_SET adds settings to every gateway ("--set routing.spread=counter").
# Never run in CI. Usage: [FAMILIES=4 TIME_SCALE=1 SIM_KV=12000 PREFILL_TPS=4100 DECODE_TPS=40] bench/sim-wall.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-4}; TIME_SCALE=${TIME_SCALE:-1}; SIM_KV=${SIM_KV:-12000}
# The simulated card's defaults (the seed's): prefill 4,100 tokens/s, decode 40.
PREFILL_TPS=${PREFILL_TPS:-4100}; DECODE_TPS=${DECODE_TPS:-40}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
for i in 0 1; do
  start_sim "s$i" --kv-tokens "$SIM_KV" --prefill-tps "$PREFILL_TPS" --decode-tps "$DECODE_TPS" --time-scale "$TIME_SCALE"
done
reps="--replica s0=${SIM_URL[s0]} --replica s1=${SIM_URL[s1]}"
common=(--set sessions.idle_ms=1000 --set sessions.hold_min_tokens=512 ${GATEWAY_SET:-})

# run ARM GATEWAY FAMILIES: one set of families through GATEWAY; prints wall and report.
run() {
  local arm=$1 gw=$2 families=$3 start
  echo "=== $arm ($families families)"
  start=$(date +%s.%N)
  $bin bench agent-loop --base-url "${GW_URL[$gw]}" --label "$arm" --families "$families" --turns 6 \
    --system-tokens 500 --context-tokens 1500 --turn-tokens 1500 --max-tokens 16 \
    | grep -E "requests:|warm turns|warm |cold |errors"
  echo "wall $arm: $(echo "$(date +%s.%N) - $start" | bc) s"
  curl -s "${GW_ADMIN[$gw]}/admin/v1/capacity" | python3 -c '
import json, sys
r = json.load(sys.stdin)["sessions"]
print("  held", r["waited"], "over capacity", r["over_capacity"], "projection", r.get("projected_tokens"))'
  curl -s "${GW_ADMIN[$gw]}/metrics" | grep -E "^prefixgate_(session_turns_paused|session_moves)_total" | sed 's/^/  /'
}

# gateway NAME [--set ...]: a fresh gateway in front of both replicas, capacity read.
gateway() {
  local name=$1; shift
  start_gateway "$name" "$bin" $reps "${common[@]}" "$@"
  wait_replicas_up "${GW_ADMIN[$name]}" 2
  for _ in $(seq 50); do
    curl -s "${GW_ADMIN[$name]}/admin/v1/capacity" | grep -q '"kv_tokens":[0-9]' && break; sleep 0.2
  done
}

gateway hold
run hold-cold hold "$FAMILIES"
sleep 3 # the first set idles out: its sessions' peaks are learned
run hold-warm hold "$FAMILIES"
gateway off --set sessions.max_wait_ms=0
run off off "$FAMILIES"
gateway two-hold
run two-hold two-hold 2
gateway two-off --set sessions.max_wait_ms=0
run two-off two-off 2
# Two at a time by hand (the whole-session schedule the hold's projection
# aims at): half the families, then the other half once they idled out,
# through the off gateway.
sleep 2
start=$(date +%s.%N)
run by-hand-1 off "$((FAMILIES / 2))"
sleep 1
run by-hand-2 off "$((FAMILIES - FAMILIES / 2))"
echo "wall by-hand (both halves, 1 s apart): $(echo "$(date +%s.%N) - $start" | bc) s"
