#!/usr/bin/env bash
# No wall, no waiting (issue 49): slot engines that keep prompts in host
# memory (llama-server's default `--cache-ram`), simulated: two replicas of
# one 65,536-token slot each with a 2,000,000-token host tier
# (`sim-replica --slots 1 --host-cache-tokens 2000000`), FAMILIES (8)
# growing agent sessions starting together. Arms, each on a fresh gateway,
# in one run: the defaults (the wall as learned), the hold off
# (sessions.max_wait_ms=0), and the declared capacity as the wall
# (sessions.wall=declared: one session per slot, the behaviour before).
# Prints each arm's wall time, held sessions and cached share.
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Usage: [ROUNDS=1 FAMILIES=8 TURNS=8 TIME_SCALE=0.25] bench/host-tier.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILIES=${FAMILIES:-8}; TURNS=${TURNS:-8}; TIME_SCALE=${TIME_SCALE:-0.25}; ROUNDS=${ROUNDS:-1}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
start_sim_pair --slots 1 --kv-tokens 65536 --host-cache-tokens 2000000 --time-scale "$TIME_SCALE"
n=0
arm() {
  local name=$1; shift
  n=$((n + 1))
  local gw="$name-$n"
  start_gateway "$gw" "$bin" $REPLICAS --set sessions.idle_ms=1000 "$@"
  wait_replicas_up "${GW_ADMIN[$gw]}" 2
  $bin bench agent-loop --base-url "${GW_URL[$gw]}" --label "$name" --families "$FAMILIES" --turns "$TURNS" \
    --shared-tokens 2000 --context-tokens 4000 --turn-tokens 1500 --max-tokens 16 --json >"$BENCH_TMP/$gw.json"
  [ -n "${DEBUG:-}" ] && curl -s "${GW_ADMIN[$gw]}/admin/v1/capacity" | python3 -c 'import json, sys; r = json.load(sys.stdin); print([(x["replica"], x.get("learned_tokens"), x["evidence"]) for x in r["replicas"]])' && curl -s "${GW_ADMIN[$gw]}/metrics" | grep -E "paused_total|session_moves_total|prefixgate_requests_total" | grep -v " 0$"
  local held
  held=$(curl -s "${GW_ADMIN[$gw]}/admin/v1/capacity" | python3 -c 'import json, sys; print(json.load(sys.stdin)["sessions"]["waited"])')
  python3 - "$BENCH_TMP/$gw.json" "$name" "$held" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["samples"]
prompt = sum(x.get("prompt_tokens") or 0 for x in s)
cached = sum(x.get("cached_tokens") or 0 for x in s)
print(f"{sys.argv[2]:9} wall {r['summary']['wall_ms'] / 1000:6.2f} s  held {sys.argv[3]}  cached {100 * cached / max(prompt, 1):.1f} %  errors {r['summary']['errors']}")
PY
}
for _ in $(seq "$ROUNDS"); do
  arm defaults
  arm off --set sessions.max_wait_ms=0
  arm declared --set sessions.wall=declared
done
