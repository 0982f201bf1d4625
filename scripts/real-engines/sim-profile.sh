#!/usr/bin/env bash
# The engine profile `kvgate sim` needs to model a paced real fleet: PACE's step costs times SCALE
# and its prefill rate over SCALE (as the pacer paces the engines), with the engines' own step
# budget, batch limit, KV size and block size, and SGLang's scheduling as the engines run it
# (prefill steps on their own: no --enable-mixed-chunk). With PACE_LOGS (a bench's or incident's
# work directory), the engines' gap between steps is read from the pacer logs it kept
# (`*.pace/e*.pace.jsonl`): the median and 90th percentile of each busy step's wall time beyond
# its target; and their intake (from the API server taking a request, before rendering and
# tokenizing it, to the scheduler being able to queue it), a lognormal fitted to the interval each
# request's intake is bound to by its stamps and the steps around them
# (`fidelity_common.intake_intervals`; none, with a warning, from logs an older pacer wrote without
# the stamps); and, where the client kept its records (the incident's), the way from the client to
# the engine and back (`dispatch`, `delivery`): the median and 90th percentile of each request's
# time from leaving the client to its engine's API server, and from the step releasing its first
# token to the client (`fidelity_common.ttft_parts`). Prints the profile as JSON, for `kvgate sim --profile`. Used by fidelity.sh and
# incident-fidelity.sh.
#
# Usage: scripts/real-engines/sim-profile.sh RUNTIME PACE SCALE KV_TOKENS BLOCK [PACE_LOGS]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 5 ] || [ $# -eq 6 ] || { echo "usage: $0 RUNTIME PACE SCALE KV_TOKENS BLOCK [PACE_LOGS]" >&2; exit 2; }
runtime="$1" pace="$2" scale="$3" kv_tokens="$4" block="$5" pace_logs="${6:-}"
if [ -n "$pace_logs" ] && ! compgen -G "$pace_logs/*.pace/e*.pace.jsonl" > /dev/null; then
  echo "sim-profile.sh: no pacer logs (*.pace/e*.pace.jsonl) in $pace_logs" >&2
  exit 1
fi
# The engines as they run: vLLM's CPU server steps at most 2,048 tokens and runs 256 sequences;
# SGLang's CPU engine chunks prefill at 4,096 and runs up to 2,048 (both logged at start).
case "$runtime" in
  vllm) budget=2048; max_running=256 ;;
  sglang) budget=4096; max_running=2048 ;;
  *) echo "sim-profile.sh: RUNTIME must be vllm or sglang" >&2; exit 2 ;;
esac
[ -x target/release/kvgate ] || cargo build --release -p kvgate --quiet
target/release/kvgate profile "$pace" --compact | python3 -c '
import glob, json, sys
sys.path.insert(0, "scripts/real-engines")
from fidelity_common import fit_lognormal, intake_intervals, quantile, runs_ttft_parts, step_gaps
scale, budget, running, kv, block, runtime, logs = float(sys.argv[1]), *map(int, sys.argv[2:6]), *sys.argv[6:8]
p = json.load(sys.stdin)
for k in ("step_base_ms", "per_seq_ms", "per_kilo_context_ms"):
    p[k] *= scale
p["prefill_tokens_per_s"] /= scale
name = p["name"]
p.update(name=f"{name} x {scale:g}, as the paced {runtime} fleet", chunk_budget=budget, max_running=running,
         kv_capacity_tokens=kv, block_size=block, flavor=runtime)
if runtime == "sglang":
    p["mixed_chunk"] = False
if logs:
    paths = sorted(glob.glob(f"{logs}/*.pace/e*.pace.jsonl"))
    gaps = step_gaps(paths)
    if not gaps:
        sys.exit(f"sim-profile.sh: the pacer logs in {logs} have no busy steps")
    median, p90 = quantile(gaps, 0.5), quantile(gaps, 0.9)
    p["step_gap"] = {"median_ms": round(max(median, 0.0), 3), "p90_ms": round(max(p90, median, 0.0), 3)}
    intake = fit_lognormal(intake_intervals(paths))
    if intake is None:
        print(f"sim-profile.sh: the pacer logs in {logs} have no request with its arrival and queueing stamps "
              "(an older pacer wrote them): the profile has no intake", file=sys.stderr)
    else:
        p["intake"] = {"median_ms": round(intake[0], 3), "p90_ms": round(intake[1], 3)}
    parts, _ = runs_ttft_parts(logs)
    if not parts:
        print(f"sim-profile.sh: no client records in {logs} join its pacer logs (an aiperf run, or an older "
              "pacer or client): the profile has no dispatch or delivery", file=sys.stderr)
    for field, part in (("dispatch", "to_engine"), ("delivery", "delivery")):
        values = [max(x[part], 0.0) for x in parts]
        if values:
            median, p90 = quantile(values, 0.5), quantile(values, 0.9)
            p[field] = {"median_ms": round(median, 3), "p90_ms": round(max(p90, median), 3)}
print(json.dumps(p))' "$scale" "$budget" "$max_running" "$kv_tokens" "$block" "$runtime" "$pace_logs"
