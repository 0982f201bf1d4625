#!/usr/bin/env bash
# The gRPC path's own cost: one real gRPC worker (vLLM, or SGLang with RUNTIME=sglang), asked
# straight (`Generate`, the prompt's token ids in and token ids out, as a gateway calls it) and
# through kvgate and SMG 1.13 in gRPC mode (a streamed completion of the prompt's text over HTTP,
# which each router tokenizes, sends to the worker and detokenizes). The difference is what the
# gateway adds: to the time to first token and end to end of requests one after another, and to
# the output tokens per second of concurrent ones. Every request has a fresh random prompt (no
# cache hits) and generates exactly OUTPUT tokens. Not part of CI; results go in
# docs/benchmarks-fleets.md.
#
# Usage: scripts/real-engines/grpc-path.sh [REQUESTS] [PROMPT] [OUTPUT] [CONCURRENCY] [ROUNDS]
#   REQUESTS     sequential requests per run (default 40); the concurrent phase sends as many
#   PROMPT       prompt tokens (default 512)
#   OUTPUT       output tokens (default 64)
#   CONCURRENCY  clients of the concurrent phase (default 8)
#   ROUNDS       rounds over direct, kvgate and SMG, each round in a rotated order (default 2)
# The worker is paced like a GPU as in the other benches (env PACE, PACE_SCALE; PACE=off unpaced).
set -euo pipefail
cd "$(dirname "$0")/../.."
requests="${1:-40}"
prompt="${2:-512}"
output="${3:-64}"
concurrency="${4:-8}"
rounds="${5:-2}"
engines=1
kv_tokens="${KV_TOKENS:-65536}"
runtime="${RUNTIME:-vllm}"
pace="${PACE:-llama3-8b-h100}"
pace_scale="${PACE_SCALE:-4}"
transport=grpc
work=target/real-engines/grpc-path-$runtime
kvgate_toml=$'[telemetry]\npoll_interval_ms = 200'
source scripts/real-engines/bench-common.sh

python=target/real-engines/venv/bin/python
client() {
  "$python" scripts/real-engines/grpc-path-client.py "$@" --runtime "$runtime" --requests "$requests" \
    --prompt "$prompt" --output "$output" --concurrency "$concurrency" --tokenizer "$model/tokenizer.json"
}
stop_router() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}

start_fleet
results="$work/results.jsonl"
: > "$results"
configs=(direct kvgate-enforce smg-cache_aware)
for round in $(seq 1 "$rounds"); do
  for k in 0 1 2; do
    cfg=${configs[$(((k + round - 1) % 3))]}
    echo "[round $round] $cfg" >&2
    if [ "$cfg" = direct ]; then
      line=$(client direct "$(engine_port 0)" --seed "$((round * 10 + k))")
    else
      start_router "$cfg" "$work/$cfg-$round.router.log"
      line=$(client router "$router_port" --seed "$((round * 10 + k))")
      stop_router
    fi
    echo "{\"config\": \"$cfg\", \"round\": $round, \"result\": $line}" >> "$results"
  done
done

echo "one $runtime gRPC worker, $pace_label; $requests requests of $prompt prompt and $output output tokens one after another, then $concurrency clients at once"
python3 - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in runs:
    by.setdefault(r["config"], []).append(r["result"])
def med(cfg, key):
    return statistics.median(x[key] for x in by[cfg])
print("| path | TTFT p50 / p90 (ms) | end to end p50 / p90 (ms) | added TTFT p50 | added end to end p50 | decode tok/s a request | tok/s, concurrent |")
print("|---|---|---|---|---|---|---|")
for cfg in ["direct", "kvgate-enforce", "smg-cache_aware"]:
    if cfg not in by:
        continue
    added = lambda key: med(cfg, key) - med("direct", key)
    print(f"| {cfg} | {med(cfg, 'ttft_p50'):.1f} / {med(cfg, 'ttft_p90'):.1f} | {med(cfg, 'e2e_p50'):.1f} / {med(cfg, 'e2e_p90'):.1f} "
          f"| {added('ttft_p50'):+.1f} | {added('e2e_p50'):+.1f} | {med(cfg, 'decode_tok_s'):.1f} | {med(cfg, 'concurrent_tok_s'):.0f} |")
print(f"(medians over {len(by['direct'])} rounds)")
PY
