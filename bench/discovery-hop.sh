#!/usr/bin/env bash
# Does discovery cost anything on the request path? Two gateways in the same
# run, in front of the same 64 instant simulated replicas (127.0.0.2 ..
# 127.0.0.65, one port): one names them with 64 --replica flags, the other
# finds them through a dns:// source against dnsmasq, read again every
# INTERVAL_MS (default 100 ms: 50x the default rate, so the resolutions
# happen during every measurement). Rounds are interleaved and medians
# compared, as in bench/hop.sh; CPU per request is the gateway process's
# user+system time from /proc (resolutions included) over the requests wrk
# completed. Never run in CI.
# Needs: apt-get install -y wrk dnsmasq-base
# Usage: ROUNDS=5 SECS=10 [INTERVAL_MS=100] bench/discovery-hop.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
ROUNDS=${ROUNDS:-5}; SECS=${SECS:-10}; INTERVAL_MS=${INTERVAL_MS:-100}; N=64
cargo build --release -q --bin prefixgate || exit 1
bin=$PWD/target/release/prefixgate
bench_init
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$BENCH_TMP"' EXIT

# The replicas: one port free on every address, then one sim per address.
port=$(free_port)
static=()
: > "$BENCH_TMP/hosts"
for i in $(seq 2 $((N + 1))); do
  "$bin" sim-replica --host "127.0.0.$i" --port "$port" --time-scale 0 >"$BENCH_TMP/sim-$i.out" 2>&1 &
  static+=(--replica "r$i=http://127.0.0.$i:$port")
  echo "127.0.0.$i engines.bench" >> "$BENCH_TMP/hosts"
done
dns_port=$(free_port)
/usr/sbin/dnsmasq --keep-in-foreground --conf-file=/dev/null --no-resolv --no-hosts --bind-interfaces \
  --listen-address=127.0.0.1 --local-ttl=1 --user=root --pid-file= --local=/bench/ --port="$dns_port" \
  --addn-hosts="$BENCH_TMP/hosts" >"$BENCH_TMP/dnsmasq.log" 2>&1 &

start_gateway static "$bin" "${static[@]}"
start_gateway discovered "$bin" --set "discovery=[{url=\"dns://engines.bench:$port?resolver=127.0.0.1:$dns_port\", interval_ms=$INTERVAL_MS}]"
for gw in static discovered; do wait_replicas_up "${GW_ADMIN[$gw]}" "$N" || exit 1; done
for gw in static discovered; do wait_ok "${GW_URL[$gw]}" || exit 1; run_wrk "${GW_URL[$gw]}" 2 4 >/dev/null; done
reads0=$(curl -s "${GW_ADMIN[discovered]}/metrics" | awk '/^prefixgate_discovery_reads_total\{.*result="ok"/ {s += $2} END {print s}')

ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
: > "$BENCH_TMP/results"
for round in $(seq 1 "$ROUNDS"); do
  for gw in static discovered; do
    c0=$(cpu "${GW_PID[$gw]}")
    out=$(run_wrk "${GW_URL[$gw]}" "$SECS" 32)
    c1=$(cpu "${GW_PID[$gw]}")
    if echo "$out" | grep -q "Non-2xx"; then echo "round $round $gw: errors, skipped" >&2; continue; fi
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    awk -v g="$gw" -v r="$round" -v q="$reqs" -v c=$((c1 - c0)) -v t="$ticks" -v rps="$rps" \
      'BEGIN {printf "%s %s %s %.1f\n", g, r, rps, c / t * 1e6 / q}' >> "$BENCH_TMP/results"
    tail -1 "$BENCH_TMP/results" >&2
  done
done
reads1=$(curl -s "${GW_ADMIN[discovered]}/metrics" | awk '/^prefixgate_discovery_reads_total\{.*result="ok"/ {s += $2} END {print s}')

echo "Machine: $(nproc) cores; $N replicas; wrk -t2 -c32 -d${SECS}s; $ROUNDS rounds interleaved; $(date -u +%F)"
echo "The discovering gateway read its source $((reads1 - reads0)) times during the measurements (every ${INTERVAL_MS} ms)."
echo
echo "| gateway | req/s (median) | CPU per request (median) | vs static |"
echo "|---|---|---|---|"
python3 - "$BENCH_TMP/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    g, _, rps, cpu = line.split()
    rows.setdefault(g, []).append((float(rps), float(cpu)))
med = lambda g, i: statistics.median(r[i] for r in rows[g])
for g in rows:
    print(f"| {g} | {med(g, 0):,.0f} | {med(g, 1):.1f} µs | {med(g, 1) / med('static', 1):.2f}x |")
PY
