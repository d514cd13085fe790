#!/usr/bin/env bash
# Regenerates docs/benchmarks.md's seed tables on simulated replicas
# configured like the seed's cards (122,636 KV tokens, ~4,100 prefill tok/s:
# a cold 90k prefill takes ~22 s of simulated time). Time is scaled by
# SCALE (default 0.05); "simulated" columns are the replicas' own prefill
# accounting, immune to machine noise; TTFT columns are wall clock / SCALE.
# Usage: bench/reproduce.sh   (rewrites the seed section of docs/benchmarks.md; raw reports in target/bench/)
set -euo pipefail
cd "$(dirname "$0")/.."
SCALE=${SCALE:-0.05}
cargo build --release -q
bin=$PWD/target/release/prefixgate
out=target/bench; mkdir -p "$out"
source bench/lib.sh
bench_init
start_sim a --kv-tokens 122636 --time-scale "$SCALE"
start_sim b --kv-tokens 122636 --time-scale "$SCALE"
start_gateway repro "$bin" --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}"
# Both replicas must be up before measuring.
wait_replicas_up "${GW_ADMIN[repro]}" 2
admin=${GW_ADMIN[repro]}/admin/v1
policy() { curl -sf -XPUT "$admin/policy" -H 'content-type: application/json' \
  -d "{\"mode\":\"$1\",\"identity\":{\"block_bytes\":1024,\"block_tokens\":256}}" >/dev/null; }
limit() { for r in a b; do curl -sf -XPATCH "$admin/replicas/$r" -H 'content-type: application/json' -d "$1" >/dev/null; done; }
run() { echo "+ prefixgate bench $*" >&2; $bin bench "$@" --base-url "${GW_URL[repro]}" --json; }

for mode in roundrobin affinity shape; do
  policy "$mode"
  run agent-loop --label "$mode" --families 1 --turns 21 --context-tokens 90000 --turn-tokens 3000 > "$out/agent-$mode.json"
  run burst --label "$mode" --requests 16 --prompt-tokens 8000 --shared-prefix-tokens 500 > "$out/burst-$mode.json"
done
$bin bench chart --out docs/agent-loop-ttft.svg "$out"/agent-*.json

for mode in roundrobin shape; do
  policy "$mode"
  for adm in off on; do
    if [ "$adm" = on ]; then limit '{"max_large_inflight":1}'; else limit '{"clear_max_large_inflight":true}'; fi
    run agent-loop --label "wall-$mode-admission-$adm" --families 3 --turns 6 --context-tokens 70000 --turn-tokens 300 > "$out/wall-$mode-$adm.json"
    curl -sf "$admin/capacity" > "$out/capacity-$mode-$adm.json"
  done
done
limit '{"clear_max_large_inflight":true}'

python3 bench/seed_tables.py "$out" "$SCALE" > "$out/seed.md"
python3 - "$out/seed.md" docs/benchmarks.md <<'PY'
import sys
seed, doc = open(sys.argv[1]).read(), open(sys.argv[2]).read()
head, rest = doc.split("<!-- seed:start -->")
_, tail = rest.split("<!-- seed:end -->")
open(sys.argv[2], "w").write(head + "<!-- seed:start -->\n" + seed + "<!-- seed:end -->" + tail)
PY
echo "rewrote the seed section of docs/benchmarks.md and docs/agent-loop-ttft.svg" >&2
