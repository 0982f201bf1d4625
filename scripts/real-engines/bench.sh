#!/usr/bin/env bash
# kvgate against SMG on the same real vLLM or SGLang fleet: NVIDIA's aiperf replays a Mooncake
# conversation slice through each router, every run on a freshly started fleet (cold caches), runs
# interleaved and repeated. Reports TTFT p50/p90/p99, throughput, errors, and the engines' own
# prefix-cache hit rate (cached over prompt tokens by the engines' own counters, summed over the
# fleet: vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, or
# sglang:cached_tokens_total / sglang:prompt_tokens_total). Not part of CI; results go in
# docs/benchmarks-fleets.md.
#
# Usage: scripts/real-engines/bench.sh [ROWS] [ENGINES] [TIME_SCALE] [REPEATS] [CONFIGS]
#   ROWS        trace rows replayed (default 400: 13.5% of their blocks are a prefix seen before)
#   ENGINES     engines (default 4; RUNTIME=sglang for SGLang, vllm by default), each with KV_TOKENS of KV cache (default 65536: enough to
#               keep a conversation's prefix until its next turn; with 8192 the caches turn over in
#               seconds and no router can reuse more than the shared first block)
#   TIME_SCALE  the trace's timestamps are divided by this (default 2: about 5.5 requests/s, more than
#               the 4 engines on 2 cores keep up with, so queues form)
#   REPEATS     rounds over the configs, each round in a rotated order (default 3)
#   CONFIGS     comma-separated from kvgate-enforce, kvgate-off, smg-cache_aware, smg-round_robin,
#               smg-cache_aware-unguarded (bench-common.sh)
#               (default: all four)
# Env TRANSPORT=grpc runs the engines as gRPC workers (SMG's worker protocol) and both routers reach
# them over it; the engines' hit rate then comes from the responses' usage as aiperf totals it
# (cached over prompt tokens), each engine's share from its servicer's log, its queue from GetLoads.
# Engines are paced like GPUs (scripts/real-engines/pacer/kvgate_pacer.py): env PACE names the engine
# profile (default llama3-8b-h100; `off` runs them unpaced, each step as fast as the CPU computes it)
# and PACE_SCALE how many times slower than that GPU they run (default 4 for vLLM, 8 for SGLang, whose
# steps overrun at 4 when four engines work at once: docs/simulator-fidelity.md). kvgate is given the paced
# rates; unpaced, the rates measured on this machine's CPU.
# Prompts: each Mooncake hash id becomes a whole block of BLOCK tokens (env BLOCK, default 32) instead
# of 512, prompts are cut to MAX_PROMPT tokens (env, default 3500), and outputs are a quarter of the
# trace's, at most MAX_OUTPUT (env, default 64).
set -euo pipefail
cd "$(dirname "$0")/../.."
rows="${1:-400}"
engines="${2:-4}"
time_scale="${3:-2}"
repeats="${4:-3}"
configs="${5:-kvgate-enforce,kvgate-off,smg-cache_aware,smg-round_robin}"
kv_tokens="${KV_TOKENS:-65536}"
block="${BLOCK:-32}"
max_prompt="${MAX_PROMPT:-3500}"
max_output="${MAX_OUTPUT:-64}"
runtime="${RUNTIME:-vllm}"
pace="${PACE:-llama3-8b-h100}"
# SGLang engines run at half the pace: at x 4 their steps overrun when four engines work at once.
pace_scale="${PACE_SCALE:-$([ "$runtime" = sglang ] && echo 8 || echo 4)}"
trace=../shared/data/traces/mooncake_conversation_trace.jsonl
[ -f "$trace" ] || { echo "bench.sh: $trace is missing" >&2; exit 1; }
transport="${TRANSPORT:-http}"
work=target/real-engines/bench-$runtime
[ "$transport" = grpc ] && work="$work-grpc"
# Over gRPC the hit rate is read from the responses' usage, which aiperf totals when asked to.
usage_flag=()
[ "$transport" = grpc ] && usage_flag=(--use-server-token-count)

# vLLM and SGLang report running requests, not their remaining output: kvgate assumes half this
# slice's mean output (about 32 tokens) instead of the default 256.
kvgate_toml=$'[telemetry]\npoll_interval_ms = 200\nassumed_decode_tokens = 32'
source scripts/real-engines/bench-common.sh
if [ ! -x target/bench-venv/bin/aiperf ]; then
  python3 -m venv target/bench-venv
  target/bench-venv/bin/pip install --quiet --disable-pip-version-check "aiperf==0.13.0"
fi

# The slice: hash ids kept (equal ids, equal content), lengths scaled to BLOCK tokens a hash id.
python3 - "$trace" "$rows" "$time_scale" "$block" "$max_prompt" "$max_output" > "$work/slice.jsonl" <<'PY'
import json, sys
path, rows, scale, block, max_prompt, max_output = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
with open(path) as f:
    for i, line in enumerate(f):
        if i >= rows:
            break
        r = json.loads(line)
        # Whole blocks only: aiperf requires each hash id to have one size everywhere, and a trace's
        # partial last block reappears whole in the conversation's next turn.
        ids = r["hash_ids"][: max(1, max_prompt // block)]
        r["hash_ids"] = ids
        r["input_length"] = len(ids) * block
        # At least 8: the random-weight model's first tokens sometimes decode to nothing, which aiperf
        # counts as an error.
        r["output_length"] = max(8, min(max_output, r["output_length"] // 4))
        r["timestamp"] = int(r["timestamp"] / scale)
        print(json.dumps(r))
PY

results="$work/results.jsonl"
: > "$results"
# aiperf 0.13's prompt-synthesis workers load the tokenizer in HF offline mode, which finds only hub
# snapshots, never a local directory: lay the tiny model's tokenizer out as a cached snapshot of a
# made-up repo, kvgate/tiny, in a private HF cache, and load it from there.
export HF_HOME="$PWD/target/real-engines/hf-home" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
snapshot="$HF_HOME/hub/models--kvgate--tiny/snapshots/0000000000000000000000000000000000000000"
mkdir -p "$snapshot" "$HF_HOME/hub/models--kvgate--tiny/refs"
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja "$model"/config.json "$snapshot/"
echo -n 0000000000000000000000000000000000000000 > "$HF_HOME/hub/models--kvgate--tiny/refs/main"
# One run: aiperf replays the slice through the router, and the engines' counters and queues say what they did.
replay_once() {
  local cfg="$1" rep="$2"
  read -r hits0 queries0 < <(fleet_cache)
  read -r -a served0 < <(fleet_finished)
  sample_queues "$work/queues-$cfg-$rep.jsonl" &
  sampler=$!
  out="$work/aiperf-$cfg-$rep"
  rm -rf "$out"
  target/bench-venv/bin/aiperf profile --model tiny --tokenizer kvgate/tiny --endpoint-type chat --streaming \
    --url "http://127.0.0.1:$router_port" --custom-dataset-type mooncake_trace --input-file "$work/slice.jsonl" \
    --isl-block-size "$block" --fixed-schedule --extra-inputs ignore_eos:true --request-timeout-seconds 300 "${usage_flag[@]}" \
    --no-server-metrics --no-gpu-telemetry --ui-type none --output-artifact-dir "$out" > "$work/aiperf-$cfg-$rep.log" 2>&1 \
    || { echo "bench.sh: aiperf failed for $cfg; see $work/aiperf-$cfg-$rep.log" >&2; exit 1; }
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  read -r hits1 queries1 < <(fleet_cache)
  read -r -a served1 < <(fleet_finished)
  served=$(for i in "${!served1[@]}"; do echo $((served1[i] - served0[i])); done | paste -sd,)
  python3 - "$out" "$cfg" "$rep" "$((hits1 - hits0))" "$((queries1 - queries0))" "$served" "$work/queues-$cfg-$rep.jsonl" >> "$results" <<'PY'
import glob, json, sys
out, cfg, rep, hits, queries = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
served = [int(x) for x in sys.argv[6].split(",")]
samples = [json.loads(l) for l in open(sys.argv[7]) if l.strip()]
queues = [[q for _, qs in samples if qs[i] is not None for q in [qs[i]]] for i in range(len(served))]
files = sorted(glob.glob(f"{out}/**/*aiperf*.json", recursive=True))
data = json.load(open(files[0]))
m = data.get("records", data)
def get(name, stat):
  v = m.get(name, {})
  return v.get(stat) if isinstance(v, dict) else None
if not queries:
  # gRPC workers: cached over prompt tokens as the responses' usage reports them.
  hits, queries = get("total_usage_prompt_cache_read_tokens", "avg") or 0, get("total_usage_prompt_tokens", "avg") or 0
print(json.dumps({
  "config": cfg, "round": rep,
  "ttft_ms": {p: get("time_to_first_token", p) for p in ("p50", "p90", "p99")},
  "requests": get("request_count", "avg"), "errors": get("error_request_count", "avg") or 0,
  "request_per_s": get("request_throughput", "avg"), "output_tok_per_s": get("output_token_throughput", "avg"),
  "engine_hit_rate": hits / queries if queries else None, "prefill_tokens": queries - hits,
  "shares": [round(x / max(1, sum(served)), 3) for x in served],
  "waiting_mean": [round(sum(q) / len(q), 2) if q else None for q in queues],
  "waiting_peak": [max(q) if q else None for q in queues],
  "e2e_ms": {p: get("request_latency", p) for p in ("p50", "p90")},
}))
PY
  tail -n 1 "$results" >&2
}
for_each_run replay_once "$configs" "$repeats"

python3 - "$results" "$rows" "$engines" "$time_scale" "$kv_tokens" "$block" "$runtime" "$pace_label" "$transport" <<'PY'
import json, statistics, sys
path, rows, engines, scale, kv, block, runtime = sys.argv[1:8]
runs = [json.loads(l) for l in open(path)]
order = []
for r in runs:
    if r["config"] not in order:
        order.append(r["config"])
pace = sys.argv[8]
print(f"aiperf replaying {rows} Mooncake conversation rows (timestamps / {scale}, hash id = {block} tokens) on {engines} "
      f"real {runtime} engines{' as gRPC workers' if sys.argv[9] == 'grpc' else ''} ({kv} KV tokens each, {pace}), fresh fleet per run; "
      f"mean of {len(runs) // max(1, len(order))} interleaved runs\n")
print("| router | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | req/s | output tok/s | errors | engine prefix-cache hit rate |")
print("|---|---|---|---|---|---|---|---|")
def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")
for c in order:
    rs = [r for r in runs if r["config"] == c]
    t = lambda p: mean([r["ttft_ms"][p] for r in rs])
    print(f"| {c} | {t('p50'):.0f} | {t('p90'):.0f} | {t('p99'):.0f} | {mean([r['request_per_s'] for r in rs]):.2f} | "
          f"{mean([r['output_tok_per_s'] for r in rs]):.0f} | {sum(int(r['errors'] or 0) for r in rs)} | "
          f"{mean([r['engine_hit_rate'] for r in rs]):.3f} |")
print("\nEach run:\n")
print("| router | round | TTFT p50 | p90 | p99 | req/s | errors | hit rate | engines' shares | mean / peak waiting |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in runs:
    t = r["ttft_ms"]
    shares = " ".join(f"{x:.2f}" for x in r["shares"])
    waiting = " ".join(f"{m:.1f}/{p:.0f}" for m, p in zip(r["waiting_mean"], r["waiting_peak"]) if m is not None)
    print(f"| {r['config']} | {r['round']} | {t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | {r['request_per_s']:.2f} | "
          f"{int(r['errors'] or 0)} | {r['engine_hit_rate']:.3f} | {shares} | {waiting} |")
PY
