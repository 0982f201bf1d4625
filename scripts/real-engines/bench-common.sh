# Shared by bench.sh and incident.sh (sourced, not run): set-up, a fresh fleet of paced (or unpaced)
# engines, a router in front of it (kvgate or SMG), and the fleet's own prefix-cache counters.
#
# The sourcing script sets: engines, kv_tokens, runtime (vllm|sglang), work (its directory under
# target/), pace (an engine profile, or `off`), pace_scale, and optionally kvgate_toml (the body of
# kvgate's configuration file) and transport (`http`, the default, or `grpc`: the engines serve SMG's
# gRPC worker protocol and both routers reach them over it, as the incident's fleet did; such
# engines serve no /metrics, so fleet_cache prints nothing to read and the callers take the hit rate
# from the responses' usage; fleet_finished counts the requests each servicer's log names, and
# sample_queues asks each worker's own GetLoads). It gets: kvgate, model, rates (the worker options kvgate is given),
# run_dir, base, router_port, pace_label, the engines' metric names (cached_metric, prompt_metric,
# waiting_metric, running_metric, finished_metric, preempted_metric), and the functions engine_port,
# start_fleet, start_router CONFIG LOG, stop_all (also run on exit), fleet_cache, fleet_finished,
# fleet_preemptions, fleet_counter, sample_queues
# and for_each_run. SMG_LOG_LEVEL in the environment sets SMG's log level (default warn; `debug`
# logs its choice of engine for each request, with that engine's in-flight count).

case "$runtime" in
  vllm)
    cached_metric=vllm:prefix_cache_hits_total; prompt_metric=vllm:prefix_cache_queries_total
    waiting_metric=vllm:num_requests_waiting; running_metric=vllm:num_requests_running
    finished_metric=vllm:request_success_total; preempted_metric=vllm:num_preemptions_total ;;
  sglang)
    cached_metric=sglang:cached_tokens_total; prompt_metric=sglang:prompt_tokens_total
    waiting_metric=sglang:num_queue_reqs; running_metric=sglang:num_running_reqs
    finished_metric=sglang:num_requests_total; preempted_metric=sglang:num_retracted_requests_total ;;
  *) echo "$0: RUNTIME must be vllm or sglang, not $runtime" >&2; exit 2 ;;
esac
run_dir="$work/run"
model="$PWD/target/real-engines/model"
mkdir -p "$work"

scripts/real-engines/setup.sh  # SMG included (install-smg.sh)
cargo build --release -p kvgate --quiet
kvgate=target/release/kvgate
if [ "$pace" = off ]; then
  # Rates measured on this machine's tiny model (docs/benchmarks.md): ~20k prefill tokens/s,
  # ~3k decode tokens/s at 16 streams.
  rates="prefill_tokens_per_s=20000,decode_tokens_per_s=3000"
  unset KVGATE_PACE_PROFILE
  pace_label="unpaced"
else
  KVGATE_PACE_PROFILE=$("$kvgate" profile "$pace" --compact)
  export KVGATE_PACE_PROFILE KVGATE_PACE_SCALE="$pace_scale"
  rates=$("$kvgate" profile "$pace" --scale "$pace_scale" --compact | python3 -c '
import json, sys
p = json.load(sys.stdin)["paced"]
print("prefill_tokens_per_s=%.0f,decode_tokens_per_s=%.0f" % (p["prefill_tokens_per_s"], p["decode_tokens_per_s"]))')
  pace_label="paced as $pace x $pace_scale"
fi

base=19000
engine_port() { echo $((base + 10 * $1)); }
router_port=$((base + 900))
pids=()
stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  for i in $(seq 0 $((engines - 1))); do scripts/real-engines/engine.sh stop "e$i" "$run_dir" || true; done
}
trap stop_all EXIT

start_fleet() {
  for i in $(seq 0 $((engines - 1))); do
    p=$(engine_port "$i")
    scripts/real-engines/engine.sh start "e$i" "$p" "tcp://*:$((p + 1))" "$((p + 2))" "$kv_tokens" "$run_dir" \
      "$runtime" "${transport:-http}"
  done
  for i in $(seq 0 $((engines - 1))); do
    scripts/real-engines/engine.sh wait "e$i" "$(engine_port "$i")" 300 "$run_dir"
  done
}

start_router() {
  local cfg="$1" log="$2"
  local urls=() workers=()
  local smg_grpc=()
  for i in $(seq 0 $((engines - 1))); do
    p=$(engine_port "$i")
    if [ "${transport:-http}" = grpc ]; then
      # As an SMG user writes them: the URL alone (runtime, KV events and load come over the worker's
      # own protocol). SMG in gRPC mode needs the model's tokenizer and the engines' block size.
      urls+=("grpc://127.0.0.1:$p")
      workers+=(--worker "grpc://127.0.0.1:$p,id=e$i,$rates")
      smg_grpc=(--block-size 32 --model-path "$model" --tokenizer-path "$model")
    else
      urls+=("http://127.0.0.1:$p")
      workers+=(--worker "http://127.0.0.1:$p,id=e$i,engine=$runtime,kv_events=:$((p + 1)),replay=:$((p + 2)),$rates")
    fi
  done
  case "$cfg" in
    kvgate-*)
      printf '%s\n' "${kvgate_toml:-}" > "$work/kvgate.toml"
      "$kvgate" serve --config "$work/kvgate.toml" --host 127.0.0.1 --port "$router_port" --block-size 32 \
        --tokenizer "$model/tokenizer.json" --policy projected --mode "${cfg#kvgate-}" --admission-wait-s 0 \
        "${workers[@]}" > "$log" 2>&1 &
      ;;
    smg-cache_aware-unguarded)
      # SMG 1.13's cache_aware with the two guards 1.13 ships against a hot owner switched off: the
      # spill gate (its margin capped at the pool's natural swing, so a 4-engine pool spills at a
      # few requests over the mean) made unreachable, and worker overload protection (a worker
      # with 8 waiting requests left out) disabled. What is left is the policy that pins a
      # matched prefix to its owner, as the incident's fleet saw it.
      target/smg-venv/bin/smg launch --host 127.0.0.1 --port "$router_port" --prometheus-port $((router_port + 1)) \
        --worker-urls "${urls[@]}" --policy cache_aware --balance-rel-threshold 1000000 \
        --disable-worker-overload-protection "${smg_grpc[@]}" --log-level "${SMG_LOG_LEVEL:-warn}" > "$log" 2>&1 &
      ;;
    smg-*)
      target/smg-venv/bin/smg launch --host 127.0.0.1 --port "$router_port" --prometheus-port $((router_port + 1)) \
        --worker-urls "${urls[@]}" --policy "${cfg#smg-}" "${smg_grpc[@]}" --log-level "${SMG_LOG_LEVEL:-warn}" > "$log" 2>&1 &
      ;;
    *) echo "$0: unknown config $cfg" >&2; exit 2 ;;
  esac
  pids+=($!)
  local body='{"model":"tiny","messages":[{"role":"user","content":"warm"}],"max_tokens":1}'
  for _ in $(seq 1 120); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' -m 5 -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$router_port/v1/chat/completions")" = 200 ]; then
      return 0
    fi
    sleep 0.5
  done
  echo "$0: $cfg did not answer; see $log" >&2
  exit 1
}

# The fleet's prefix-cache hits and lookups so far, by the engines' own counters: "HITS QUERIES"
# ("0 0" for gRPC workers, which serve no /metrics).
fleet_cache() {
  if [ "${transport:-http}" = grpc ]; then echo "0 0"; return; fi
  python3 - "$engines" "$base" "$cached_metric" "$prompt_metric" <<'PY'
import sys, urllib.request
n, base, cached, prompt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
hits = queries = 0.0
for i in range(n):
    text = urllib.request.urlopen(f"http://127.0.0.1:{base + 10 * i}/metrics").read().decode()
    for line in text.splitlines():
        # Series only (`name{labels} value` or `name value`), summed over their labels.
        if line.startswith(cached + "{") or line.startswith(cached + " "):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith(prompt + "{") or line.startswith(prompt + " "):
            queries += float(line.rsplit(" ", 1)[1])
print(f"{hits:.0f} {queries:.0f}")
PY
}

# Each engine's finished requests so far, by its own counter, space-separated. gRPC workers: the
# requests their servicers' logs name as received (the same once the fleet is idle).
fleet_finished() {
  if [ "${transport:-http}" = grpc ]; then
    grpc_gauges finished "$engines" "$base" "$runtime" "$run_dir"
    return
  fi
  fleet_counter "$finished_metric"
}

# Each engine's running requests preempted so far (sent back to its queue, out of KV: vLLM's
# preemptions, SGLang's retractions), by its own counter, space-separated; nothing for gRPC workers.
fleet_preemptions() {
  [ "${transport:-http}" = http ] && [ -n "$preempted_metric" ] || return 0
  fleet_counter "$preempted_metric"
}

# Each engine's value of the counter NAME (its series summed over their labels), space-separated.
fleet_counter() {
  python3 - "$engines" "$base" "$1" <<'PY'
import sys, urllib.request
n, base, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = []
for i in range(n):
    text = urllib.request.urlopen(f"http://127.0.0.1:{base + 10 * i}/metrics").read().decode()
    out.append(sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " ")))
print(" ".join(f"{v:.0f}" for v in out))
PY
}

# Samples every engine's waiting queue every 200 ms into FILE (a JSON line a sample: seconds since
# the start and the queues) until killed; run it in the background. `exec`, so that the pid `$!`
# gives is python's own: killing a background subshell would leave its python child polling on.
sample_queues() {
  if [ "${transport:-http}" = grpc ]; then
    exec_grpc_gauges=1 grpc_gauges sample "$engines" "$base" "$runtime" "$run_dir" "$1"
  fi
  exec python3 - "$engines" "$base" "$waiting_metric" "$1" <<'PY'
import json, sys, time, urllib.request
n, base, name, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
start = time.time()
with open(path, "w", buffering=1) as out:
    while True:
        queues = []
        for i in range(n):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{base + 10 * i}/metrics", timeout=2).read().decode()
                queues.append(sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " ")))
            except OSError:
                queues.append(None)
        out.write(json.dumps([round(time.time() - start, 2), queues]) + "\n")
        time.sleep(0.2)
PY
}

# gRPC workers read as incident-client.py reads them (GetLoads, servicer logs), with the vLLM venv's
# python, which has grpcio and the protocol's stubs (for either runtime): `finished` prints each
# worker's received requests; `sample` writes each worker's waiting queue every 200 ms to FILE, as
# sample_queues does, until killed (with exec_grpc_gauges set, it replaces the shell).
grpc_gauges() {
  local run=(target/real-engines/venv/bin/python - "$@")
  [ -n "${exec_grpc_gauges:-}" ] && run=(exec "${run[@]}")
  "${run[@]}" <<'PY'
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("incident_client", "scripts/real-engines/incident-client.py")
client = importlib.util.module_from_spec(spec)
spec.loader.exec_module(client)
what, n, base, runtime, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
workers = client.GrpcEngines([base + 10 * i for i in range(n)], runtime, [f"{run_dir}/e{i}.log" for i in range(n)])
if what == "finished":
    print(" ".join(f"{workers.finished(i):.0f}" for i in range(n)))
    sys.exit(0)
start = time.time()
with open(sys.argv[6], "w", buffering=1) as out:
    while True:
        queues = []
        for i in range(n):
            try:
                queues.append(workers.waiting(i))
            except Exception:
                queues.append(None)
        out.write(json.dumps([round(time.time() - start, 2), queues]) + "\n")
        time.sleep(0.2)
PY
}

# Keeps the run's pacer logs (each paced step's target and wall time) in DIR, since the next run's
# fresh fleet starts them anew, and says how well each engine's busy steps kept to their target.
keep_pace_logs() {
  local dir="$1"
  compgen -G "$run_dir/e*.pace.jsonl" > /dev/null || return 0
  rm -rf "$dir" && mkdir -p "$dir" && cp "$run_dir"/e*.pace.jsonl "$dir"/
  python3 - "$dir" <<'PY' >&2 || true
import glob, json, os, statistics, sys
parts = []
over = lambda s: s["wall_ms"] > 1.05 * s["target_ms"]
# The steps that release a first token set the TTFTs; a whole run's share of late steps hides them
# (4-6% of all busy steps against 52-58% of these, on a slow machine).
firsts, firsts_late = 0, 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "e*.pace.jsonl"))):
    steps = [json.loads(line) for line in open(path)]
    busy = [s for s in steps if s["decode_seqs"] > 0 or s["prefill_tokens"] > 1]
    if busy:
        late = sum(map(over, busy)) / len(busy)
        compute = statistics.median(s["compute_ms"] / s["target_ms"] for s in busy)
        first = [s for s in busy if s.get("first_tokens")]
        firsts += len(first)
        firsts_late += sum(map(over, first))
        parts.append(f"{os.path.basename(path).split('.')[0]} {len(busy)} busy steps, {late:.0%} over by >5%, own compute {compute:.0%} of the step")
print("  pacing: " + ("; ".join(parts) if parts else "no busy steps"))
if firsts:
    share = firsts_late / firsts
    print(f"  steps that release a first token: {firsts}, {share:.0%} over by >5%")
    if share > 0.10:
        print("  WARNING: the CPU, not the router, set part of this run's TTFTs: its engines' own compute "
              "outlasted the steps that release first tokens. A larger PACE_SCALE (docs/real-engines.md) keeps them on time.")
PY
}

# Runs `FN CONFIG ROUND` for each of CONFIGS (comma-separated) in each of REPEATS rounds, each round
# in a rotated order, every run on a freshly started fleet (cold caches) behind its router.
for_each_run() {
  local fn="$1" configs="$2" repeats="$3" list n k rep cfg
  IFS=',' read -r -a list <<< "$configs"
  n=${#list[@]}
  for rep in $(seq 1 "$repeats"); do
    for k in $(seq 0 $((n - 1))); do
      cfg=${list[$(((k + rep - 1) % n))]}
      echo "[round $rep] $cfg: fresh fleet of $engines engines" >&2
      start_fleet
      start_router "$cfg" "$work/$cfg-$rep.router.log"
      "$fn" "$cfg" "$rep"
      # kvgate's decision log of the run (scores per engine), for reading why it routed as it did.
      case "$cfg" in
        kvgate-*) curl -s -m 10 "http://127.0.0.1:$router_port/admin/decisions?limit=1000" > "$work/$cfg-$rep.decisions.json" || true ;;
      esac
      keep_pace_logs "$work/$cfg-$rep.pace"
      stop_all
    done
  done
}
