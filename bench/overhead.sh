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
source bench/lib.sh
bench_init
trap 'kill $(jobs -p) 2>/dev/null; nginx -c "$BENCH_TMP/nginx.conf" -s stop 2>/dev/null; wait 2>/dev/null; rm -rf "$BENCH_TMP"' EXIT
tmp=$BENCH_TMP
log() { echo "$*" >&2; }

start_sim a --time-scale 0
start_sim b --time-scale 0
echo_port=$(free_port)
python3 bench/echo_backend.py "$echo_port" >/dev/null 2>&1 &
W="${SIM_URL[a]} ${SIM_URL[b]}"
E="http://127.0.0.1:$echo_port"

declare -A PID URL
URL[direct]=${SIM_URL[a]}
start() { # name port command...
  local name=$1 port=$2; shift 2
  "$@" >"$tmp/$name.log" 2>&1 &
  PID[$name]=$!; URL[$name]=http://127.0.0.1:$port
}
gateway() { # name args...
  local name=$1; shift
  start_gateway "$name" "$bin" "$@"
  PID[$name]=${GW_PID[$name]}; URL[$name]=${GW_URL[$name]}
}
reps="--replica a=${SIM_URL[a]} --replica b=${SIM_URL[b]}"
gateway prefixgate-shape --policy shape $reps
gateway prefixgate-roundrobin --policy roundrobin $reps
nginx_port=$(free_port); nginx_echo_port=$(free_port)
nginx_conf "$tmp" "$nginx_port" "${SIM_URL[a]#http://} ${SIM_URL[b]#http://}" "
  upstream echo { server 127.0.0.1:$echo_port; keepalive 8; }
  server { listen 127.0.0.1:$nginx_echo_port; location / { proxy_pass http://echo; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
start nginx "$nginx_port" nginx -c "$tmp/nginx.conf"
URL[echo-nginx]=http://127.0.0.1:$nginx_echo_port
for router in smg vllm-router; do
  [ -x "$venv/bin/$router" ] || continue
  for policy in round_robin cache_aware; do
    port=$(free_port)
    if [ $router = smg ]; then cmd=("$venv/bin/smg" launch); else cmd=("$venv/bin/vllm-router"); fi
    start "$router-$policy" "$port" "${cmd[@]}" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
      --policy "$policy" --worker-urls $W
  done
  # The same router in front of the echo backend, for the body check.
  port=$(free_port)
  start "echo-$router" "$port" "${cmd[@]}" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
    --policy round_robin --worker-urls $E
done
start_gateway echo-prefixgate "$bin" --replica "e=$E"
URL[echo-prefixgate]=${GW_URL[echo-prefixgate]}

body=$CHAT_BODY
ready() { curl -sf -m 2 -o /dev/null -H 'content-type: application/json' -d "$body" "$1/v1/chat/completions"; }
for gw in prefixgate-shape prefixgate-roundrobin; do wait_replicas_up "${GW_ADMIN[$gw]}" 2; done
for name in "${!URL[@]}"; do
  case $name in echo-*) continue ;; esac
  for _ in $(seq 1 100); do ready "${URL[$name]}" && break; sleep 0.3; done
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
      -d '{"model":"sim-model","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"first byte"}]}' "$1/v1/chat/completions"
  done | sort -n | awk '{a[NR]=$1} END {printf "%.2f", a[int((NR+1)/2)]*1000}'
}

echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); wrk -t2 -c$CONC -d${SECS}s; $(date -u +%F)"
echo
echo "| target | req/s | p50 | p99 | streamed first byte p50 | CPU per request | RSS |"
echo "|---|---|---|---|---|---|---|"
for name in direct prefixgate-shape prefixgate-roundrobin nginx smg-round_robin smg-cache_aware vllm-router-round_robin vllm-router-cache_aware; do
  url=${URL[$name]:-}; pid=${PID[$name]:-}
  if [ -z "$url" ] || ! ready "$url"; then echo "| $name | did not start | | | | | |"; log "$name did not start: $(tail -n 3 "$tmp/$name.log" 2>/dev/null)"; continue; fi
  c0=$([ -n "$pid" ] && tree_cpu "$pid" || echo 0)
  out=$(wrk -t2 -c"$CONC" -d"${SECS}s" --latency -s "$tmp/post.lua" "$url/v1/chat/completions")
  c1=$([ -n "$pid" ] && tree_cpu "$pid" || echo 0)
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  p50=$(echo "$out" | awk '$1 == "50%" {print $2}'); p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  cpu_us=$([ -n "$pid" ] && awk -v d=$((c1 - c0)) -v t="$ticks" -v n="$reqs" 'BEGIN {printf "%.0f us", d / t * 1e6 / n}' || echo "-")
  rss=$([ -n "$pid" ] && awk -v k="$(tree_rss "$pid")" 'BEGIN {printf "%.0f MiB", k / 1024}' || echo "-")
  echo "| $name | $rps${non2xx:+ ($non2xx non-2xx)} | $p50 | $p99 | $(ttfb "$url") ms | $cpu_us | $rss |"
done

echo
echo "Body forwarding (a request with unusual spacing and max_tokens, compared with what the backend received):"
echo
echo "| router | body forwarded unchanged |"
echo "|---|---|"
probe='{"model":"sim-model",   "max_tokens":7, "messages":[{"role":"user","content":"byte for byte?"}], "temperature":0.0}'
for r in prefixgate nginx smg vllm-router; do
  set -- "$r" "${URL[echo-$r]:-}"
  [ -n "$2" ] || { echo "| $1 | not installed |"; continue; }
  for _ in $(seq 1 50); do curl -sf -m 2 -o /dev/null "$2/v1/models" && break; sleep 0.3; done
  if ! curl -sf -m 10 -o /dev/null -H 'content-type: application/json' -d "$probe" "$2/v1/chat/completions"; then
    echo "| $1 | request failed |"; continue
  fi
  got=$(curl -sf "$E/last" | python3 -c 'import sys, json, base64; print(base64.b64decode(json.load(sys.stdin)["body_b64"]).decode())')
  if [ "$got" = "$probe" ]; then echo "| $1 | yes |"; else echo "| $1 | no: received \`$got\` |"; fi
done
