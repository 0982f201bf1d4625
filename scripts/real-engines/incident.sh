#!/usr/bin/env bash
# The incident on a real, paced fleet: a long hot prefix owned by one engine (served once through the
# router), then bursts of requests sharing it from many clients at once. Each router runs on a fresh
# fleet (cold caches), configs interleaved and repeated. Reports TTFT p50/p90/p99, end-to-end p50,
# the owner's share of each burst, each engine's share and peak waiting queue (from its own
# /metrics), the engines' prefix-cache hit rate and their preemptions; after each SMG run, SMG's own
# counters of its choices (cache-aware branches, overload vetoes, the loads it polled) go to
# WORK/smg-metrics-CONFIG-ROUND.txt, and each request's send time and latencies to
# WORK/CONFIG-ROUND.requests.jsonl. Not part of CI; results go in docs/benchmarks-incident.md.
#
# Usage: scripts/real-engines/incident.sh [ENGINES] [REPEATS] [CONFIGS]
#   ENGINES  engines (default 4; about 3 GB each), each with KV_TOKENS of KV (default 8192: the
#            owner holds about 9 of the burst's requests at once, so a burst queues there)
#   REPEATS  rounds over the configs, each round in a rotated order (default 2)
#   CONFIGS  comma-separated from kvgate-enforce, kvgate-off, kvgate-shadow, smg-cache_aware,
#            smg-cache_aware-unguarded (its 1.13 guards against a hot owner off: see
#            bench-common.sh), smg-round_robin (default: kvgate-enforce,kvgate-off,smg-cache_aware)
# Env: RUNTIME (vllm|sglang), TRANSPORT (http, or grpc: the engines run as gRPC workers, SMG's
# protocol, as the incident's fleet did; their hit rate is then the one their responses report, and
# each one's share is counted from its servicer's log), PACE and PACE_SCALE (as bench.sh: default llama3-8b-h100 x 4, x 8 for SGLang),
# PREFIX_WORDS (700: 1,898 tokens on the tiny model), QUESTION_WORDS (250: about 680), OUTPUT (128 tokens), CLIENTS (16),
# PER_BURST (48), BURSTS (6).
set -euo pipefail
cd "$(dirname "$0")/../.."
engines="${1:-4}"
repeats="${2:-2}"
configs="${3:-kvgate-enforce,kvgate-off,smg-cache_aware}"
kv_tokens="${KV_TOKENS:-8192}"
runtime="${RUNTIME:-vllm}"
pace="${PACE:-llama3-8b-h100}"
# SGLang engines run at half the pace: at x 4 their steps overrun when four engines work at once.
pace_scale="${PACE_SCALE:-$([ "$runtime" = sglang ] && echo 8 || echo 4)}"
transport="${TRANSPORT:-http}"
work=target/real-engines/incident-$runtime
[ "$transport" = grpc ] && work="$work-grpc"
# The burst's requests ask for OUTPUT tokens each: kvgate assumes as much of a running request.
kvgate_toml=$(printf '[telemetry]\npoll_interval_ms = 200\nassumed_decode_tokens = %s' "${OUTPUT:-128}")
source scripts/real-engines/bench-common.sh
gauges=(--waiting "$waiting_metric" --running "$running_metric" --finished "$finished_metric")
ports=$(for i in $(seq 0 $((engines - 1))); do engine_port "$i"; done | paste -sd,)
client_python=python3
if [ "$transport" = grpc ]; then
  # GetLoads needs grpcio and the protocol's stubs, which the vLLM venv has (for either runtime).
  client_python=target/real-engines/venv/bin/python
  logs=$(for i in $(seq 0 $((engines - 1))); do echo "$run_dir/e$i.log"; done | paste -sd,)
  gauges=(--transport grpc --runtime "$runtime" --logs "$logs")
fi

results="$work/results.jsonl"
: > "$results"
rm -f "$work"/*.requests.jsonl
# One run: the incident client's bursts through the router, and the engines' counters.
bursts_once() {
  local cfg="$1" rep="$2"
  read -r hits0 queries0 < <(fleet_cache)
  preempted0=$(fleet_preemptions)
  outcome=$("$client_python" scripts/real-engines/incident-client.py --router "http://127.0.0.1:$router_port" --ports "$ports" \
    "${gauges[@]}" --prefix-words "${PREFIX_WORDS:-700}" --question-words "${QUESTION_WORDS:-250}" \
    --output "${OUTPUT:-128}" --clients "${CLIENTS:-16}" --per-burst "${PER_BURST:-48}" --bursts "${BURSTS:-6}" --seed "$rep" \
    --requests-out "$work/$cfg-$rep.requests.jsonl")
  read -r hits1 queries1 < <(fleet_cache)
  preempted1=$(fleet_preemptions)
  python3 - "$outcome" "$cfg" "$rep" "$((hits1 - hits0))" "$((queries1 - queries0))" "$preempted0" "$preempted1" >> "$results" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
hits, queries = int(sys.argv[4]), int(sys.argv[5])
r.update({"config": sys.argv[2], "round": int(sys.argv[3]), "engine_hit_rate": hits / queries if queries else None})
# Each engine's preemptions in this run (vLLM's; SGLang's retractions; absent for gRPC workers).
if sys.argv[7]:
    r["preemptions"] = [int(b) - int(a) for a, b in zip(sys.argv[6].split(), sys.argv[7].split())]
print(json.dumps(r))
PY
  tail -n 1 "$results" >&2
  if [[ "$cfg" == smg-* ]]; then
    # SMG's own account of its choices: which cache-aware branch each request took (tree_match,
    # spill, expected_wait_fallback, ...), its overload vetoes and the loads it read.
    curl -s "http://127.0.0.1:$((router_port + 1))/metrics" |
      grep -E '^smg_(cache_aware_policy_branch_total|workers_overloaded|worker_overload|engine_waiting_requests|engine_running_requests|engine_token_usage|engine_load_polls_total|worker_requests_active|cache_aware_match_ratio_(sum|count))' \
      > "$work/smg-metrics-$cfg-$rep.txt" || true
    echo "SMG's own counters: $work/smg-metrics-$cfg-$rep.txt" >&2
  fi
}
for_each_run bursts_once "$configs" "$repeats"

python3 - "$results" "$engines" "$kv_tokens" "$runtime" "$pace_label" <<'PY'
import json, statistics, sys
path, engines, kv, runtime, pace = sys.argv[1:6]
runs = [json.loads(l) for l in open(path)]
order = []
for r in runs:
    if r["config"] not in order:
        order.append(r["config"])
b = runs[0]
transport = "gRPC workers" if runs and runs[0]["engine_hit_rate"] is None else "engines"
hit = lambda r: r["engine_hit_rate"] if r["engine_hit_rate"] is not None else r["reported_hit_rate"]
print(f"the incident on {engines} real {runtime} {transport} ({kv} KV tokens each, {pace}), fresh fleet per run; "
      f"mean of {len(runs) // max(1, len(order))} interleaved runs of {b['requests']} burst requests\n")
hit_label = "hit rate (responses' usage)" if transport == "gRPC workers" else "engine hit rate"
print(f"| router | TTFT p50 / p90 / p99 (ms) | end-to-end p50 (ms) | owner's share | busiest peak queue | failures | {hit_label} |")
print("|---|---|---|---|---|---|---|")
mean = lambda xs: statistics.mean(x for x in xs if x is not None)
for c in order:
    rs = [r for r in runs if r["config"] == c]
    t = lambda p: mean(r["ttft_ms"][p] for r in rs)
    print(f"| {c} | {t('p50'):.0f} / {t('p90'):.0f} / {t('p99'):.0f} | {mean(r['e2e_ms']['p50'] for r in rs):.0f} | "
          f"{mean(r['owner_share'] for r in rs):.2f} | {mean(max(r['peak_waiting']) for r in rs):.0f} | "
          f"{sum(r['failures'] for r in rs)} | {mean(hit(r) for r in rs):.3f} |")
print("\nEach run (shares by engine, the owner first):\n")
print("| router | round | TTFT p50 / p90 / p99 | shares | peak waiting | hit rate | preemptions |")
print("|---|---|---|---|---|---|---|")
for r in runs:
    t, o = r["ttft_ms"], r["owner"]
    shares = [r["shares"][o]] + [s for i, s in enumerate(r["shares"]) if i != o]
    peaks = [r["peak_waiting"][o]] + [s for i, s in enumerate(r["peak_waiting"]) if i != o]
    pre = r.get("preemptions")
    pre = " ".join(str(x) for x in [pre[o]] + [x for i, x in enumerate(pre) if i != o]) if pre else "-"
    print(f"| {r['config']} | {r['round']} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
          f"{' '.join(f'{s:.2f}' for s in shares)} | {' '.join(f'{p:.0f}' for p in peaks)} | {hit(r):.3f} | {pre} |")
PY
