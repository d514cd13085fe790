#!/usr/bin/env bash
# Recorded agent traffic through prefixgate and vllm-router in front of the
# same two replicas (issue 49): `prefixgate bench replay` sends a trace's
# calls (JSON lines: task, after_ms, path, body), each task's in order with
# its recorded tool pauses, every task at once; each text cut to KEEP_TEXT
# (0.06) of itself, the same cut in every call, so prefixes stay prefixes
# and the recording fits SmolLM2; MAX_TOKENS (16) out per call.
#
# TRACE: a trace of your own; default bench/agent-trace.py's (eight coding
# and assistant tasks, 168 calls, tails rewritten as agents do), written to
# target/agent-trace.jsonl.
# Replicas and arms as bench/routers.sh says (ENGINE=sim | llama, or
# REPLICA_URLS; ARMS, default "prefixgate vllm-router"), started afresh (or
# their caches emptied) for every arm; ROUNDS alternate the arms' order.
# Prints per arm: wall, TTFT p50 / p90, errors, cached share (the engines'
# usage), and for prefixgate its routes, how often a task changed replica
# and its events by kind. Reports kept under target/replay/ (prefixgate's
# events and capacity view beside them).
#
# PAUSE_SCALE (1): the recorded tool pauses times this (0: none, so the
# engines, not the tools, set the wall).
#
# Usage: [ENGINE=sim|llama] [ARMS=...] [ROUNDS=1] [TRACE=...] [KEEP_TEXT=0.06] [PAUSE_SCALE=1] [BIN=...] bench/replay.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ARMS=${ARMS:-prefixgate vllm-router}; ROUNDS=${ROUNDS:-1}; KEEP_TEXT=${KEEP_TEXT:-0.06}; MAX_TOKENS=${MAX_TOKENS:-16}
PAUSE_SCALE=${PAUSE_SCALE:-1}
if [ -z "${BIN:-}" ]; then cargo build --release -q; BIN=$PWD/target/release/prefixgate; fi
bin=$BIN
trace=${TRACE:-$PWD/target/agent-trace.jsonl}
if [ -z "${TRACE:-}" ]; then mkdir -p target && python3 bench/agent-trace.py >"$trace"; fi

source bench/lib.sh
source bench/routers.sh
install_vllm_router
bench_init
check_engine

run_arm() {
  local arm=$1 round=$2 out=$BENCH_TMP/$1-$2.json
  router_up "$arm"
  "$bin" bench replay --base-url "$ROUTER_URL" --model "$model" --max-tokens "$MAX_TOKENS" --trace "$trace" \
    --keep-text "$KEEP_TEXT" --pause-scale "$PAUSE_SCALE" --label "$arm" --json >"$out"
  python3 - "$out" "$arm" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
s = r["samples"]
ok = [x for x in s if not x.get("error")]
ttft = sorted(x["ttft_ms"] for x in ok if x.get("ttft_ms") is not None)
p = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] / 1000 if ttft else float("nan")
prompt = sum(x.get("prompt_tokens") or 0 for x in ok)
cached = sum(x.get("cached_tokens") or 0 for x in ok)
line = (f"{sys.argv[2]:20} wall {r['summary']['wall_ms'] / 1000:7.2f} s  TTFT p50 {p(0.5):.3f} p90 {p(0.9):.3f} s  "
        f"calls {len(s)} errors {len(s) - len(ok)}  cached {100 * cached / max(prompt, 1):.1f} %")
routes = {}
for x in ok:
    if x.get("route"):
        routes[x["route"]] = routes.get(x["route"], 0) + 1
if routes:
    by_task = {}
    for x in sorted(ok, key=lambda x: (x["family"], x["turn"])):
        by_task.setdefault(x["family"], []).append(x["replica"])
    changes = sum(sum(a != b for a, b in zip(v, v[1:])) for v in by_task.values())
    line += f"  routes {dict(sorted(routes.items()))}  replica changes {changes}"
print(line)
for x in s:
    if x.get("error"):
        print(f"  error (task {x['family']} call {x['turn']}): {x['error'][:300]}")
        break
PY
  mkdir -p target/replay && cp "$out" "target/replay/$arm-$round.json"
  if [ -n "${GW_ADMIN[$arm]:-}" ]; then
    # What the gateway decided on the way: its events (walls seen and
    # forgotten, pauses, moves) and what it learned of each replica.
    local events=target/replay/$arm-$round-events.json
    curl -sf "${GW_ADMIN[$arm]}/admin/v1/events?limit=1000" >"$events" || true
    curl -sf "${GW_ADMIN[$arm]}/admin/v1/capacity" >"target/replay/$arm-$round-capacity.json" || true
    python3 - "$events" "target/replay/$arm-$round-capacity.json" <<'PY' || true
import collections, json, sys
kinds = collections.Counter(e["kind"] for e in json.load(open(sys.argv[1]))["items"])
print("  events", dict(sorted(kinds.items())))
rates = {r["replica"]: r.get("prefill_tokens_per_s") for r in json.load(open(sys.argv[2]))["replicas"]}
print("  measured prefill, tokens/s", rates)
PY
  fi
  kill "$ROUTER_PID" 2>/dev/null || true; wait "$ROUTER_PID" 2>/dev/null || true
}

replicas=$ENGINE
[ -n "$REPLICA_URLS" ] && replicas="$REPLICA_URLS ($model)"
echo "=== replay of $trace ($(wc -l <"$trace") calls), text kept $KEEP_TEXT, pauses x$PAUSE_SCALE, replicas $replicas, $(date -u +%F)"
arms=($ARMS)
for r in $(seq 1 "$ROUNDS"); do
  order=("${arms[@]}")
  [ $((r % 2)) -eq 0 ] && order=($(printf '%s\n' "${arms[@]}" | tac))
  for arm in "${order[@]}"; do
    replicas_up || { echo "could not empty the replicas' caches" >&2; exit 1; }
    run_arm "$arm" "$r"
  done
done
