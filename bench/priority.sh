#!/usr/bin/env bash
# Who waits at the wall (issue 33), on two simulated replicas of 12,000 KV
# tokens (one 8,700-token family fits each), sessions.idle_ms=1000.
# Families: a 500-token system prompt, an 8,000-token context, 200 tokens a
# turn, 6 turns. Each arm on a fresh gateway:
#   alone    one interactive family alone
#   mixed    four background families, then one second later one
#            interactive family: its first-turn wait against the held
#            background sessions' mean wait (prefixgate_session_hold_seconds
#            by class), its run against alone, background errors
#   clients  client A opens 6 families at once, client B one 0.5 s later
#            (default class): how many of A's held sessions were placed
#            between B's arrival and B's placement (history's session_held)
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Usage: [TIME_SCALE=0.25] bench/priority.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TIME_SCALE=${TIME_SCALE:-0.25}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
for i in 0 1; do start_sim "s$i" --kv-tokens 12000 --time-scale "$TIME_SCALE"; done
reps="--replica s0=${SIM_URL[s0]} --replica s1=${SIM_URL[s1]}"

gateway() {
  local name=$1; shift
  start_gateway "$name" "$bin" $reps --set sessions.idle_ms=1000 "$@"
  wait_replicas_up "${GW_ADMIN[$name]}" 2
  for _ in $(seq 50); do
    curl -s "${GW_ADMIN[$name]}/admin/v1/capacity" | grep -q '"kv_tokens":[0-9]' && break; sleep 0.2
  done
}

# loop GATEWAY FAMILIES OUT [--header ...]: an agent loop; its report as JSON in OUT.
loop() {
  local gw=$1 families=$2 out=$3; shift 3
  $bin bench agent-loop --base-url "${GW_URL[$gw]}" --families "$families" --turns 6 \
    --system-tokens 500 --context-tokens 8000 --turn-tokens 200 --max-tokens 16 --json "$@" > "$out"
}

wall() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(round(r["summary"]["wall_ms"]/1000, 2))' "$1"; }
errors() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(sum(1 for s in r["samples"] if s.get("error")))' "$1"; }
hold_mean() { # ADMIN CLASS: mean hold seconds of the class, and how many
  curl -s "$1/metrics" | python3 -c '
import re, sys
text, cls = sys.stdin.read(), sys.argv[1]
get = lambda k: float(re.search(r"prefixgate_session_hold_seconds_%s\{class=\"%s\"\} (\S+)" % (k, cls), text).group(1))
n, total = get("count"), get("sum")
print("%.2f s over %d" % (total / n if n else 0, n))' "$2"
}

tmp=$(mktemp -d)
gateway alone
loop alone 1 "$tmp/alone.json" --header x-prefixgate-priority:interactive
echo "alone: interactive family $(wall "$tmp/alone.json") s"

gateway mixed
loop mixed 4 "$tmp/bg.json" --header x-prefixgate-priority:background & bg=$!
sleep 1
loop mixed 1 "$tmp/int.json" --header x-prefixgate-priority:interactive
wait $bg
echo "mixed: interactive family $(wall "$tmp/int.json") s (alone $(wall "$tmp/alone.json") s), background $(wall "$tmp/bg.json") s, background errors $(errors "$tmp/bg.json")"
echo "  interactive first-turn hold: $(hold_mean "${GW_ADMIN[mixed]}" interactive); background held: $(hold_mean "${GW_ADMIN[mixed]}" background)"
curl -s "${GW_ADMIN[mixed]}/metrics" | grep -E "^prefixgate_sessions_preempted_total|^prefixgate_session_turns_paused_total" | sed 's/^/  /'

gateway clients --set priority.client_header=true
loop clients 6 "$tmp/a.json" --header x-prefixgate-client:A & a=$!
sleep 0.5
loop clients 1 "$tmp/b.json" --header x-prefixgate-client:B
wait $a
echo "clients: A $(wall "$tmp/a.json") s (errors $(errors "$tmp/a.json")), B $(wall "$tmp/b.json") s"
curl -s "${GW_ADMIN[clients]}/admin/v1/events?kind=session_held&limit=100" | python3 -c '
import json, re, sys
events = json.load(sys.stdin)
events = events["items"]
held = []
for e in events:
    m = re.search(r"client (\S+)\) waited (\d+) ms", e["detail"])
    if m: held.append((m.group(1), e["at_ms"], int(m.group(2))))
b = [h for h in held if h[0] == "B"]
if not b: print("  B was never held"); sys.exit()
_, placed, waited = b[0]
arrived = placed - waited
before = [h for h in held if h[0] == "A" and arrived < h[1] <= placed]
print(f"  B waited {waited} ms; A sessions placed meanwhile: {len(before)}")'
rm -rf "$tmp"
