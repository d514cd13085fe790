#!/usr/bin/env bash
# /v1 latency with a healthy shared store and with one that answers after
# DELAY_MS (a Redis across a congested link), in one run, same gateway.
# A delaying TCP front (Python, asyncio) sits between the gateway and
# redis-server; while its flag file exists it holds every answer DELAY_MS.
# The client sends REQUESTS sequential requests per phase over 4 keep-alive
# connections: half new sessions (a unique system prompt: placed with the
# hold on, which reads the fleet's loads and admits in the store when the
# store answers), half continuations of one conversation. It prints p50 and
# p99 per phase and their ratio, then times one admin action (a drain) in
# each phase: the action waits on the store, requests do not.
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Needs: redis-server, redis-cli, python3, curl.
# Usage: REQUESTS=2000 DELAY_MS=2000 bench/slow-store.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-2000}; DELAY_MS=${DELAY_MS:-2000}
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
tmp=$BENCH_TMP
# Large pools and a short idle-out: the hold places every new session (and
# asks the store) but never makes one wait, so the store is all that differs.
start_sim a --time-scale 0 --kv-tokens 10000000
start_sim b --time-scale 0 --kv-tokens 10000000

start_redis "$tmp/redis.sock"
link_port=$(free_port)
python3 - "$link_port" "$tmp/redis.sock" "$tmp/slow" "$DELAY_MS" <<'PY' &
import asyncio, os, sys
port, sock, flag, delay = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]) / 1000
async def pipe(r, w, slow):
    try:
        while data := await r.read(65536):
            if slow and os.path.exists(flag):
                await asyncio.sleep(delay)
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def serve(cr, cw):
    sr, sw = await asyncio.open_unix_connection(sock)
    await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True), return_exceptions=True)
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()
asyncio.run(main())
PY
until (exec 3<>"/dev/tcp/127.0.0.1/$link_port") 2>/dev/null; do sleep 0.1; done

PREFIXGATE_STORE_INSTANCE=gw0 PREFIXGATE_PINS_FLUSH_INTERVAL_MS=200 \
  start_gateway gw "$bin" --store "redis://127.0.0.1:$link_port" \
  --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}" \
  --set sessions.max_wait_ms=10000 --set sessions.hold_min_tokens=1 --set sessions.idle_ms=500
wait_replicas_up "${GW_ADMIN[gw]}" 2

# phase NAME: REQUESTS requests; prints the phase's p50 and p99 in ms.
phase() {
  python3 - "${GW_URL[gw]#http://}" "$REQUESTS" "$1" <<'PY'
import http.client, json, random, statistics, sys, time
host, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
h, p = host.split(":")
conns = [http.client.HTTPConnection(h, int(p), timeout=60) for _ in range(4)]
salt = f"{name}-{random.random()}"
system = f"[{salt}] " + "a fixed system prompt sentence. " * 300
took = []
for i in range(n):
    if i % 2 == 0:
        msgs = [{"role": "system", "content": f"[{salt} session {i}] " + "its own prompt. " * 300},
                {"role": "user", "content": "hi"}]
    else:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "go"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"turn {i}"}]
    body = json.dumps({"model": "sim-model", "max_tokens": 4, "messages": msgs})
    c = conns[i % 4]
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse(); r.read()
    took.append((time.perf_counter() - t0) * 1000)
    assert r.status == 200, r.status
took.sort()
p50, p99 = statistics.median(took), took[int(len(took) * 0.99) - 1]
print(f"{name}: {n} requests, p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {took[-1]:.2f} ms")
print(f"P99 {p99}")
PY
}

# drain_time: seconds one admin drain (then resume) of replica b took, and its status.
drain_time() {
  curl -s -o /dev/null -w "drain: %{http_code} in %{time_total} s\n" -X POST "${GW_ADMIN[gw]}/admin/v1/replicas/b/drain"
  curl -s -o /dev/null -X POST "${GW_ADMIN[gw]}/admin/v1/replicas/b/resume" || true
}

echo "=== healthy store"
healthy=$(phase healthy)
echo "$healthy" | grep -v '^P99'
drain_time
touch "$tmp/slow"
# The flusher notices within a flush interval plus one store timeout.
for _ in $(seq 1 100); do
  curl -s "${GW_URL[gw]}/healthz" | grep -q unreachable && break
  sleep 0.1
done
echo "=== store answering after ${DELAY_MS} ms"
slow=$(phase slow)
echo "$slow" | grep -v '^P99'
drain_time
rm -f "$tmp/slow"
python3 -c "import sys; h, s = float(sys.argv[1]), float(sys.argv[2]); print(f'p99 slow/healthy: {s / h:.2f}x')" \
  "$(echo "$healthy" | awk '/^P99/ {print $2}')" "$(echo "$slow" | awk '/^P99/ {print $2}')"
