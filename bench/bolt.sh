#!/usr/bin/env bash
# The optimized build: prefixgate's release binary with its code laid out
# by BOLT (LLVM's post-link optimizer) from a profile of the gateway at
# work. The hop's remaining cost is mostly the CPU's front end: a request
# runs through actix-web, awc, tokio and prefixgate, ~1 MB of hot code
# spread across a 25 MB binary. BOLT puts the code that runs together
# next to each other and moves the cold blocks out of the hot functions.
# Same source, same behaviour: only the order of the machine code changes.
#
# Steps: a release build with relocations kept (so BOLT may move whole
# functions) and v0 symbol names (BOLT's profile writer stops at names
# over its line buffer, and legacy-mangled async closures exceed it);
# an instrumented copy serves a training load in front of two simulated
# replicas (small chat requests under wrk, then agent loops in the three
# dialects and a burst of cold prompts, all through the gateway); BOLT
# then rewrites the release binary from the counts, and the rewritten
# binary must pass agent loops in the three dialects before it is kept.
#
# Output: target/bolt/prefixgate (and the profile next to it). Builds in
# target/relocs, apart from the normal release build (its flags differ).
# Needs: apt-get install -y bolt-16 wrk. An optional release step: CI does not run it.
# Usage: bench/bolt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LLVM_BOLT=${LLVM_BOLT:-llvm-bolt-16}
out=$PWD/target/bolt
mkdir -p "$out"
command -v "$LLVM_BOLT" >/dev/null || { echo "needs $LLVM_BOLT: apt-get install -y bolt-16" >&2; exit 1; }
# Run from its real path: BOLT finds its instrumentation runtime in ../lib
# of the path it was started as (for /usr/bin/llvm-bolt-16: /usr/lib).
LLVM_BOLT=$(readlink -f "$(command -v "$LLVM_BOLT")")

RUSTFLAGS="-C link-arg=-Wl,--emit-relocs -C symbol-mangling-version=v0" \
  CARGO_TARGET_DIR=target/relocs cargo build --release -q --bin prefixgate
plain=$PWD/target/relocs/release/prefixgate
"$LLVM_BOLT" "$plain" -o "$out/prefixgate-instrumented" -instrument \
  -instrumentation-file="$out/profile" -instrumentation-file-append-pid >"$out/instrument.log" 2>&1

source bench/lib.sh
bench_init
SIM_BIN=$plain start_sim a --time-scale 0
SIM_BIN=$plain start_sim b --time-scale 0
replica_a=${SIM_PID[a]}
body=$CHAT_BODY
n=0
# gateway BIN: BIN serves in front of the two replicas; its pid in $gateway, URLs in $base, $admin.
gateway() {
  n=$((n + 1))
  start_gateway "g$n" "$1" --replica "a=${SIM_URL[a]}" --replica "b=${SIM_URL[b]}"
  gateway=${GW_PID[g$n]}; base=${GW_URL[g$n]}; admin=${GW_ADMIN[g$n]}
  wait_replicas_up "$admin" 2 && wait_ok "$base"
}

rm -f "$out"/profile.*.fdata "$out/serve.log"
gateway "$out/prefixgate-instrumented"
cat >"$out/post.lua" <<LUA
wrk.method = "POST"; wrk.body = '$body'; wrk.headers["content-type"] = "application/json"
LUA
wrk -t2 -c32 -d10s -s "$out/post.lua" "$base/v1/chat/completions" >/dev/null
for api in chat responses messages; do
  $plain bench agent-loop --base-url "$base" --api $api --families 8 --turns 6 --context-tokens 2000 >/dev/null
done
$plain bench burst --base-url "$base" --requests 64 --prompt-tokens 2000 >/dev/null
curl -sf -o /dev/null "$admin/metrics"
kill -INT $gateway
wait $gateway || true # the profile is written as the process exits
profile=$(ls "$out"/profile.*.fdata)

"$LLVM_BOLT" "$plain" -o "$out/prefixgate.new" -data="$profile" -reorder-blocks=ext-tsp -reorder-functions=hfsort \
  -split-functions -split-all-cold -split-eh -dyno-stats >"$out/optimize.log" 2>&1
rm -f "$out/prefixgate-instrumented"
grep -E "functions in the binary|splitting separates" "$out/optimize.log"

# The optimized binary must route as the plain one does: agent loops in
# each dialect, every request answered, continuations pinned, both
# replicas used; errors and failover as below.
gateway "$out/prefixgate.new"
for api in chat responses messages; do
  $plain bench agent-loop --base-url "$base" --api $api --families 4 --turns 4 --context-tokens 2000 --json |
    python3 -c '
import json, sys
s = json.load(sys.stdin)["summary"]
ok = s["requests"] == 16 and s["errors"] == 0 and s["by_route"].get("pinned") == 12 and len(s["by_replica"]) == 2
print(sys.argv[1], "requests", s["requests"], "errors", s["errors"], "routes", s["by_route"], "replicas", s["by_replica"])
sys.exit(0 if ok else 1)' $api
done
# Errors come back in OpenAI's shape with their status, and a replica that
# stops is hidden by failover.
# expect STATUS BODY: one chat request answered with STATUS and, for an error, its JSON.
expect() {
  local got
  got=$(curl -s -o "$out/reply.json" -w '%{http_code}' -H 'content-type: application/json' -d "$2" "$base/v1/chat/completions")
  [ "$got" = "$1" ] || { echo "expected $1, got $got for $2" >&2; return 1; }
  [ "$1" = 200 ] || python3 -c 'import json, sys; e = json.load(open(sys.argv[1]))["error"]; assert e["message"] and e["type"], e' "$out/reply.json"
}
expect 400 '{"model":'
expect 404 '{"model":"no-such-model","messages":[{"role":"user","content":"hi"}]}'
kill $replica_a
for _ in $(seq 1 10); do expect 200 "$body"; done
echo "errors and failover: as expected"
kill -INT $gateway
wait $gateway || true
mv "$out/prefixgate.new" "$out/prefixgate"
echo "optimized binary: $out/prefixgate"
