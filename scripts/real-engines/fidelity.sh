#!/usr/bin/env bash
# The simulator held against a paced real fleet. bench.sh replays a Mooncake slice on a fleet of real
# engines paced like GPUs, behind kvgate `enforce`, kvgate `off` and SMG 1.13 `cache_aware`; then
# `kvgate sim` replays the very same slice on engine models configured as that fleet (the paced
# profile, and the engines' own step budget, batch limit, KV size and block size) under
# `projected:enforce`, `projected:off` and `smg_cache_aware_http` (SMG over HTTP engines), with
# kvgate's bench settings. Prints both
# side by side: TTFT p50/p90/p99, end-to-end p50, output tokens/s, the engines' hit rate, each
# engine's share (largest first: engine numbers differ between the two) and its peak waiting queue,
# with the simulator's error. Not part of CI; results go in docs/simulator.md.
#
# Usage: scripts/real-engines/fidelity.sh [ROWS] [ENGINES] [TIME_SCALE] [REPEATS]
#   as bench.sh (defaults 400, 4, 2, 1), with its environment (RUNTIME, PACE, PACE_SCALE, KV_TOKENS,
#   BLOCK, MAX_PROMPT, MAX_OUTPUT). SIM_ONLY=1 reuses the last real run's results.
set -euo pipefail
cd "$(dirname "$0")/../.."
rows="${1:-400}"
engines="${2:-4}"
time_scale="${3:-2}"
repeats="${4:-1}"
runtime="${RUNTIME:-vllm}"
pace="${PACE:-llama3-8b-h100}"
# SGLang engines run at half the pace: at x 4 their steps overrun when four engines work at once.
scale="${PACE_SCALE:-$([ "$runtime" = sglang ] && echo 8 || echo 4)}"
kv_tokens="${KV_TOKENS:-65536}"
block="${BLOCK:-32}"
[ "$pace" != off ] || { echo "fidelity.sh: the simulator models paced engines; PACE=off has nothing to compare" >&2; exit 2; }
work=target/real-engines/bench-$runtime
if [ -z "${SIM_ONLY:-}" ]; then
  scripts/real-engines/bench.sh "$rows" "$engines" "$time_scale" "$repeats" kvgate-enforce,kvgate-off,smg-cache_aware
fi
[ -f "$work/results.jsonl" ] && [ -f "$work/slice.jsonl" ] || { echo "fidelity.sh: no bench results in $work" >&2; exit 1; }
cargo build --release -p kvgate --quiet

scripts/real-engines/sim-profile.sh "$runtime" "$pace" "$scale" "$kv_tokens" "$block" "$work" > "$work/sim-profile.json"
target/release/kvgate sim --trace "$work/slice.jsonl" --trace-block-tokens "$block" --workers "$engines" \
  --profile "$work/sim-profile.json" --compare projected:enforce,projected:off,smg_cache_aware_http \
  --assumed-decode-tokens 32 --admission-wait-s 0 --format json > "$work/sim.json"

python3 - "$work/results.jsonl" "$work/sim.json" "$rows" "$engines" "$runtime" "$pace" "$scale" <<'PY'
import sys
sys.path.insert(0, "scripts/real-engines")
from fidelity_common import error, latencies, mean, pairs, runs_count
results, sim_path, rows, engines, runtime, pace, scale = sys.argv[1:8]
names = [("kvgate-enforce", "projected:enforce"), ("kvgate-off", "projected:off"), ("smg-cache_aware", "smg_cache_aware_http")]
print(f"{rows} Mooncake rows on {engines} {runtime} engines paced as {pace} x {scale}: real (mean of "
      f"{runs_count(results)} runs) against kvgate sim; error = sim / real - 1\n")
print("| router | | TTFT p50 (ms) | p90 | p99 | e2e p50 (ms) | output tok/s | hit rate | shares, largest first | busiest peak queue |")
print("|---|---|---|---|---|---|---|---|---|---|")
fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)
for real_name, sim_name, found in pairs(results, sim_path, names):
    if found is None:
        print(f"| {real_name} | missing | | | | | | | | |")
        continue
    rs, s = found
    rl, sl = latencies(rs, s)
    rtok, stok = mean(r["output_tok_per_s"] for r in rs), s["throughput"]["output_tokens_per_s"]
    rhit, shit = mean(r["engine_hit_rate"] for r in rs), s["cache"]["hit_rate"]
    rshare = sorted((mean(r["shares"][i] for r in rs) for i in range(int(engines))), reverse=True)
    total = max(1, sum(w["requests"] for w in s["workers"]))
    sshare = sorted((w["requests"] / total for w in s["workers"]), reverse=True)
    rpeak = mean(max(x for x in r["waiting_peak"] if x is not None) for r in rs)
    speak = max(w["max_waiting"] for w in s["workers"])
    print(f"| {real_name} | real | {' | '.join(f'{x:.0f}' for x in rl)} | {rtok:.0f} | {rhit:.3f} | {fmt(rshare)} | {rpeak:.0f} |")
    print(f"| {sim_name} | sim | {' | '.join(f'{x:.0f}' for x in sl)} | {stok:.0f} | {shit:.3f} | {fmt(sshare)} | {speak} |")
    share_pts = max(abs(a - b) for a, b in zip(rshare, sshare)) * 100
    print(f"| | error | {' | '.join(error(a, b) for a, b in zip(rl, sl))} | {error(rtok, stok)} | {shit - rhit:+.3f} | "
          f"{share_pts:.0f} points at most | |")
PY
