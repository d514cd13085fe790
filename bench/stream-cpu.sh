#!/usr/bin/env bash
# What a stream that may outlive its replica costs the gateway (issue 42):
# its CPU per streamed chunk with `failover.continue_streams` on (the
# engine asked for token ids, every event read whole and its ids stripped)
# against off (chunks passed as they come), side by side in one run. Two
# gateways in front of the same instant simulated replica (one token a
# chunk); each round sends N streamed chat completions of TOKENS tokens,
# P at a time, through each gateway in turn, and reads the gateway's
# user+system CPU time from /proc before and after. Prints each round and
# the medians, and their ratio.
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Usage: [ROUNDS=5] [N=200] [TOKENS=500] [P=8] [BIN=...] bench/stream-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}; N=${N:-200}; TOKENS=${TOKENS:-500}; P=${P:-8}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
start_sim s0 --time-scale 0
start_gateway on "$bin" --replica "s0=${SIM_URL[s0]}"
start_gateway off "$bin" --replica "s0=${SIM_URL[s0]}" --set failover.continue_streams=false
wait_replicas_up "${GW_ADMIN[on]}" 1
wait_replicas_up "${GW_ADMIN[off]}" 1

# cpu_ticks PID: the process's user+system time, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# one_round ARM: N streams through ARM's gateway; prints CPU microseconds per chunk.
one_round() {
  local arm=$1 before after
  before=$(cpu_ticks "${GW_PID[$arm]}")
  seq "$N" | xargs -P "$P" -I{} curl -s -N -o /dev/null -H 'content-type: application/json' \
    -d "{\"model\":\"sim-model\",\"messages\":[{\"role\":\"user\",\"content\":\"stream {} $arm\"}],\"stream\":true,\"max_tokens\":$TOKENS}" \
    "${GW_URL[$arm]}/v1/chat/completions"
  after=$(cpu_ticks "${GW_PID[$arm]}")
  python3 -c "import os,sys; t=int(sys.argv[1]); print(t * 1e6 / os.sysconf('SC_CLK_TCK') / (int(sys.argv[2]) * int(sys.argv[3])))" \
    "$((after - before))" "$N" "$TOKENS"
}

# A warm-up round each (connections, allocator), not counted.
one_round on >/dev/null; one_round off >/dev/null
declare -a ON OFF
for r in $(seq "$ROUNDS"); do
  on=$(one_round on); off=$(one_round off)
  ON+=("$on"); OFF+=("$off")
  printf 'round %s: on %.2f us/chunk, off %.2f us/chunk\n' "$r" "$on" "$off"
done
python3 - "${ON[*]}" "${OFF[*]}" <<'PY'
import statistics, sys
on = [float(x) for x in sys.argv[1].split()]
off = [float(x) for x in sys.argv[2].split()]
m_on, m_off = statistics.median(on), statistics.median(off)
print(f"median CPU per chunk: on {m_on:.2f} us, off {m_off:.2f} us: {m_on / m_off:.2f}x")
PY
