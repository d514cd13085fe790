#!/usr/bin/env bash
# Sessions starting together, placed by load against the seed's counter
# (issue 49): two simulated pool engines (SIM_KV, default 122,636 KV tokens
# each, --time-scale TIME_SCALE, default 0.25), FAMILIES (5) agent
# families starting at once, the first HEAVY (3) heavy (each turn adds 15x
# the light ones' 300 tokens, growing to ~64,000 tokens), all sharing a
# SHARED (15,000)-token system prompt and tools. Arms, each on a fresh
# gateway, in one run: routing.spread = load | counter, each with the
# hold on (the defaults) and off (sessions.max_wait_ms=0). Prints each
# arm's wall time, routes and cached share.
# BIN=path/to/prefixgate runs that build instead of building this tree.
# ALTERNATE=1: heavy and light families alternate (H L H L H), so the
# counter stacks every heavy one on one replica (the default puts them
# first: H H H L L, which the counter splits 2:1 as well as any placement).
# BEFORE=path/to/old/prefixgate adds two arms on that build's gateway (hold
# on, hold off) with its own defaults, the bench client still this one (a
# build from before issue 49, 901770f: the seed's counter, a continuation
# only from where a served request ended). Each arm prints its families'
# first-turn replicas in family order (H heavy, L light), and the tokens
# each replica prefilled (prompt less cached: the busiest one's bounds the wall).
# Never run in CI. Usage: [ROUNDS=1 FAMILIES=5 HEAVY=3 TURNS=10 ALTERNATE= BEFORE=] bench/load-placement.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-5}; HEAVY=${HEAVY:-3}; TURNS=${TURNS:-10}; SHARED=${SHARED:-15000}
SIM_KV=${SIM_KV:-122636}; TIME_SCALE=${TIME_SCALE:-0.25}; ROUNDS=${ROUNDS:-1}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
start_sim_pair --kv-tokens "$SIM_KV" --time-scale "$TIME_SCALE"
n=0
arm() {
  local name=$1; shift
  n=$((n + 1))
  local gw="$name-$n" gateway=$bin
  case $name in before-*) gateway=$BEFORE ;; esac
  start_gateway "$gw" "$gateway" $REPLICAS "$@"
  wait_replicas_up "${GW_ADMIN[$gw]}" 2
  $bin bench agent-loop --base-url "${GW_URL[$gw]}" --label "$name" --families "$FAMILIES" --heavy "$HEAVY" \
    --heavy-factor 15 ${ALTERNATE:+--heavy-alternate} --turns "$TURNS" --shared-tokens "$SHARED" --context-tokens 2000 --turn-tokens 300 \
    --max-tokens 16 --json >"$BENCH_TMP/$gw.json"
  python3 - "$BENCH_TMP/$gw.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["samples"]
prompt = sum(x.get("prompt_tokens") or 0 for x in s)
cached = sum(x.get("cached_tokens") or 0 for x in s)
heavy = r["settings"]["heavy_families"]
first = " ".join(("H" if x["family"] in heavy else "L") + ":" + str(x["replica"])
                 for x in sorted((x for x in s if x["turn"] == 0), key=lambda x: x["family"]))
# Each replica prefills one prompt at a time: the wall is at least the
# busiest replica's uncached tokens over its prefill rate.
prefilled = {}
for x in s:
    at = x.get("replica") or "?"
    prefilled[at] = prefilled.get(at, 0) + (x.get("prompt_tokens") or 0) - (x.get("cached_tokens") or 0)
print(f"{sys.argv[2]:16} wall {r['summary']['wall_ms'] / 1000:6.2f} s  routes {dict(r['summary']['by_route'])}  "
      f"cached {100 * cached / max(prompt, 1):.1f} %  first turns {first}  prefilled {dict(sorted(prefilled.items()))}")
PY
}
for _ in $(seq "$ROUNDS"); do
  arm load-hold --set routing.spread=load
  arm counter-hold --set routing.spread=counter
  arm load-off --set routing.spread=load --set sessions.max_wait_ms=0
  arm counter-off --set routing.spread=counter --set sessions.max_wait_ms=0
  if [ -n "${BEFORE:-}" ]; then
    arm before-hold
    arm before-off --set sessions.max_wait_ms=0
  fi
done
