#!/usr/bin/env bash
# Streams that outlive their replica (issue 42), end to end with real
# processes: two replicas behind one gateway, and for each dialect
# (chat, completions, Responses, Messages; DIALECTS picks some) a
# streamed 400-token answer at temperature 0 whose replica is killed
# with SIGKILL after ~150 tokens reached the client; then a long answer
# (2,400 tokens) whose replica is drained with hand-over
# (`drain?wait=true&handoff=true`). Prints, per arm: whether the client's
# stream was whole (one [DONE], one finish), whether its text equals the
# same request's uninterrupted answer, the seam (tokens before the kill),
# the stream's time against the uninterrupted one's, and for the drain the
# time the drain took to return; then the gateway's stream_continued events.
# Each kill arm also compares the usage the client read (chat and
# completions ask for it with stream_options.include_usage) with the
# uninterrupted answer's.
# Simulated replicas by default (`prefixgate sim-replica`, the seed's card:
# decode 40 tokens/s, time scale 1). REAL=llama: on two real llama-server
# replicas (LLAMA_SERVER=path MODEL=path.gguf, as bench/kv-wall.sh builds
# them; one slot each, one core each), every dialect killed in turn and the
# killed replica restarted. REAL=1: on two real vLLM replicas
# (the drain arm, then one kill arm: the first of DIALECTS, chat unless
# set; a killed vLLM replica is not restarted here)
# (bench/real-vllm.sh installs and starts them, then runs this with
# REPLICA_URLS, REPLICA_PIDS and MODEL_NAME set).
# BIN=path/to/prefixgate runs that build instead of building this tree.
# Never run in CI. Usage: [REAL=1|llama] [DIALECTS="chat messages"] [BIN=...] bench/continue.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${REAL:-}" = 1 ] && [ -z "${REPLICA_URLS:-}" ]; then
  exec env CONTINUE=1 bench/real-vllm.sh
fi
if [ -z "${BIN:-}" ]; then cargo build --release -q; fi
bin=${BIN:-$PWD/target/release/prefixgate}
source bench/lib.sh
bench_init
model=${MODEL_NAME:-sim-model}

# The replicas: given (real vLLM), else two simulated ones.
declare -A URL PID
if [ -n "${REPLICA_URLS:-}" ]; then
  read -r -a urls <<<"$REPLICA_URLS"; read -r -a pids <<<"$REPLICA_PIDS"
  URL[r0]=${urls[0]}; URL[r1]=${urls[1]}; PID[r0]=${pids[0]}; PID[r1]=${pids[1]}
elif [ "${REAL:-}" = llama ]; then
  : "${LLAMA_SERVER:?set LLAMA_SERVER (bench/kv-wall.sh builds it)}" "${MODEL:?set MODEL to the SmolLM2 GGUF}"
  model=smollm2
  # Repeatable answers: with its prompt cache on, llama-server's answer to
  # a prompt it has cached can part from its cold answer within a few
  # tokens (its prefill batches differ), before any seam.
  EXTRA=',"cache_prompt":false'
  declare -A PORT
  start_replica() { # NAME CORE: llama-server as shipped, one slot, on its port (kept across restarts)
    PORT[$1]=${PORT[$1]:-$(free_port)}
    taskset -c "$2" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "${PORT[$1]}" -t 1 -c 16384 -np 1 \
      --jinja -a smollm2 >"$BENCH_TMP/llama-$1.log" 2>&1 &
    PID[$1]=$!; URL[$1]=http://127.0.0.1:${PORT[$1]}
    until curl -sf "${URL[$1]}/health" >/dev/null; do sleep 0.2; done
  }
  start_replica r0 0; start_replica r1 1
  restart() { if [ "$1" = r0 ]; then start_replica r0 0; else start_replica r1 1; fi; }
else
  start_replica() {
    start_sim "$1" --decode-tps 40 --time-scale 1
    URL[$1]=${SIM_URL[$1]}; PID[$1]=${SIM_PID[$1]}
  }
  start_replica r0; start_replica r1
  restart() { start_replica "$1"; }
fi

gateway() {
  start_gateway gw "$bin" --replica "r0=${URL[r0]}" --replica "r1=${URL[r1]}"
  wait_replicas_up "${GW_ADMIN[gw]}" 2
}
gateway

# read_stream URL BODY_JSON KILL_AT: streams BODY to URL; once KILL_AT
# tokens arrived (0: never), kills the replica named by the response's
# x-prefixgate-replica header (its pid from PIDS, r0=PID,r1=PID) with
# SIGKILL. Prints one JSON line: replica, tokens, text, done, finishes, secs.
read_stream() {
  PIDS="r0=${PID[r0]},r1=${PID[r1]}" python3 - "$@" <<'PY'
import json, os, signal, sys, time, urllib.request
url, body, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
pids = dict(p.split("=") for p in os.environ["PIDS"].split(","))
start = time.time()
req = urllib.request.Request(url, data=body.encode(), headers={"content-type": "application/json"})
resp = urllib.request.urlopen(req, timeout=600)
replica = resp.headers.get("x-prefixgate-replica")
text, tokens, done, finishes, killed, buf, seam_chars = [], 0, 0, 0, None, b"", None
usage = {}
for line in resp:
    line = line.strip()
    if not line.startswith(b"data: "):
        continue
    data = line[6:]
    if data == b"[DONE]":
        done += 1
        continue
    e = json.loads(data)
    kind = e.get("type")
    if "error" in e or kind == "error":
        text.append("<error>")
        continue
    # chat and completions; Responses and Messages (their end is their [DONE])
    pieces = [(c.get("delta") or {}).get("content") or c.get("text") or "" for c in e.get("choices", [])]
    if kind == "response.output_text.delta":
        pieces.append(e["delta"])
    if kind == "content_block_delta":
        pieces.append(e["delta"].get("text", ""))
    for piece in pieces:
        if piece:
            tokens += 1
            text.append(piece)
    # The usage the client reads: chat's and completions' chunk, the
    # completed response's, the message's (input in message_start).
    u = e.get("usage") or (e.get("response") or {}).get("usage") or (e.get("message") or {}).get("usage")
    if u and u.get("cache_read_input_tokens"):
        # Messages counts cached input apart: the prompt is both.
        u = dict(u, input_tokens=u.get("input_tokens", 0) + u["cache_read_input_tokens"])
    if u and kind != "response.created":
        for key, out in (("prompt_tokens", "in"), ("input_tokens", "in"), ("completion_tokens", "out"),
                         ("output_tokens", "out")):
            if u.get(key) is not None and (key not in ("input_tokens",) or kind != "message_delta"):
                usage[out] = u[key]
    finishes += sum(1 for c in e.get("choices", []) if c.get("finish_reason"))
    finishes += kind in ("response.completed", "message_delta")
    done += kind in ("response.completed", "message_stop")
    if kill_at and killed is None and tokens >= kill_at:
        os.kill(int(pids[replica]), signal.SIGKILL)
        killed, seam_chars = tokens, len("".join(text))
print(json.dumps({"replica": replica, "tokens": tokens, "text": "".join(text), "done": done, "usage": usage,
                  "finishes": finishes, "seam": killed, "seam_chars": seam_chars, "secs": round(time.time() - start, 2)}))
PY
}

chat_body() { # stream? max_tokens
  printf '{"model":"%s","messages":[{"role":"user","content":"Tell me about caches, at length (%s)."}],"stream":%s,"max_tokens":%s,"temperature":0,"stream_options":{"include_usage":true}%s}' \
    "$model" "$RANDOM" "$1" "$2" "${EXTRA:-}"
}
completion_body() {
  printf '{"model":"%s","prompt":"Once upon a time, in a cache (%s),","stream":%s,"max_tokens":%s,"temperature":0,"stream_options":{"include_usage":true}%s}' \
    "$model" "$RANDOM" "$1" "$2" "${EXTRA:-}"
}

responses_body() {
  printf '{"model":"%s","input":"Tell me about caches, at length (%s).","stream":%s,"max_output_tokens":%s,"temperature":0,"store":false%s}' \
    "$model" "$RANDOM" "$1" "$2" "${EXTRA:-}"
}
messages_body() {
  printf '{"model":"%s","messages":[{"role":"user","content":"Tell me about caches, at length (%s)."}],"stream":%s,"max_tokens":%s,"temperature":0%s}' \
    "$model" "$RANDOM" "$1" "$2" "${EXTRA:-}"
}

report() { # arm uninterrupted.json broken.json
  python3 - "$@" <<'PY'
import json, sys
arm, whole, got = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
same = whole["text"] == got["text"]
usage = "equals" if whole["usage"] == got["usage"] else "DIFFERS from"
if not same:
    at = next((i for i, (a, b) in enumerate(zip(whole["text"], got["text"])) if a != b), min(len(whole["text"]), len(got["text"])))
    where = "before" if got["seam_chars"] and at < got["seam_chars"] else "after"
    print(f"  the texts part at character {at}, {where} the seam (character {got['seam_chars']}): "
          f"{whole['text'][max(0, at - 40):at + 40]!r} against {got['text'][max(0, at - 40):at + 40]!r}")
print(f"{arm}: replica {got['replica']}, killed at {got['seam']} tokens; {got['tokens']} tokens; "
      f"[DONE] x{got['done']}, finish x{got['finishes']}; text {'equals' if same else 'DIFFERS from'} the uninterrupted answer; "
      f"usage {got['usage']} {usage} the uninterrupted {whole['usage']}; "
      f"{got['secs']} s against {whole['secs']} s uninterrupted")
PY
}

events() {
  curl -s "${GW_ADMIN[gw]}/admin/v1/events?kind=stream_continued" | python3 -c '
import json, sys
for e in json.load(sys.stdin)["items"]:
    print("  stream_continued:", e.get("replica"), "->", e.get("to_replica"), ":", e["detail"])'
}

# Drain with hand-over: a 2,400-token answer (a minute at 40 tokens/s).
body=$(chat_body true 2400)
read_stream "${GW_URL[gw]}/v1/chat/completions" "$body" 0 >"$BENCH_TMP/long.json" &
reader=$!
sleep 3
home=$(curl -s "${GW_ADMIN[gw]}/admin/v1/replicas" | python3 -c 'import json,sys; print(next(r["id"] for r in json.load(sys.stdin) if r["inflight"] > 0))')
start=$(date +%s.%N)
curl -s -o /dev/null -X POST "${GW_ADMIN[gw]}/admin/v1/replicas/$home/drain?wait=true&handoff=true&timeout=120"
echo "drain?wait=true&handoff=true of $home returned in $(echo "$(date +%s.%N) - $start" | bc) s"
wait "$reader"
python3 - "$BENCH_TMP/long.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
print(f"the long stream: {g['tokens']} tokens, [DONE] x{g['done']}, finish x{g['finishes']}, {g['secs']} s")
PY
events
curl -s -o /dev/null -X POST "${GW_ADMIN[gw]}/admin/v1/replicas/$home/resume"

# Real vLLM: one kill (a killed replica is not restarted here).
dialects=${DIALECTS:-chat completions responses messages}
[ -n "${REPLICA_URLS:-}" ] && dialects=${DIALECTS:-chat}
for dialect in $dialects; do
  case $dialect in
    chat) path=/v1/chat/completions; make=chat_body ;;
    completions) path=/v1/completions; make=completion_body ;;
    responses) path=/v1/responses; make=responses_body ;;
    messages) path=/v1/messages; make=messages_body ;;
  esac
  body=$($make true 400)
  # The uninterrupted answer, asked twice (once on each replica: one-shots
  # spread): llama.cpp's answer to a prompt it has cached can part from
  # its first, cold one within a few tokens (its prefill batches differ),
  # so the reference is taken where the prompt is cached, as the kill's is.
  read_stream "${GW_URL[gw]}$path" "$body" 0 >/dev/null
  whole=$(read_stream "${GW_URL[gw]}$path" "$body" 0)
  got=$(read_stream "${GW_URL[gw]}$path" "$body" 150)
  report "kill -9 mid-stream, $dialect" "$whole" "$got"
  events
  victim=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["replica"])' "$got")
  # The killed replica comes back (simulated), and the gateway sees it up.
  [ -n "${REPLICA_URLS:-}" ] && break
  restart "$victim"
  kill "${GW_PID[gw]}" 2>/dev/null; wait "${GW_PID[gw]}" 2>/dev/null || true
  gateway
done
