#!/usr/bin/env bash
# The proxy hop's CPU against nginx, side by side in one run: prefixgate
# (this tree's release build; with BOLT=1 also its optimized build from
# bench/bolt.sh; plus BEFORE=<binary> when given), the
# framework floor (examples/bare_proxy.rs: actix-web + awc forwarding with
# none of prefixgate's logic) and nginx, each in front of the same two
# instant simulated replicas, under wrk -t2 -c32. Rounds are interleaved
# (every target once per round) and the medians compared, because a 2-core
# machine that also runs wrk and the backends is noisy: single runs move by
# +-8 %. CPU per request is the process tree's user+system time from /proc
# divided by the requests wrk completed. Never run in CI.
# Needs: apt-get install -y nginx wrk (and bolt-16 for BOLT=1).
# Usage: ROUNDS=7 SECS=10 [BOLT=1] [BEFORE=path/to/old/prefixgate] bench/hop.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/nginx.sh
ROUNDS=${ROUNDS:-7}; SECS=${SECS:-10}
cargo build --release -q --bin prefixgate --example bare_proxy || exit 1
if [ -n "${BOLT:-}" ]; then bench/bolt.sh >/dev/null || exit 1; fi
bin=$PWD/target/release/prefixgate
bare=$PWD/target/release/examples/bare_proxy
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; nginx -c "$tmp/nginx.conf" -s stop 2>/dev/null; rm -rf "$tmp"' EXIT

$bin sim-replica --port 18401 --time-scale 0 >/dev/null 2>&1 &
$bin sim-replica --port 18402 --time-scale 0 >/dev/null 2>&1 &
declare -A PID PORT; names=()
start() { # name port command...
  local name=$1 port=$2; shift 2
  "$@" >"$tmp/$name.log" 2>&1 &
  PID[$name]=$!; PORT[$name]=$port; names+=("$name")
}
replicas="--replica a=http://127.0.0.1:18401 --replica b=http://127.0.0.1:18402"
start prefixgate 18411 $bin serve --listen 127.0.0.1:18411 --admin-listen 127.0.0.1:18421 $replicas
if [ -n "${BOLT:-}" ]; then
  start prefixgate-bolt 18415 "$PWD/target/bolt/prefixgate" serve --listen 127.0.0.1:18415 --admin-listen 127.0.0.1:18425 $replicas
fi
if [ -n "${BEFORE:-}" ]; then
  start before 18412 "$BEFORE" serve --listen 127.0.0.1:18412 --admin-listen 127.0.0.1:18422 $replicas
fi
start floor 18413 $bare 127.0.0.1:18413 http://127.0.0.1:18401 http://127.0.0.1:18402
nginx_conf "$tmp" 18414
start nginx 18414 nginx -c "$tmp/nginx.conf"

body='{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"overhead probe"}]}'
for n in "${names[@]}"; do
  for _ in $(seq 1 100); do
    curl -sf -m 2 -o /dev/null -H 'content-type: application/json' -d "$body" "http://127.0.0.1:${PORT[$n]}/v1/chat/completions" && break
    sleep 0.2
  done
done
cat > "$tmp/post.lua" <<LUA
wrk.method = "POST"; wrk.body = '$body'; wrk.headers["content-type"] = "application/json"
LUA
for n in "${names[@]}"; do # warm up: connections, pools, caches
  wrk -t1 -c4 -d2s -s "$tmp/post.lua" "http://127.0.0.1:${PORT[$n]}/v1/chat/completions" >/dev/null
done

ticks=$(getconf CLK_TCK)
tree() { local p=$1; echo "$p"; for c in $(pgrep -P "$p" 2>/dev/null); do tree "$c"; done; }
cpu() { # user and system ticks of a process tree
  local u=0 s=0 a b
  for p in $(tree "$1"); do read -r a b < <(awk '{print $14, $15}' "/proc/$p/stat"); u=$((u + a)); s=$((s + b)); done
  echo "$u $s"
}
: > "$tmp/results"
for round in $(seq 1 "$ROUNDS"); do
  for n in "${names[@]}"; do
    read -r u0 s0 < <(cpu "${PID[$n]}")
    out=$(wrk -t2 -c32 -d"${SECS}s" -s "$tmp/post.lua" "http://127.0.0.1:${PORT[$n]}/v1/chat/completions")
    read -r u1 s1 < <(cpu "${PID[$n]}")
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    if echo "$out" | grep -q "Non-2xx"; then echo "round $round $n: errors, skipped" >&2; continue; fi
    awk -v n="$n" -v r="$round" -v q="$reqs" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v t="$ticks" \
      -v rps="$(echo "$out" | awk '/Requests\/sec/ {print $2}')" \
      'BEGIN {printf "%s %s %s %.1f %.1f %.1f\n", n, r, rps, (u + s) / t * 1e6 / q, u / t * 1e6 / q, s / t * 1e6 / q}' >> "$tmp/results"
    tail -1 "$tmp/results" >&2
  done
done

echo "Machine: $(nproc) cores; wrk -t2 -c32 -d${SECS}s; $ROUNDS rounds interleaved; $(date -u +%F)"
echo
echo "| target | req/s (median) | CPU per request (median) | user | system | vs nginx |"
echo "|---|---|---|---|---|---|"
python3 - "$tmp/results" <<'PY'
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
