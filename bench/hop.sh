#!/usr/bin/env bash
# The proxy hop's CPU against nginx, side by side in one run: prefixgate
# (this tree's release build, with tracing off and on (every request
# sampled, spans exported to a local collector, and to a collector that is
# down); with BOLT=1 also its optimized build from
# bench/bolt.sh; plus BEFORE=<binary> when given), the
# framework floor (examples/bare_proxy.rs: actix-web + awc forwarding with
# none of prefixgate's logic) and nginx, each in front of the same two
# instant simulated replicas, under wrk -t2 -c32. Rounds are interleaved
# (every target once per round) and the medians compared, because a 2-core
# machine that also runs wrk and the backends is noisy: single runs move by
# +-8 %. CPU per request is the process tree's user+system time from /proc
# divided by the requests wrk completed. With PEERS=1 the routers users
# would pick instead, smg and vllm-router (round robin), run in the same
# rounds (installed into a throwaway venv, as bench/overhead.sh does).
# Never run in CI.
# Needs: apt-get install -y nginx wrk (and bolt-16 for BOLT=1; pip for PEERS=1).
# Usage: ROUNDS=7 SECS=10 [BOLT=1] [PEERS=1] [BEFORE=path/to/old/prefixgate] bench/hop.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
source bench/nginx.sh
ROUNDS=${ROUNDS:-7}; SECS=${SECS:-10}
cargo build --release -q --bin prefixgate --example bare_proxy || exit 1
if [ -n "${BOLT:-}" ]; then bench/bolt.sh >/dev/null || exit 1; fi
bin=$PWD/target/release/prefixgate
bare=$PWD/target/release/examples/bare_proxy
venv=${VENV:-$PWD/target/routers-venv}
if [ -n "${PEERS:-}" ] && { [ ! -x "$venv/bin/smg" ] || [ ! -x "$venv/bin/vllm-router" ]; }; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q smg vllm-router >&2 || exit 1
fi
bench_init
trap 'kill $(jobs -p) 2>/dev/null; nginx -c "$BENCH_TMP/nginx.conf" -s stop 2>/dev/null; wait 2>/dev/null; rm -rf "$BENCH_TMP"' EXIT

start_sim a --time-scale 0
start_sim b --time-scale 0
declare -A PID URL; names=()
add() { # name url pid
  URL[$1]=$2; PID[$1]=$3; names+=("$1")
}
replicas="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
start_gateway prefixgate "$bin" $replicas
add prefixgate "${GW_URL[prefixgate]}" "${GW_PID[prefixgate]}"
# The same build with tracing on, every request sampled, exporting to a
# collector that takes the spans and answers 200 (its CPU is not counted:
# the column is the gateway's own cost of making and sending spans).
start_collector
start_gateway prefixgate-traced "$bin" $replicas --set "tracing.endpoint=$COLLECTOR_URL" \
  --set tracing.sample_ratio=1
add prefixgate-traced "${GW_URL[prefixgate-traced]}" "${GW_PID[prefixgate-traced]}"
# And with the collector down (nothing listens on its port): every export
# fails and its spans are counted as dropped; requests must not notice.
start_gateway prefixgate-traced-down "$bin" $replicas --set "tracing.endpoint=http://127.0.0.1:$(free_port)/v1/traces" \
  --set tracing.sample_ratio=1
add prefixgate-traced-down "${GW_URL[prefixgate-traced-down]}" "${GW_PID[prefixgate-traced-down]}"
if [ -n "${BOLT:-}" ]; then
  start_gateway prefixgate-bolt "$PWD/target/bolt/prefixgate" $replicas
  add prefixgate-bolt "${GW_URL[prefixgate-bolt]}" "${GW_PID[prefixgate-bolt]}"
fi
if [ -n "${BEFORE:-}" ]; then
  start_gateway before "$BEFORE" $replicas
  add before "${GW_URL[before]}" "${GW_PID[before]}"
fi
port=$(free_port)
"$bare" "127.0.0.1:$port" "${SIM_URL[a]}" "${SIM_URL[b]}" >"$BENCH_TMP/floor.log" 2>&1 &
add floor "http://127.0.0.1:$port" $!
port=$(free_port)
nginx_conf "$BENCH_TMP" "$port" "${SIM_URL[a]#http://} ${SIM_URL[b]#http://}"
nginx -c "$BENCH_TMP/nginx.conf" >"$BENCH_TMP/nginx.log" 2>&1 &
add nginx "http://127.0.0.1:$port" $!
if [ -n "${PEERS:-}" ]; then
  port=$(free_port)
  "$venv/bin/smg" launch --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --policy round_robin \
    --worker-urls "${SIM_URL[a]}" "${SIM_URL[b]}" >"$BENCH_TMP/smg.log" 2>&1 &
  add smg "http://127.0.0.1:$port" $!
  port=$(free_port)
  "$venv/bin/vllm-router" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" --policy round_robin \
    --worker-urls "${SIM_URL[a]}" "${SIM_URL[b]}" >"$BENCH_TMP/vllm-router.log" 2>&1 &
  add vllm-router "http://127.0.0.1:$port" $!
fi

for gw in "${!GW_ADMIN[@]}"; do wait_replicas_up "${GW_ADMIN[$gw]}" 2 || exit 1; done
for n in "${names[@]}"; do wait_ok "${URL[$n]}" || exit 1; done
for n in "${names[@]}"; do # warm up: connections, pools, caches
  run_wrk "${URL[$n]}" 2 4 >/dev/null
done

ticks=$(getconf CLK_TCK)
tree() { local p=$1; echo "$p"; for c in $(pgrep -P "$p" 2>/dev/null); do tree "$c"; done; }
cpu() { # user and system ticks of a process tree
  local u=0 s=0 a b
  for p in $(tree "$1"); do read -r a b < <(awk '{print $14, $15}' "/proc/$p/stat"); u=$((u + a)); s=$((s + b)); done
  echo "$u $s"
}
: > "$BENCH_TMP/results"
for round in $(seq 1 "$ROUNDS"); do
  for n in "${names[@]}"; do
    read -r u0 s0 < <(cpu "${PID[$n]}")
    out=$(run_wrk "${URL[$n]}" "$SECS" 32)
    read -r u1 s1 < <(cpu "${PID[$n]}")
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    if echo "$out" | grep -q "Non-2xx"; then echo "round $round $n: errors, skipped" >&2; continue; fi
    awk -v n="$n" -v r="$round" -v q="$reqs" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v t="$ticks" \
      -v rps="$(echo "$out" | awk '/Requests\/sec/ {print $2}')" \
      'BEGIN {printf "%s %s %s %.1f %.1f %.1f\n", n, r, rps, (u + s) / t * 1e6 / q, u / t * 1e6 / q, s / t * 1e6 / q}' >> "$BENCH_TMP/results"
    tail -1 "$BENCH_TMP/results" >&2
  done
done

echo "Machine: $(nproc) cores; wrk -t2 -c32 -d${SECS}s; $ROUNDS rounds interleaved; $(date -u +%F)"
echo
echo "| target | req/s (median) | CPU per request (median) | user | system | vs nginx |"
echo "|---|---|---|---|---|---|"
python3 - "$BENCH_TMP/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    n, _, rps, total, user, system = line.split()
    rows.setdefault(n, []).append((float(rps), float(total), float(user), float(system)))
med = lambda n, i: statistics.median(r[i] for r in rows[n])
base = med("nginx", 1)
for n in rows:
    print(f"| {n} | {med(n, 0):,.0f} | {med(n, 1):.1f} µs | {med(n, 2):.1f} µs | {med(n, 3):.1f} µs | {med(n, 1) / base:.2f}x |")
PY
