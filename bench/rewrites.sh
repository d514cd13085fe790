#!/usr/bin/env bash
# Agent loops whose tail is rewritten each turn (`agent-loop --rewrite`),
# against the same loops without the rewrite, on two simulated pool
# engines (122,636 KV tokens each, --time-scale 0.25). Prints, per form, the
# share of turns after the first routed as continuations on the previous
# turn's replica, the share on that replica however routed, the cached
# share of prompt tokens and the wall time.
# Usage: [BIN=target/release/prefixgate] bench/rewrites.sh [families] [turns]
set -euo pipefail
cd "$(dirname "$0")/.."
families=${1:-4}; turns=${2:-8}
bin=${BIN:-target/release/prefixgate}
[ -x "$bin" ] || cargo build --release -q --bin prefixgate
source bench/lib.sh
bench_init
SIM_BIN=$bin start_sim_pair --time-scale 0.25
for form in none status reminder; do
  start_gateway "$form" "$bin" $REPLICAS
  wait_replicas_up "${GW_ADMIN[$form]}" 2
  $bin bench agent-loop --base-url "${GW_URL[$form]}" --label "$form" --families "$families" --turns "$turns" \
    --context-tokens 8000 --turn-tokens 300 --system-tokens 2000 --rewrite "$form" --json >"$BENCH_TMP/$form.json"
  python3 - "$BENCH_TMP/$form.json" "$form" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = sorted(r["samples"], key=lambda s: (s["family"], s["turn"]))
later = [(p, t) for p, t in zip(s, s[1:]) if p["family"] == t["family"]]
cont = sum(1 for p, t in later if t["route"] == "pinned" and t["replica"] == p["replica"])
same = sum(1 for p, t in later if t["replica"] == p["replica"])
prompt = sum(x.get("prompt_tokens") or 0 for x in s)
cached = sum(x.get("cached_tokens") or 0 for x in s)
wall = (r.get("summary") or {}).get("wall_ms", 0) / 1000
print(f"{sys.argv[2]:9} continuations {cont}/{len(later)} ({100 * cont / len(later):.1f} %), on the previous turn's replica {same}/{len(later)}, cached share {100 * cached / max(prompt, 1):.1f} %, wall {wall:.2f} s")
PY
done
