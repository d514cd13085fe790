#!/usr/bin/env bash
# Instructions per proxied request, prefixgate against the framework floor
# (examples/bare_proxy.rs), counted by callgrind. Unlike bench/hop.sh's CPU
# time, the count repeats within ~150 instructions per request (0.2 %) for
# the same binaries on a quiet machine, so a change of a few hundred shows.
# The event loop's wakeups still depend on timing: with the machine busy
# (a build, a test run) the same binary counted ~1,000 more. Run it alone.
# It does not see what the hardware adds (cache misses, atomics shared
# between cores): hop.sh stays the measure, this one says where to look.
#
# Each proxy runs under callgrind twice, for N and 3N sequential keep-alive
# requests (4 connections, bench/hop.sh's body) after a warm-up; the
# difference divided by 2N is the cost of one request, with startup and
# shutdown cancelled out. Builds the `profiling` profile (release with line
# tables), so `callgrind_annotate` on the kept outputs names source lines.
# Never run in CI. Needs: valgrind.
# With BEFORE=<binary>, an older build is counted too (tracing off: unchanged?).
# Usage: N=1000 [BEFORE=path/to/old/prefixgate] bench/hop-instructions.sh   (outputs kept in $OUT, default /tmp/hop-instructions)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-1000}; OUT=${OUT:-/tmp/hop-instructions}
mkdir -p "$OUT"
cargo build --profile profiling -q --bin prefixgate --example bare_proxy
bin=$PWD/target/profiling/prefixgate
bare=$PWD/target/profiling/examples/bare_proxy
source bench/lib.sh
bench_init
start_sim a --time-scale 0
start_sim b --time-scale 0

# requests PORT COUNT: COUNT POSTs over 4 keep-alive connections, each a 200.
requests() {
  python3 - "$1" "$2" <<'PY'
import http.client, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = b'{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"overhead probe"}]}'
conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(4)]
for i in range(n):
    c = conns[i % 4]
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
PY
}

# count NAME COUNT PORT COMMAND...: instructions while COUNT requests are served on PORT.
count() {
  local name=$1 n=$2 port=$3; shift 3
  local out="$OUT/$name.$n.callgrind"
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" "$@" >"$OUT/$name.$n.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    curl -sf -o /dev/null -H 'content-type: application/json' \
      -d '{"model":"sim-model","messages":[{"role":"user","content":"x"}]}' \
      "http://127.0.0.1:$port/v1/chat/completions" && break
    sleep 0.5
  done
  requests $port 200 # warm up: connections, pools, first-use tables
  callgrind_control -i on $pid >/dev/null 2>&1
  requests $port "$n"
  callgrind_control -i off $pid >/dev/null 2>&1
  kill -INT $pid
  wait $pid || true
  awk '/^totals:/ {print $2}' "$out"
}

replicas="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
start_collector
declare -A per
targets="prefixgate prefixgate-traced floor${BEFORE:+ before}"
for target in $targets; do
  # Under valgrind a process is too slow to print its port in time: it is given a free one.
  port=$(free_port)
  if [ $target = prefixgate ]; then cmd=($bin serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" $replicas)
  elif [ $target = before ]; then cmd=($BEFORE serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" $replicas)
  elif [ $target = prefixgate-traced ]; then
    cmd=($bin serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" $replicas
      --set "tracing.endpoint=$COLLECTOR_URL" --set tracing.sample_ratio=1)
  else cmd=($bare "127.0.0.1:$port" "${SIM_URL[a]}" "${SIM_URL[b]}"); fi
  small=$(count $target "$N" "$port" "${cmd[@]}")
  large=$(count $target $((3 * N)) "$port" "${cmd[@]}")
  per[$target]=$(( (large - small) / (2 * N) ))
done
echo "| target | instructions per request | vs floor |"
echo "|---|---|---|"
for target in $targets; do
  awk -v t=$target -v n="${per[$target]}" -v f="${per[floor]}" 'BEGIN {printf "| %s | %d | %.2fx |\n", t, n, n / f}'
done
echo
echo "callgrind outputs: $OUT (callgrind_annotate --auto=yes $OUT/prefixgate.$((3 * N)).callgrind)"
