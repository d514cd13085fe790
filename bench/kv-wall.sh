#!/usr/bin/env bash
# Sessions at the KV wall, on real engines (issue 26): two llama.cpp
# `llama-server` replicas that each keep one conversation's prefix
# (`-np 1 --cache-ram 0`, one core each), four agent families at once (a
# shared system prompt, each its own task, TURNS turns growing ~240 tokens a
# turn), through the gateway with the hold on (default settings) and off
# (`sessions.max_wait_ms=0`), one after the other in one run. Salted runs:
# no run reads another's cache. Prints the bench reports.
# Build llama-server as ../shared/notes/engines.md says, then:
# Usage: LLAMA_SERVER=/path/llama-server MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf bench/kv-wall.sh
# Without LLAMA_SERVER: two simulated replicas of SIM_KV (2,200) KV tokens each
# (vLLM-like: capacity from their metrics, LRU eviction of cached prefixes),
# prefill at 300 tokens/s, the same families (for a quick look; the real
# engines are the claim).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-}; MODEL=${MODEL:-}
FAMILIES=${FAMILIES:-4}; TURNS=${TURNS:-6}; IDLE_MS=${IDLE_MS:-5000}
cargo build --release -q
bin=$PWD/target/release/prefixgate
source bench/lib.sh
bench_init
declare -A LLAMA_URL
model=smollm2
extra=()
if [ -n "$LLAMA_SERVER" ]; then
  for i in 0 1; do
    port=$(free_port)
    taskset -c "$i" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" -t 1 -c 16384 -np 1 \
      --cache-ram 0 --jinja -a smollm2 --metrics >"$BENCH_TMP/llama-$i.log" 2>&1 &
    LLAMA_URL[$i]="http://127.0.0.1:$port"
  done
  for i in 0 1; do
    for _ in $(seq 300); do curl -sf "${LLAMA_URL[$i]}/health" >/dev/null && break; sleep 0.2; done
  done
else
  model=sim-model
  # Sessions here are ~1,200-2,400 tokens: below the default hold_min_tokens.
  extra=(--set sessions.hold_min_tokens=512)
  for i in 0 1; do
    start_sim "s$i" --kv-tokens "${SIM_KV:-2200}" --prefill-tps 300 --decode-tps 40 --time-scale 1
    LLAMA_URL[$i]=${SIM_URL[s$i]}
  done
fi
reps="--replica l0=${LLAMA_URL[0]} --replica l1=${LLAMA_URL[1]}"
for arm in hold off; do
  wait_ms=120000; [ "$arm" = off ] && wait_ms=0
  start_gateway "$arm" "$bin" $reps --set "sessions.max_wait_ms=$wait_ms" --set "sessions.idle_ms=$IDLE_MS" "${extra[@]}"
  wait_replicas_up "${GW_ADMIN[$arm]}" 2
  # The capacity read from /props (slots x context) before anything runs.
  for _ in $(seq 50); do
    curl -s "${GW_ADMIN[$arm]}/admin/v1/capacity" | grep -q '"kv_tokens":[0-9]' && break; sleep 0.2
  done
  echo "=== arm=$arm (sessions.max_wait_ms=$wait_ms, idle_ms=$IDLE_MS)"
  curl -s "${GW_ADMIN[$arm]}/admin/v1/capacity" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("capacity:", [(x["replica"], x["kv_tokens"]) for x in r["replicas"]])'
  start=$(date +%s.%N)
  $bin bench agent-loop --base-url "${GW_URL[$arm]}" --model "$model" --label "$arm" --families "$FAMILIES" \
    --turns "$TURNS" --system-tokens 740 --context-tokens 450 --turn-tokens 240 --max-tokens 16
  echo "wall: $(echo "$(date +%s.%N) - $start" | bc) s"
  curl -s "${GW_ADMIN[$arm]}/admin/v1/capacity" | python3 -c 'import json,sys; print("queue:", json.load(sys.stdin)["sessions"])'
  kill "${GW_PID[$arm]}"
done
