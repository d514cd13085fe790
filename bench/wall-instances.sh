#!/usr/bin/env bash
# At the KV wall through one and three gateway instances sharing one Redis
# (issue 31: "three instances release room later than one"). Two simulated
# vLLM-like replicas of SIM_KV (12,000) KV tokens, FAMILIES (4) agent loops
# of a 500-token shared system prompt, a CONTEXT (8,000)-token context and
# TURN (200) tokens a turn, 6 turns, no pause between turns;
# sessions.idle_ms=1000 and sessions.hold_min_tokens=512, the hold on
# (CONTEXT=1500 TURN=1500: bench/sim-wall.sh's growing families). With three instances the
# client sends each turn to the next instance, so no two consecutive turns
# of a family reach the same one. Each arm on fresh gateways and a fresh
# Redis, ROUNDS (3) rounds interleaved; prints each arm's wall times and
# the median ratio three/one (the issue's target: within 1.15x).
# RESTART=1 (issue 40, phantom rooms): instead, the restart sequence. Three
# instances on one Redis run the growing families (CONTEXT=1500 TURN=1500)
# to their end and are stopped with SIGTERM; three new instances on the
# same Redis start at once (a rolling restart's step) and run the
# 8,000-token families (+200 a turn). The same with the new instances
# started GAP (6) seconds after the stop, each way ROUNDS times,
# interleaved: prints both walls and the ratio now/later.
# SETS (1): sets of new families, one after the other on the same
# gateways (each once the one before idled out); the ratio is the last
# set's, which meets whatever walls the gateways learned from the sets before.
# FIRST_ON_ONE=1: the sets before the last go through the first instance
# alone (what the others know of the walls is what it shares).
# SIM_ARGS: more sim-replica flags, for both replicas: `--slots 1` makes
# them llama-server-like (one slot of SIM_KV tokens, nothing kept beyond
# it), where the wall is learned from receipts (sessions.wall = "auto").
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Needs redis-server.
# Usage: [ROUNDS=3 FAMILIES=4 SIM_KV=12000 TIME_SCALE=0.25 CONTEXT=8000 TURN=200 SETS=1 FIRST_ON_ONE= SIM_ARGS=] bench/wall-instances.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}; FAMILIES=${FAMILIES:-4}; SIM_KV=${SIM_KV:-12000}; TIME_SCALE=${TIME_SCALE:-0.25}
CONTEXT=${CONTEXT:-8000}; TURN=${TURN:-200}; SETS=${SETS:-1}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
tmp=$BENCH_TMP
# shellcheck disable=SC2086 # SIM_ARGS is a list of flags
start_sim a --kv-tokens "$SIM_KV" --time-scale "$TIME_SCALE" ${SIM_ARGS:-}
# shellcheck disable=SC2086
start_sim b --kv-tokens "$SIM_KV" --time-scale "$TIME_SCALE" ${SIM_ARGS:-}

# arm N ROUND: N instances on a fresh Redis; prints the wall time in seconds.
arm() {
  local n=$1 round=$2 sock="$tmp/r$1-$2.sock" urls=() admins=() start
  start_redis "$sock"
  for i in $(seq 1 "$n"); do
    PREFIXGATE_STORE_INSTANCE="gw$i" start_gateway "r$round-n$n-gw$i" "$bin" --store "redis+unix://$sock" \
      --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}" --set sessions.idle_ms=1000 --set sessions.hold_min_tokens=512
    urls+=("${GW_URL[r$round-n$n-gw$i]}"); admins+=("${GW_ADMIN[r$round-n$n-gw$i]}")
  done
  for admin in "${admins[@]}"; do
    wait_replicas_up "$admin" 2
    for _ in $(seq 50); do
      curl -s "$admin/admin/v1/capacity" | grep -q '"kv_tokens":[0-9]' && break; sleep 0.2
    done
  done
  local set wall
  for set in $(seq 1 "$SETS"); do
    [ "$set" = 1 ] || sleep 3 # the set before idles out
    local through=("${urls[@]}")
    # FIRST_ON_ONE: the sets before the last through the first instance alone.
    if [ -n "${FIRST_ON_ONE:-}" ] && [ "$set" -lt "$SETS" ]; then through=("${urls[0]}"); fi
    start=$(date +%s.%N)
    $bin bench agent-loop --base-url "$(IFS=,; echo "${through[*]}")" --families "$FAMILIES" --turns 6 --label "set$set" \
      --system-tokens 500 --context-tokens "$CONTEXT" --turn-tokens "$TURN" --max-tokens 16 --json >"$tmp/r$round-n$n.json"
    wall=$(echo "$(date +%s.%N) - $start" | bc)
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["summary"]; print("  set", sys.argv[2], "wall", sys.argv[3], "s, errors", r["errors"], file=sys.stderr)' \
      "$tmp/r$round-n$n.json" "$set" "$wall"
  done
  echo "$wall"
  local paused=0 held=0
  for admin in "${admins[@]}"; do
    paused=$((paused + $(curl -s "$admin/metrics" | awk '/^prefixgate_session_turns_paused_total/ {n += $2} END {print int(n)}')))
    held=$((held + $(curl -s "$admin/admin/v1/capacity" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sessions"]["waited"])')))
  done
  echo "  $n instance(s): $held sessions held, $paused turns paused" >&2
  cp "$tmp/r$round-n$n.json" "${KEEP:-/dev/null}" 2>/dev/null || true
  for i in $(seq 1 "$n"); do kill "${GW_PID[r$round-n$n-gw$i]}"; done
  kill "$REDIS_PID"
}

# restarted ROUND GAP: the restart sequence; prints the second set's wall in seconds.
restarted() {
  local round=$1 gap=$2 sock="$tmp/restart-$1-$2.sock" urls=() admins=() i start set
  start_redis "$sock"
  for set in first second; do
    urls=(); admins=()
    for i in 1 2 3; do
      PREFIXGATE_STORE_INSTANCE="$set$i" start_gateway "rs$round-$gap-$set$i" "$bin" --store "redis+unix://$sock" \
        --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}" --set sessions.idle_ms=1000 --set sessions.hold_min_tokens=512
      urls+=("${GW_URL[rs$round-$gap-$set$i]}"); admins+=("${GW_ADMIN[rs$round-$gap-$set$i]}")
    done
    for admin in "${admins[@]}"; do wait_replicas_up "$admin" 2; done
    if [ "$set" = first ]; then
      $bin bench agent-loop --base-url "$(IFS=,; echo "${urls[*]}")" --families "$FAMILIES" --turns 6 \
        --system-tokens 500 --context-tokens 1500 --turn-tokens 1500 --max-tokens 16 --json >/dev/null
      for i in 1 2 3; do kill -TERM "${GW_PID[rs$round-$gap-first$i]}"; done
      for i in 1 2 3; do wait "${GW_PID[rs$round-$gap-first$i]}" 2>/dev/null || true; done
      sleep "$gap"
    else
      start=$(date +%s.%N)
      $bin bench agent-loop --base-url "$(IFS=,; echo "${urls[*]}")" --families "$FAMILIES" --turns 6 \
        --system-tokens 500 --context-tokens 8000 --turn-tokens 200 --max-tokens 16 --json >"$tmp/rs$round-$gap.json"
      echo "$(date +%s.%N) - $start" | bc
      for i in 1 2 3; do kill "${GW_PID[rs$round-$gap-second$i]}"; done
    fi
  done
  kill "$REDIS_PID"
}

if [ -n "${RESTART:-}" ]; then
  GAP=${GAP:-6}; now=(); later=()
  for round in $(seq 1 "$ROUNDS"); do
    now+=("$(restarted "$round" 0)"); later+=("$(restarted "$round" "$GAP")")
    echo "round $round: new instances at once ${now[-1]} s, $GAP s later ${later[-1]} s"
  done
  python3 - "${now[*]}" "${later[*]}" <<'PY'
import statistics, sys
now, later = [list(map(float, a.split())) for a in sys.argv[1:3]]
print(f"median wall of the 8,000-token set: new instances at once {statistics.median(now):.2f} s, "
      f"later {statistics.median(later):.2f} s: {statistics.median(now) / statistics.median(later):.2f}x")
PY
  exit 0
fi

one=(); three=()
for round in $(seq 1 "$ROUNDS"); do
  one+=("$(arm 1 "$round")"); three+=("$(arm 3 "$round")")
  echo "round $round: one instance ${one[-1]} s, three ${three[-1]} s"
done
python3 - "${one[*]}" "${three[*]}" <<'PY'
import statistics, sys
one, three = [list(map(float, a.split())) for a in sys.argv[1:3]]
print(f"median wall: one {statistics.median(one):.2f} s, three {statistics.median(three):.2f} s: "
      f"{statistics.median(three) / statistics.median(one):.2f}x")
PY
