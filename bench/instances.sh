#!/usr/bin/env bash
# Agent loops through 1, 2 and 4 gateway instances sharing one Redis, the
# client sending each turn to the next instance (consecutive turns of a
# family never reach the same instance) with no pause between turns unless
# PAUSE_MS says so, in front of two simulated cards. Three dialects: chat,
# Responses chains (store: true, previous_response_id) and Anthropic
# Messages. Reports warm turns on their family's replica, errors (a broken
# Responses chain is an error), and the propagation delay between instances
# (p50/p99 from the instances' own prefixgate_shared_propagation_seconds).
# Every run is salted and starts a fresh Redis. Needs redis-server.
# GATEWAY=path/to/another/prefixgate serves instead of this tree's build (the
# bench client stays this tree's), to compare two builds in one run.
# Usage: FAMILIES=4 TURNS=6 CONTEXT=20000 PAUSE_MS=0 APIS="chat responses-chain messages" bench/instances.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-4}; TURNS=${TURNS:-6}; CONTEXT=${CONTEXT:-20000}; TIME_SCALE=${TIME_SCALE:-0.05}
PAUSE_MS=${PAUSE_MS:-0}; APIS=${APIS:-"chat responses-chain messages"}; COUNTS=${COUNTS:-"1 2 4"}
# The flusher's interval (the default); a large one shows the announcements alone carry pins.
FLUSH_MS=${FLUSH_MS:-200}
cargo build --release -q
bin=$PWD/target/release/prefixgate
gateway=${GATEWAY:-$bin}
source bench/lib.sh
bench_init
tmp=$BENCH_TMP
start_sim a --time-scale "$TIME_SCALE"
start_sim b --time-scale "$TIME_SCALE"

# p50 and p99 of the propagation histogram summed over the instances' scrapes,
# and how stored response ids unknown where they arrived were found.
percentiles() {
  python3 - "$@" <<'PY'
import re, sys, urllib.request
buckets, lookups = {}, {}
for url in sys.argv[1:]:
    for line in urllib.request.urlopen(url).read().decode().splitlines():
        m = re.match(r'prefixgate_stored_response_lookups_total\{result="(\w+)"\} (\S+)', line)
        if m:
            lookups[m[1]] = lookups.get(m[1], 0) + int(float(m[2]))
        m = re.match(r'prefixgate_shared_propagation_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            le = float("inf") if m[1] == "+Inf" else float(m[1])
            buckets[le] = buckets.get(le, 0) + float(m[2])
total = buckets.get(float("inf"), 0)
def q(p):
    for le in sorted(buckets):
        if buckets[le] >= p * total:
            return "%.2f ms" % (le * 1000) if le != float("inf") else "> 1.6 s"
print("stored response ids unknown where they arrived, found by:", lookups)
print("propagation (upper bucket bound): n=%d p50<=%s p99<=%s" % (total, q(0.5), q(0.99)) if total else "propagation: no samples (one instance)")
PY
}

for n in $COUNTS; do
  start_redis "$tmp/r$n.sock"
  urls=(); admins=()
  for i in $(seq 1 "$n"); do
    PREFIXGATE_STORE_INSTANCE="gw$i" PREFIXGATE_PINS_FLUSH_INTERVAL_MS=$FLUSH_MS \
      start_gateway "n$n-gw$i" "$gateway" --store "redis+unix://$tmp/r$n.sock" \
      --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}"
    urls+=("${GW_URL[n$n-gw$i]}"); admins+=("${GW_ADMIN[n$n-gw$i]}")
  done
  for admin in "${admins[@]}"; do wait_replicas_up "$admin" 2; done
  for api in $APIS; do
    echo "=== $n instance(s), $api, pause ${PAUSE_MS} ms"
    $bin bench agent-loop --base-url "$(IFS=,; echo "${urls[*]}")" --label "$n-instances-$api" --api "$api" \
      --families "$FAMILIES" --turns "$TURNS" --context-tokens "$CONTEXT" --turn-tokens 300 --max-tokens 8 \
      --pause-ms "$PAUSE_MS" | grep -E "requests:|warm turns|warm |cold |by route|warning"
  done
  percentiles "${admins[@]/%//metrics}"
  for i in $(seq 1 "$n"); do kill "${GW_PID[n$n-gw$i]}"; done
done
