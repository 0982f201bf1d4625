#!/usr/bin/env bash
# The real-engine suite in one command: set-up (setup.sh), then kvgate against three real vLLM
# engines on loopback, then against three real SGLang engines and one vLLM engine
# (crates/real-engines/tests/real_engines.rs, one fleet after the other: never both in memory).
# Engines left behind by an interrupted run are stopped before and after.
#
# Usage: scripts/real-engines/test.sh [extra cargo test arguments, e.g. -- cache_credit]
#   KVGATE_REAL_RUNTIMES="sglang" runs one runtime's fleet only (default: "vllm sglang").
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/real-engines/setup.sh

# Engines of earlier runs (each run keeps its pid files in target/real-engines/run-PID/).
cleanup() {
  for pidfile in target/real-engines/run-*/*.pid; do
    [ -e "$pidfile" ] || continue
    name=$(basename "$pidfile" .pid)
    scripts/real-engines/engine.sh stop "$name" "$(dirname "$pidfile")" || true
  done
  rm -rf target/real-engines/run-*
}
cleanup
trap cleanup EXIT
# A failed run's engine logs are kept in target/real-engines/failed-RUNTIME/ and their last lines
# printed, so that a CI log says what the engines did (the run directories go with the cleanup).
keep_logs() {
  local keep="target/real-engines/failed-$1"
  rm -rf "$keep" && mkdir -p "$keep"
  cp target/real-engines/run-*/*.log target/real-engines/run-*/*.pace.jsonl "$keep"/ 2>/dev/null || true
  for log in "$keep"/*.log; do
    [ -e "$log" ] || continue
    echo "== last lines of $log"
    tail -n 40 "$log"
  done
}
for runtime in ${KVGATE_REAL_RUNTIMES:-vllm sglang}; do
  echo "== real-engine suite: $runtime fleet"
  if ! KVGATE_REAL_RUNTIME="$runtime" cargo test -p kvgate-real-engines --test real_engines "$@"; then
    keep_logs "$runtime"
    exit 1
  fi
  cleanup
done
