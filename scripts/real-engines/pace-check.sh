#!/usr/bin/env bash
# Whether a busy engine slows its idle neighbour: two real engines, `b` probed with cold 256-token
# prompts (16 output tokens) one after another, alone and then while 16 clients keep `a` busy with
# cold 1,000-token prompts (128 output tokens); once unpaced and once paced like a GPU
# (scripts/real-engines/pacer). Prints b's time to first token and, paced, how the steps kept time.
# Not part of CI (the suite's pacing trial checks the paced half); figures in docs/real-engines.md.
#
# Usage: scripts/real-engines/pace-check.sh [RUNTIME] [PROFILE] [SCALE]
#   RUNTIME  vllm (default) or sglang; PROFILE an engine profile (default llama3-8b-h100);
#   SCALE    wall seconds per modeled second (default 4)
set -euo pipefail
cd "$(dirname "$0")/../.."
runtime="${1:-vllm}"
profile="${2:-llama3-8b-h100}"
scale="${3:-4}"
scripts/real-engines/setup.sh
cargo build --release -p kvgate --quiet
run=target/real-engines/pace-check
mkdir -p "$run"
python=target/real-engines/venv/bin/python
base=19500
stop() { for n in a b; do scripts/real-engines/engine.sh stop "$n" "$run" || true; done; }
trap stop EXIT

probe() {
  "$python" - "$1" "$2" "$3" <<'PY'
import json, random, statistics, sys, threading, time, urllib.request
probe_port, load_port, label = sys.argv[1], sys.argv[2], sys.argv[3]
def stream(port, tokens, out):
    ids = [random.randint(10, 800) for _ in range(tokens)]
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": out, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    started, first = time.time(), None
    for line in urllib.request.urlopen(request):
        if first is None and line.startswith(b"data:"):
            first = time.time() - started
    return first * 1000
def probes():
    return sorted(stream(probe_port, 256, 16) for _ in range(20))
alone = probes()
stop = False
def load():
    while not stop:
        stream(load_port, 1000, 128)
loaders = [threading.Thread(target=load) for _ in range(16)]
for t in loaders:
    t.start()
time.sleep(3)
beside = probes()
stop = True
for t in loaders:
    t.join()
q = lambda xs, p: xs[round((len(xs) - 1) * p)]
print(f"| {label} | {statistics.median(alone):.1f} / {q(alone, 0.9):.1f} ms | {statistics.median(beside):.1f} / {q(beside, 0.9):.1f} ms |")
PY
}

echo "| engines ($runtime) | b's TTFT alone, p50 / p90 | beside a busy a, p50 / p90 |"
echo "|---|---|---|"
for mode in unpaced paced; do
  if [ "$mode" = paced ]; then
    KVGATE_PACE_PROFILE=$(target/release/kvgate profile "$profile" --compact)
    export KVGATE_PACE_PROFILE KVGATE_PACE_SCALE="$scale"
  else
    unset KVGATE_PACE_PROFILE KVGATE_PACE_SCALE
  fi
  for i in 0 1; do
    name=$([ "$i" = 0 ] && echo a || echo b)
    p=$((base + 10 * i))
    scripts/real-engines/engine.sh start "$name" "$p" "tcp://*:$((p + 1))" "$((p + 2))" 16384 "$run" "$runtime"
  done
  scripts/real-engines/engine.sh wait a "$base" 300 "$run"
  scripts/real-engines/engine.sh wait b "$((base + 10))" 300 "$run"
  label="$mode"
  [ "$mode" = paced ] && label="paced, $profile x $scale"
  probe "$((base + 10))" "$base" "$label"
  stop
done
"$python" - "$run" <<'PY'
import json, statistics, sys
for name in ("a", "b"):
    steps = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}.pace.jsonl")]
    late = sorted(s["wall_ms"] / s["target_ms"] for s in steps)
    over = sum(s["compute_ms"] > s["target_ms"] for s in steps)
    print(f"paced {name}: {len(steps)} steps, wall/target median {statistics.median(late):.3f}, "
          f"p90 {late[round(0.9 * (len(late) - 1))]:.3f}; {over} computed past their target")
PY
