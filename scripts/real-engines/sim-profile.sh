#!/usr/bin/env bash
# The engine profile `kvgate sim` needs to model a paced real fleet: PACE's step costs times SCALE
# and its prefill rate over SCALE (as the pacer paces the engines), with the engines' own step
# budget, batch limit, KV size and block size. Prints the profile as JSON, for `kvgate sim --profile`.
# Used by fidelity.sh and incident-fidelity.sh.
#
# Usage: scripts/real-engines/sim-profile.sh RUNTIME PACE SCALE KV_TOKENS BLOCK
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 5 ] || { echo "usage: $0 RUNTIME PACE SCALE KV_TOKENS BLOCK" >&2; exit 2; }
runtime="$1" pace="$2" scale="$3" kv_tokens="$4" block="$5"
# The engines as they run: vLLM's CPU server steps at most 2,048 tokens and runs 256 sequences;
# SGLang's CPU engine chunks prefill at 4,096 and runs up to 2,048 (both logged at start).
case "$runtime" in
  vllm) budget=2048; max_running=256 ;;
  sglang) budget=4096; max_running=2048 ;;
  *) echo "sim-profile.sh: RUNTIME must be vllm or sglang" >&2; exit 2 ;;
esac
[ -x target/release/kvgate ] || cargo build --release -p kvgate --quiet
target/release/kvgate profile "$pace" --compact | python3 -c '
import json, sys
scale, budget, running, kv, block, runtime = float(sys.argv[1]), *map(int, sys.argv[2:6]), sys.argv[6]
p = json.load(sys.stdin)
for k in ("step_base_ms", "per_seq_ms", "per_kilo_context_ms"):
    p[k] *= scale
p["prefill_tokens_per_s"] /= scale
name = p["name"]
p.update(name=f"{name} x {scale:g}, as the paced {runtime} fleet", chunk_budget=budget, max_running=running,
         kv_capacity_tokens=kv, block_size=block, flavor=runtime)
print(json.dumps(p))' "$scale" "$budget" "$max_running" "$kv_tokens" "$block" "$runtime"
