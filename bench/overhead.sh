#!/usr/bin/env bash
# Overhead and throughput against the alternatives, side by side in one run,
# against the same fast backend (two instant simulated replicas):
# direct, prefixgate (shape, roundrobin), nginx proxy_pass round robin, and
# the Rust routers users would pick instead, smg and vllm-router (round robin
# and cache aware), installed into a throwaway venv. Never run in CI.
# Measures requests/s at fixed concurrency with p50/p99 (wrk), the first-byte
# latency of a streamed response, the router's CPU per request and memory,
# and whether each router forwards the client's body byte for byte.
# Needs: apt-get install -y nginx wrk; pip (for the venv).
# Usage: SECS=10 CONC=32 bench/overhead.sh > target/bench/overhead.md
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/nginx.sh
SECS=${SECS:-10}; CONC=${CONC:-32}
cargo build --release -q || exit 1
bin=$PWD/target/release/prefixgate
venv=${VENV:-$PWD/target/routers-venv}
if [ ! -x "$venv/bin/smg" ] || [ ! -x "$venv/bin/vllm-router" ]; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q smg vllm-router >&2 || echo "router install failed" >&2
fi
tmp=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; nginx -c "$tmp/nginx.conf" -s stop 2>/dev/null; rm -rf "$tmp"' EXIT
log() { echo "$*" >&2; }

$bin sim-replica --port 18401 --time-scale 0 >/dev/null 2>&1 &
$bin sim-replica --port 18402 --time-scale 0 >/dev/null 2>&1 &
python3 bench/echo_backend.py 18431 >/dev/null 2>&1 &
W="http://127.0.0.1:18401 http://127.0.0.1:18402"
E="http://127.0.0.1:18431"

declare -A PID PORT
start() { # name port command...
  local name=$1 port=$2; shift 2
  "$@" >"$tmp/$name.log" 2>&1 &
  PID[$name]=$!; PORT[$name]=$port
}
start prefixgate-shape 18411 $bin serve --listen 127.0.0.1:18411 --admin-listen 127.0.0.1:18421 --policy shape --replica a=http://127.0.0.1:18401 --replica b=http://127.0.0.1:18402
start prefixgate-roundrobin 18412 $bin serve --listen 127.0.0.1:18412 --admin-listen 127.0.0.1:18422 --policy roundrobin --replica a=http://127.0.0.1:18401 --replica b=http://127.0.0.1:18402
nginx_conf "$tmp" 18413 '
  upstream echo { server 127.0.0.1:18431; keepalive 8; }
  server { listen 127.0.0.1:18443; location / { proxy_pass http://echo; proxy_http_version 1.1; proxy_set_header Connection ""; } }'
start nginx 18413 nginx -c "$tmp/nginx.conf"
if [ -x "$venv/bin/smg" ]; then
  start smg-round_robin 18414 "$venv/bin/smg" launch --host 127.0.0.1 --port 18414 --prometheus-port 18614 --policy round_robin --worker-urls $W
  start smg-cache_aware 18415 "$venv/bin/smg" launch --host 127.0.0.1 --port 18415 --prometheus-port 18615 --policy cache_aware --worker-urls $W
fi
if [ -x "$venv/bin/vllm-router" ]; then
  start vllm-router-round_robin 18416 "$venv/bin/vllm-router" --host 127.0.0.1 --port 18416 --prometheus-port 18616 --policy round_robin --worker-urls $W
  start vllm-router-cache_aware 18417 "$venv/bin/vllm-router" --host 127.0.0.1 --port 18417 --prometheus-port 18617 --policy cache_aware --worker-urls $W
fi
# The same routers in front of the echo backend, for the body check.
start echo-prefixgate 18441 $bin serve --listen 127.0.0.1:18441 --admin-listen 127.0.0.1:18451 --replica e=$E
[ -x "$venv/bin/smg" ] && start echo-smg 18444 "$venv/bin/smg" launch --host 127.0.0.1 --port 18444 --prometheus-port 18644 --policy round_robin --worker-urls $E
[ -x "$venv/bin/vllm-router" ] && start echo-vllm-router 18446 "$venv/bin/vllm-router" --host 127.0.0.1 --port 18446 --prometheus-port 18646 --policy round_robin --worker-urls $E

body='{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"overhead probe"}]}'
ready() { curl -sf -m 2 -o /dev/null -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$1/v1/chat/completions"; }
for p in 18401 18411 18412 18413 18414 18415 18416 18417; do
  for _ in $(seq 1 100); do ready $p && break; sleep 0.3; done
done

cat > "$tmp/post.lua" <<LUA
wrk.method = "POST"; wrk.body = '$body'; wrk.headers["content-type"] = "application/json"
LUA
ticks=$(getconf CLK_TCK)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# nginx: master + workers; smg/vllm-router: python wrapper + children. Sum the process tree.
tree() { local p=$1; echo "$p"; for c in $(pgrep -P "$p" 2>/dev/null); do tree "$c"; done; }
tree_cpu() { local s=0; for p in $(tree "$1"); do s=$((s + $(cpu "$p"))); done; echo $s; }
tree_rss() { local s=0; for p in $(tree "$1"); do s=$((s + $(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0))); done; echo $s; }
ttfb() { # median first-byte time of a streamed response, ms
  for _ in $(seq 1 50); do
    curl -s -o /dev/null -w '%{time_starttransfer}\n' -H 'content-type: application/json' \
      -d '{"model":"sim-model","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"first byte"}]}' "http://127.0.0.1:$1/v1/chat/completions"
  done | sort -n | awk '{a[NR]=$1} END {printf "%.2f", a[int((NR+1)/2)]*1000}'
}

echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); wrk -t2 -c$CONC -d${SECS}s; $(date -u +%F)"
echo
echo "| target | req/s | p50 | p99 | streamed first byte p50 | CPU per request | RSS |"
echo "|---|---|---|---|---|---|---|"
for name in direct prefixgate-shape prefixgate-roundrobin nginx smg-round_robin smg-cache_aware vllm-router-round_robin vllm-router-cache_aware; do
  if [ "$name" = direct ]; then port=18401; pid=""; else port=${PORT[$name]:-}; pid=${PID[$name]:-}; fi
  if [ -z "$port" ] || ! ready "$port"; then echo "| $name | did not start | | | | | |"; log "$name did not start: $(tail -n 3 "$tmp/$name.log" 2>/dev/null)"; continue; fi
  c0=$([ -n "$pid" ] && tree_cpu "$pid" || echo 0)
  out=$(wrk -t2 -c"$CONC" -d"${SECS}s" --latency -s "$tmp/post.lua" "http://127.0.0.1:$port/v1/chat/completions")
  c1=$([ -n "$pid" ] && tree_cpu "$pid" || echo 0)
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  p50=$(echo "$out" | awk '$1 == "50%" {print $2}'); p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  cpu_us=$([ -n "$pid" ] && awk -v d=$((c1 - c0)) -v t="$ticks" -v n="$reqs" 'BEGIN {printf "%.0f us", d / t * 1e6 / n}' || echo "-")
  rss=$([ -n "$pid" ] && awk -v k="$(tree_rss "$pid")" 'BEGIN {printf "%.0f MiB", k / 1024}' || echo "-")
  echo "| $name | $rps${non2xx:+ ($non2xx non-2xx)} | $p50 | $p99 | $(ttfb "$port") ms | $cpu_us | $rss |"
done

echo
echo "Body forwarding (a request with unusual spacing and max_tokens, compared with what the backend received):"
echo
echo "| router | body forwarded unchanged |"
echo "|---|---|"
probe='{"model":"sim-model",   "max_tokens":7, "messages":[{"role":"user","content":"byte for byte?"}], "temperature":0.0}'
for r in "prefixgate 18441" "nginx 18443" "smg 18444" "vllm-router 18446"; do
  set -- $r
  for _ in $(seq 1 50); do curl -sf -m 2 -o /dev/null http://127.0.0.1:$2/v1/models && break; sleep 0.3; done
  if ! curl -sf -m 10 -o /dev/null -H 'content-type: application/json' -d "$probe" "http://127.0.0.1:$2/v1/chat/completions"; then
    echo "| $1 | request failed |"; continue
  fi
  got=$(curl -sf http://127.0.0.1:18431/last | python3 -c 'import sys, json, base64; print(base64.b64decode(json.load(sys.stdin)["body_b64"]).decode())')
  if [ "$got" = "$probe" ]; then echo "| $1 | yes |"; else echo "| $1 | no: received \`$got\` |"; fi
done
