# Sourced by the scripts that put prefixgate beside vllm-router in front of
# the same two replicas (bench/inference-perf.sh, bench/replay.sh), after
# bench/lib.sh and bench_init.
#
#   install_vllm_router     vllm-router from PyPI into $routers_venv (VENV, default target/routers-venv), once
#   check_engine            ENGINE (sim | llama) or REPLICA_URLS checked; sets model (the name to ask for)
#   replicas_up             URLS: two replicas, started afresh, or REPLICA_URLS with their prefix caches emptied
#   router_up ARM           ROUTER_URL, ROUTER_PID: the arm's router in front of URLS
#
# Replicas (ENGINE): sim (two simulated pool engines, 2 x 122,636 KV tokens,
# --time-scale 0.25), llama (two llama-server as shipped: 1 slot,
# --cache-ram CACHE_RAM (8192 MiB), one core each; LLAMA_SERVER and MODEL as
# bench/kv-wall.sh takes them), or REPLICA_URLS="u1 u2" with MODEL_NAME
# (real vLLM, bench/real-vllm.sh: emptied through POST /reset_prefix_cache,
# served with VLLM_SERVER_DEV_MODE=1).
# Arms: prefixgate (defaults), prefixgate-nohold (sessions.max_wait_ms=0),
# prefixgate-counter (routing.spread=counter), vllm-router (--policy cache_aware),
# prefixgate-base (BASE_BIN's defaults: another build, side by side in one run).

ENGINE=${ENGINE:-sim}; REPLICA_URLS=${REPLICA_URLS:-}
routers_venv=${VENV:-$PWD/target/routers-venv}

install_vllm_router() {
  if [ ! -x "$routers_venv/bin/vllm-router" ]; then
    echo "--- installing vllm-router under $routers_venv (once)"
    python3 -m venv "$routers_venv" && "$routers_venv/bin/pip" install -q vllm-router
  fi
}

check_engine() {
  model=${MODEL_NAME:-smollm2}
  [ "$ENGINE" = sim ] && [ -z "$REPLICA_URLS" ] && model=sim-model
  if [ "$ENGINE" = llama ] && [ -z "$REPLICA_URLS" ] && { [ ! -x "${LLAMA_SERVER:-}" ] || [ ! -f "${MODEL:-}" ]; }; then
    echo "ENGINE=llama needs LLAMA_SERVER (a llama-server binary) and MODEL (a GGUF file); bench/kv-wall.sh builds them" >&2; exit 2
  fi
}

# replicas_up: sets URLS (two replica URLs), started afresh unless REPLICA_URLS.
replica_pids=()
replicas_up() {
  if [ -n "$REPLICA_URLS" ]; then
    URLS=($REPLICA_URLS)
    local u
    for u in "${URLS[@]}"; do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null || return 1; done
    return 0
  fi
  [ ${#replica_pids[@]} -gt 0 ] && { kill "${replica_pids[@]}" 2>/dev/null || true; wait "${replica_pids[@]}" 2>/dev/null || true; }
  replica_pids=(); URLS=()
  local i port
  for i in 0 1; do
    if [ "$ENGINE" = sim ]; then
      start_sim "s$i" --kv-tokens 122636 --time-scale 0.25
      URLS+=("${SIM_URL[s$i]}"); replica_pids+=("${SIM_PID[s$i]}")
    else
      port=$(free_port)
      taskset -c "$i" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" -t 1 -c 16384 -np 1 \
        --cache-ram "${CACHE_RAM:-8192}" --jinja -a smollm2 --metrics >"$BENCH_TMP/llama-$i.log" 2>&1 &
      replica_pids+=($!); URLS+=("http://127.0.0.1:$port")
    fi
  done
  # Exits when one never comes up (a return would read as caches that could not be emptied).
  for i in 0 1; do wait_engine "${URLS[$i]}" "${replica_pids[$i]}" "$BENCH_TMP/llama-$i.log"; done
}

# router_up ARM: the arm's router in front of URLS; sets ROUTER_URL, ROUTER_PID.
router_up() {
  local arm=$1 reps="--replica r0=${URLS[0]} --replica r1=${URLS[1]}"
  case $arm in
    prefixgate) start_gateway "$arm" "$bin" $reps ;;
    prefixgate-nohold) start_gateway "$arm" "$bin" $reps --set sessions.max_wait_ms=0 ;;
    prefixgate-counter) start_gateway "$arm" "$bin" $reps --set routing.spread=counter ;;
    prefixgate-base) start_gateway "$arm" "${BASE_BIN:?prefixgate-base runs BASE_BIN}" $reps ;;
    vllm-router)
      local port; port=$(free_port)
      "$routers_venv/bin/vllm-router" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" \
        --policy cache_aware --worker-urls "${URLS[@]}" >"$BENCH_TMP/vllm-router.log" 2>&1 &
      ROUTER_PID=$!; ROUTER_URL=http://127.0.0.1:$port
      for _ in $(seq 300); do curl -sf -o /dev/null "$ROUTER_URL/health" && break; sleep 0.2; done
      return 0 ;;
    *) echo "unknown arm $arm" >&2; exit 2 ;;
  esac
  ROUTER_PID=${GW_PID[$arm]}; ROUTER_URL=${GW_URL[$arm]}
  wait_replicas_up "${GW_ADMIN[$arm]}" 2
}

