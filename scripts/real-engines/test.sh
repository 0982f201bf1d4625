#!/usr/bin/env bash
# The real-engine suite in one command: set-up (setup.sh), then kvgate against three real vLLM
# engines on loopback (crates/real-engines/tests/real_engines.rs, about 3 minutes on 2 cores after
# the first set-up). Engines left behind by an interrupted run are stopped before and after.
#
# Usage: scripts/real-engines/test.sh [extra cargo test arguments, e.g. -- cache_credit]
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
cargo test -p kvgate-real-engines --test real_engines "$@"
