#!/usr/bin/env bash
# End-to-end benchmark with a real client: NVIDIA's aiperf (from PyPI, in a virtual environment)
# replays a slice of the Mooncake conversation trace through `kvgate serve` in front of `kvgate
# mock-engine` processes on loopback, once per mode, and prints TTFT and throughput per mode.
# Not part of CI. Needs python3, pip access to PyPI, and ../shared/data.
#
# Usage: scripts/bench-e2e.sh [ROWS] [ENGINES] [TRACE_SPEEDUP]   (defaults: 300 8 10)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-300}"
engines="${2:-8}"
trace_speedup="${3:-10}"
trace=../shared/data/traces/mooncake_conversation_trace.jsonl
export TIKTOKEN_CACHE_DIR="$PWD/../shared/data/tokenizers/tiktoken_cache"
work=target/bench-e2e
venv=target/bench-venv
mkdir -p "$work"

if [ ! -x "$venv/bin/aiperf" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "aiperf==0.13.0"
fi
cargo build --release -p kvgate --quiet
kvgate=target/release/kvgate

# The slice, with timestamps compressed so the fleet is busy.
python3 - "$trace" "$rows" "$trace_speedup" > "$work/slice.jsonl" <<'PY'
import json, sys
path, rows, speedup = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(path) as f:
    for i, line in enumerate(f):
        if i >= rows:
            break
        r = json.loads(line)
        r["timestamp"] = int(r["timestamp"] / speedup)
        print(json.dumps(r))
PY

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

base=18000
printf "| mode | requests | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | request/s |\n|---|---|---|---|---|---|\n"
for mode in off shadow enforce; do
  # Fresh engines for every mode: each starts with cold caches and the same arrivals.
  engine_pids=()
  for i in $(seq 0 $((engines - 1))); do
    "$kvgate" mock-engine --port $((base + i)) --kv-port $((base + 100 + i)) --replay-port $((base + 200 + i)) \
      --speedup 4 --seed $((i + 1)) > "$work/engine-$mode-$i.log" 2>&1 &
    engine_pids+=($!)
    pids+=($!)
  done
  sleep 1
  {
    printf '[server]\nhost = "127.0.0.1"\nport = %d\n[policy]\nname = "projected"\nmode = "%s"\n[telemetry]\npoll_interval_ms = 200\n' $((base + 500)) "$mode"
    for i in $(seq 0 $((engines - 1))); do
      printf '[[workers]]\nid = "e%d"\nurl = "http://127.0.0.1:%d"\nengine = "sglang"\nkv_events = "tcp://127.0.0.1:%d"\nreplay = "tcp://127.0.0.1:%d"\nprefill_tokens_per_s = 140000\ndecode_tokens_per_s = 16000\nkv_capacity_tokens = 400000\n' \
        "$i" $((base + i)) $((base + 100 + i)) $((base + 200 + i))
    done
  } > "$work/kvgate-$mode.toml"
  "$kvgate" serve --config "$work/kvgate-$mode.toml" > "$work/kvgate-$mode.log" 2>&1 &
  gw=$!
  sleep 1
  rm -rf "$work/aiperf-$mode"
  "$venv/bin/aiperf" profile --model mock-model --tokenizer builtin --endpoint-type chat --streaming \
    --url "http://127.0.0.1:$((base + 500))" --custom-dataset-type mooncake_trace --input-file "$work/slice.jsonl" \
    --fixed-schedule --no-server-metrics --ui none --output-artifact-dir "$work/aiperf-$mode" > "$work/aiperf-$mode.log" 2>&1 \
    || { echo "aiperf failed for $mode; see $work/aiperf-$mode.log" >&2; kill "$gw"; exit 1; }
  kill "$gw" "${engine_pids[@]}"; wait "$gw" "${engine_pids[@]}" 2>/dev/null || true
  python3 - "$work/aiperf-$mode" "$mode" <<'PY'
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/**/*aiperf*.json", recursive=True)
data = json.load(open(sorted(files)[0]))
m = data.get("records", data)
def get(name, stat):
    v = m.get(name, {})
    return v.get(stat) if isinstance(v, dict) else None
ttft50, ttft99 = get("time_to_first_token", "p50"), get("time_to_first_token", "p99")
out, rps = get("output_token_throughput", "avg"), get("request_throughput", "avg")
count = get("request_count", "avg")
fmt = lambda v: "n/a" if v is None else f"{v:.1f}"
print(f"| {sys.argv[2]} | {fmt(count)} | {fmt(ttft50)} | {fmt(ttft99)} | {fmt(out)} | {fmt(rps)} |")
PY
done
