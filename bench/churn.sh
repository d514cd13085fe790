#!/usr/bin/env bash
# Churn: a fleet whose pods come back under new names, for NAMES names. Each
# step registers a replica under a new name (at one simulated engine),
# deletes the previous name, and sends one family (two turns) through the
# gateway, as the issue-25 report did. Prints, every EVERY names, the
# gateway's RSS, the size of /metrics and its lines labelled with a replica.
# Ends with the errors counted and /healthz. Not run in CI (the short
# version is `cargo test --test it churn`).
# Usage: NAMES=66000 EVERY=5000 bench/churn.sh
set -uo pipefail
cd "$(dirname "$0")/.."
NAMES=${NAMES:-66000}; EVERY=${EVERY:-5000}
cargo build --release -q || exit 1
bin=$PWD/target/release/prefixgate
source bench/lib.sh
bench_init
start_sim engine --time-scale 0.001
# No admin rate limit: the loop is one operator script, as fast as it goes.
start_gateway churn "$bin" --set rate_limits.admin_rps=0
gw=${GW_PID[churn]}
python3 bench/churn.py "${GW_URL[churn]}" "${GW_ADMIN[churn]}" "${SIM_URL[engine]}" "$gw" "$NAMES" "$EVERY"
