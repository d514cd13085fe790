#!/usr/bin/env bash
# What a stream that may be continued costs the gateway: its CPU with
# `failover.continue_streams` on (chat and completions ask the engine for
# token ids and have them stripped; every dialect's events pass the relay)
# against off (chunks passed as they come), side by side in one run, in
# every dialect. Two gateways in front of the same instant simulated
# replica (one token a chunk); each round sends N streamed requests of
# TOKENS tokens with a prompt of BODY_KB KiB, P at a time, through each
# gateway in turn, and reads the gateway's user+system CPU time from /proc
# before and after. Prints each round, then per dialect the medians of CPU
# per request and their ratio.
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Usage: [ROUNDS=5] [N=300] [TOKENS=64] [BODY_KB=100] [P=8]
#   [DIALECTS="chat completions responses messages"] [BIN=...] bench/stream-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}; N=${N:-300}; TOKENS=${TOKENS:-64}; BODY_KB=${BODY_KB:-100}; P=${P:-8}
DIALECTS=${DIALECTS:-chat completions responses messages}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
start_sim s0 --time-scale 0 --kv-tokens 100000000
start_gateway on "$bin" --replica "s0=${SIM_URL[s0]}"
start_gateway off "$bin" --replica "s0=${SIM_URL[s0]}" --set failover.continue_streams=false
wait_replicas_up "${GW_ADMIN[on]}" 1
wait_replicas_up "${GW_ADMIN[off]}" 1

# One body per dialect and arm: a prompt of BODY_KB KiB (the arm's name in
# it, so the two arms never share a prefix), TOKENS tokens out, streamed.
python3 - "$BENCH_TMP" "$BODY_KB" "$TOKENS" <<'PY'
import json, sys
tmp, kb, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for arm in ("on", "off"):
    context = f"{arm}: " + ("The cache is warm and the prefix holds. " * (kb * 1024 // 40 + 1))[: kb * 1024]
    bodies = {
        "chat": {"model": "sim-model", "stream": True, "max_tokens": tokens,
                 "messages": [{"role": "system", "content": context}, {"role": "user", "content": "go on"}]},
        "completions": {"model": "sim-model", "stream": True, "max_tokens": tokens, "prompt": context},
        "responses": {"model": "sim-model", "stream": True, "store": False, "max_output_tokens": tokens,
                      "instructions": context, "input": [{"role": "user", "content": "go on"}]},
        "messages": {"model": "sim-model", "stream": True, "max_tokens": tokens, "system": context,
                     "messages": [{"role": "user", "content": "go on"}]},
    }
    for dialect, body in bodies.items():
        with open(f"{tmp}/{dialect}-{arm}.json", "w") as f:
            json.dump(body, f)
PY
declare -A PATHS=([chat]=/v1/chat/completions [completions]=/v1/completions [responses]=/v1/responses [messages]=/v1/messages)

# cpu_ticks PID: the process's user+system time, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# one_round DIALECT ARM: N streams through ARM's gateway; prints CPU microseconds per request.
one_round() {
  local dialect=$1 arm=$2 before after
  before=$(cpu_ticks "${GW_PID[$arm]}")
  seq "$N" | xargs -P "$P" -I{} curl -s -N -o /dev/null -H 'content-type: application/json' \
    --data-binary "@$BENCH_TMP/$dialect-$arm.json" "${GW_URL[$arm]}${PATHS[$dialect]}"
  after=$(cpu_ticks "${GW_PID[$arm]}")
  python3 -c "import os,sys; t=int(sys.argv[1]); print(t * 1e6 / os.sysconf('SC_CLK_TCK') / int(sys.argv[2]))" \
    "$((after - before))" "$N"
}

echo "N=$N TOKENS=$TOKENS BODY_KB=$BODY_KB P=$P ROUNDS=$ROUNDS build=$("$bin" --version 2>/dev/null || echo "$bin")"
results=()
for dialect in $DIALECTS; do
  # A warm-up round each (connections, allocator), not counted.
  one_round "$dialect" on >/dev/null; one_round "$dialect" off >/dev/null
  ON=(); OFF=()
  for r in $(seq "$ROUNDS"); do
    on=$(one_round "$dialect" on); off=$(one_round "$dialect" off)
    ON+=("$on"); OFF+=("$off")
    printf '%s round %s: on %.1f us/request, off %.1f us/request\n' "$dialect" "$r" "$on" "$off"
  done
  results+=("$dialect ${ON[*]} | ${OFF[*]}")
done
python3 - "${results[@]}" <<'PY'
import statistics, sys
print("| dialect | on, CPU per request | off | on / off |")
print("|---|---|---|---|")
for line in sys.argv[1:]:
    dialect, rest = line.split(" ", 1)
    on, off = ([float(x) for x in half.split()] for half in rest.split("|"))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"| {dialect} | {m_on:.0f} us | {m_off:.0f} us | {m_on / m_off:.2f}x |")
PY
