#!/usr/bin/env bash
# The simulator held against a paced real fleet. bench.sh replays a Mooncake slice on a fleet of real
# engines paced like GPUs, behind kvgate `enforce`, kvgate `off` and SMG 1.13 `cache_aware`; then
# `kvgate sim` replays the very same slice on engine models configured as that fleet (the paced
# profile, and the engines' own step budget, batch limit, KV size and block size) under
# `projected:enforce`, `projected:off` and `cache_aware`, with kvgate's bench settings. Prints both
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
scale="${PACE_SCALE:-4}"
kv_tokens="${KV_TOKENS:-65536}"
block="${BLOCK:-32}"
[ "$pace" != off ] || { echo "fidelity.sh: the simulator models paced engines; PACE=off has nothing to compare" >&2; exit 2; }
work=target/real-engines/bench-$runtime
if [ -z "${SIM_ONLY:-}" ]; then
  scripts/real-engines/bench.sh "$rows" "$engines" "$time_scale" "$repeats" kvgate-enforce,kvgate-off,smg-cache_aware
fi
[ -f "$work/results.jsonl" ] && [ -f "$work/slice.jsonl" ] || { echo "fidelity.sh: no bench results in $work" >&2; exit 1; }
cargo build --release -p kvgate --quiet

# The engines as they run: vLLM's CPU server steps at most 2,048 tokens and runs 256 sequences;
# SGLang's CPU engine chunks prefill at 4,096 and runs up to 2,048 (both logged at start).
case "$runtime" in
  vllm) budget=2048; max_running=256 ;;
  sglang) budget=4096; max_running=2048 ;;
  *) echo "fidelity.sh: RUNTIME must be vllm or sglang" >&2; exit 2 ;;
esac
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
print(json.dumps(p))' "$scale" "$budget" "$max_running" "$kv_tokens" "$block" "$runtime" > "$work/sim-profile.json"
target/release/kvgate sim --trace "$work/slice.jsonl" --trace-block-tokens "$block" --workers "$engines" \
  --profile "$work/sim-profile.json" --compare projected:enforce,projected:off,cache_aware \
  --assumed-decode-tokens 32 --admission-wait-s 0 --format json > "$work/sim.json"

python3 - "$work/results.jsonl" "$work/sim.json" "$rows" "$engines" "$runtime" "$pace" "$scale" <<'PY'
import json, statistics, sys
results, sim_path, rows, engines, runtime, pace, scale = sys.argv[1:8]
real = [json.loads(l) for l in open(results)]
sim = {f"{r['policy']}:{r['mode']}" if r.get("mode") else r["policy"]: r for r in json.load(open(sim_path))["runs"]}
pairs = [("kvgate-enforce", "projected:enforce"), ("kvgate-off", "projected:off"), ("smg-cache_aware", "cache_aware")]
def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")
print(f"{rows} Mooncake rows on {engines} {runtime} engines paced as {pace} x {scale}: real (mean of "
      f"{len(real) // 3} runs) against kvgate sim; error = sim / real - 1\n")
print("| router | | TTFT p50 (ms) | p90 | p99 | e2e p50 (ms) | output tok/s | hit rate | shares, largest first | busiest peak queue |")
print("|---|---|---|---|---|---|---|---|---|---|")
for real_name, sim_name in pairs:
    rs = [r for r in real if r["config"] == real_name]
    s = sim.get(sim_name)
    if not rs or s is None:
        print(f"| {real_name} | missing | | | | | | | | |")
        continue
    rt = {p: mean(r["ttft_ms"][p] for r in rs) for p in ("p50", "p90", "p99")}
    st = {p: s["ttft_s"][p] * 1000 for p in ("p50", "p90", "p99")}
    re2e, se2e = mean(r["e2e_ms"]["p50"] for r in rs), s["e2e_s"]["p50"] * 1000
    rtok, stok = mean(r["output_tok_per_s"] for r in rs), s["throughput"]["output_tokens_per_s"]
    rhit, shit = mean(r["engine_hit_rate"] for r in rs), s["cache"]["hit_rate"]
    rshare = sorted((mean(r["shares"][i] for r in rs) for i in range(int(engines))), reverse=True)
    total = max(1, sum(w["requests"] for w in s["workers"]))
    sshare = sorted((w["requests"] / total for w in s["workers"]), reverse=True)
    rpeak, speak = mean(max(x for x in r["waiting_peak"] if x is not None) for r in rs), max(w["max_waiting"] for w in s["workers"])
    fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    print(f"| {real_name} | real | {rt['p50']:.0f} | {rt['p90']:.0f} | {rt['p99']:.0f} | {re2e:.0f} | {rtok:.0f} | {rhit:.3f} | {fmt(rshare)} | {rpeak:.0f} |")
    print(f"| {sim_name} | sim | {st['p50']:.0f} | {st['p90']:.0f} | {st['p99']:.0f} | {se2e:.0f} | {stok:.0f} | {shit:.3f} | {fmt(sshare)} | {speak} |")
    err = lambda a, b: f"{b / a - 1:+.0%}" if a else "n/a"
    share_pts = max(abs(a - b) for a, b in zip(rshare, sshare)) * 100
    print(f"| | error | {err(rt['p50'], st['p50'])} | {err(rt['p90'], st['p90'])} | {err(rt['p99'], st['p99'])} | "
          f"{err(re2e, se2e)} | {err(rtok, stok)} | {shit - rhit:+.3f} | {share_pts:.0f} points at most | |")
PY
