#!/usr/bin/env bash
# The simulator held against a paced real fleet on the incident's bursts. incident.sh sends the
# bursts (a hot prefix one engine owns, then bursts of requests sharing it from closed-loop clients)
# through kvgate `enforce`, kvgate `off`, SMG 1.13 `cache_aware` as shipped and SMG with its guards
# off; then `kvgate sim --scenario incident-bursts` sends the same requests (the
# prefix's and the questions' token counts measured on the model's tokenizer, the same clients,
# bursts and output) to engine models configured as that fleet (sim-profile.sh) under
# `projected:enforce`, `projected:off`, `smg_cache_aware_http` (SMG 1.13 as it runs over HTTP
# engines: its own tree of what it sent, guards on) and `cache_aware` (guards off), with the bench's
# router settings. Prints
# both side by side: TTFT p50/p90/p99, end-to-end p50, the engines' hit rate, each engine's share,
# peak waiting queue and preemptions (the owner first), with the simulator's error; then TTFT p50
# and p90 by wave (each client's k-th request of a burst) from the client's and the simulator's
# per-request records, the share of requests over 2 s, and each request's time from its first to
# its last token (p10 / p50 / p90); then, from the real engines' pacer logs and the client's send
# times, where each burst's spread starts (when the engines queue its first wave, when each
# engine's first step begins and how many requests it runs); then, joining the client's records to
# the pacer logs by request id, where each real request's TTFT goes (to the engine, intake, wait
# for a step, prefill, delivery, and how much of the prefill its steps ran past their targets),
# and by wave each TTFT before and after the step that first runs it, real (and real with its steps
# on time) against the simulator's. Not part of CI; results go in docs/simulator-fidelity.md.
#
# Usage: scripts/real-engines/incident-fidelity.sh [ENGINES] [REPEATS] [CONFIGS]
#   as incident.sh (defaults 4, 1; CONFIGS of kvgate-enforce, kvgate-off, smg-cache_aware and
#   smg-cache_aware-unguarded, default all four), with its environment (RUNTIME, PACE, PACE_SCALE, KV_TOKENS,
#   PREFIX_WORDS, QUESTION_WORDS, OUTPUT, CLIENTS, PER_BURST, BURSTS; HTTP engines only).
#   SIM_ONLY=1 reuses the last real run's results.
set -euo pipefail
cd "$(dirname "$0")/../.."
engines="${1:-4}"
repeats="${2:-1}"
configs="${3:-kvgate-enforce,kvgate-off,smg-cache_aware,smg-cache_aware-unguarded}"
runtime="${RUNTIME:-vllm}"
pace="${PACE:-llama3-8b-h100}"
# SGLang engines run at half the pace: at x 4 their steps overrun when four engines work at once.
scale="${PACE_SCALE:-$([ "$runtime" = sglang ] && echo 8 || echo 4)}"
kv_tokens="${KV_TOKENS:-8192}"
output="${OUTPUT:-128}"
[ "${TRANSPORT:-http}" = http ] || { echo "incident-fidelity.sh: HTTP engines only (TRANSPORT=http)" >&2; exit 2; }
[ "$pace" != off ] || { echo "incident-fidelity.sh: the simulator models paced engines; PACE=off has nothing to compare" >&2; exit 2; }
work=target/real-engines/incident-$runtime
if [ -z "${SIM_ONLY:-}" ]; then
  scripts/real-engines/incident.sh "$engines" "$repeats" "$configs"
fi
[ -f "$work/results.jsonl" ] || { echo "incident-fidelity.sh: no incident results in $work" >&2; exit 1; }
cargo build --release -p kvgate --quiet
scripts/real-engines/sim-profile.sh "$runtime" "$pace" "$scale" "$kv_tokens" 32 "$work" > "$work/sim-profile.json"

# The requests' token counts on the model's tokenizer: the prefix every request shares (with the
# words of "question" each one goes on with) and the mean of each one's own rest, as the client
# (seed 1, the first round's) writes them.
read -r prefix_tokens question_tokens < <(HF_HUB_OFFLINE=1 target/real-engines/venv/bin/python - \
  "${PREFIX_WORDS:-700}" "${QUESTION_WORDS:-250}" "${PER_BURST:-48}" "${BURSTS:-6}" <<'PY'
import importlib.util, random, statistics, sys
from transformers import AutoTokenizer
prefix_words, question_words, per_burst, bursts = map(int, sys.argv[1:5])
spec = importlib.util.spec_from_file_location("client", "scripts/real-engines/incident-client.py")
client = importlib.util.module_from_spec(spec)
spec.loader.exec_module(client)
tok = AutoTokenizer.from_pretrained("target/real-engines/model")
ids = lambda s: tok(s)["input_ids"]
rng = random.Random(1)
prefix = "[hot system prompt] " + client.text(rng, prefix_words) + "\n"
prompts = []
for b in range(bursts):
    questions = [client.text(rng, question_words) for _ in range(per_burst)]
    prompts += [ids(prefix + f"question {b}.{j}: " + questions[j]) for j in range(per_burst)]
shared = min(next((i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y), len(p)) for p in prompts[1:])
print(shared, round(statistics.mean(len(p) for p in prompts)) - shared)
PY
)
target/release/kvgate sim --scenario incident-bursts --workers "$engines" --profile "$work/sim-profile.json" \
  --prefix-tokens "$prefix_tokens" --question-tokens "$question_tokens" --output-tokens "$output" \
  --clients "${CLIENTS:-16}" --per-burst "${PER_BURST:-48}" --bursts "${BURSTS:-6}" \
  --compare projected:enforce,projected:off,smg_cache_aware_http,cache_aware --assumed-decode-tokens "$output" --poll-ms 200 \
  --admission-wait-s 0 --format json --per-request > "$work/sim.json"

python3 - "$work/results.jsonl" "$work/sim.json" "$engines" "$runtime" "$pace" "$scale" "$prefix_tokens" "$question_tokens" \
  "$work" "${CLIENTS:-16}" "${PER_BURST:-48}" <<'PY'
import glob, json, sys
sys.path.insert(0, "scripts/real-engines")
from fidelity_common import TTFT_PARTS, error, intake_delays, latencies, mean, pairs, quantile, run_records, runs_count, runs_ttft_parts
results, sim_path, engines, runtime, pace, scale, prefix_tokens, question_tokens, work = sys.argv[1:10]
clients, per_burst = int(sys.argv[10]), int(sys.argv[11])
names = [("kvgate-enforce", "projected:enforce"), ("kvgate-off", "projected:off"),
         ("smg-cache_aware", "smg_cache_aware_http"), ("smg-cache_aware-unguarded", "cache_aware")]
owner_first = lambda xs, owner: [xs[owner]] + [x for i, x in enumerate(xs) if i != owner]
print(f"the incident's bursts on {engines} {runtime} engines paced as {pace} x {scale} (prefix {prefix_tokens} "
      f"tokens, questions {question_tokens}): real (mean of {runs_count(results)} runs) against kvgate sim; "
      f"error = sim / real - 1\n")
print("| router | | TTFT p50 (ms) | p90 | p99 | e2e p50 (ms) | hit rate | shares, owner first | peak waiting, owner first | preemptions, owner first |")
print("|---|---|---|---|---|---|---|---|---|---|")
fmt = lambda xs, f="{:.2f}": " ".join(f.format(x) for x in xs)
n = int(engines)
for real_name, sim_name, found in pairs(results, sim_path, names):
    if found is None:
        print(f"| {real_name} | missing | | | | | | | | |")
        continue
    rs, s = found
    rl, sl = latencies(rs, s)
    rhit, shit = mean(r["engine_hit_rate"] for r in rs), s["cache"]["hit_rate"]
    rshare = [mean(owner_first(r["shares"], r["owner"])[i] for r in rs) for i in range(n)]
    rpeak = [mean(owner_first(r["peak_waiting"], r["owner"])[i] for r in rs) for i in range(n)]
    owner = int(s["hot_prefix"]["owner"].lstrip("w")) if s["hot_prefix"].get("owner") else 0
    total = max(1, sum(w["requests"] for w in s["workers"]))
    sshare = owner_first([w["requests"] / total for w in s["workers"]], owner)
    speak = owner_first([w["max_waiting"] for w in s["workers"]], owner)
    # Preemptions: vLLM's counter (SGLang's retractions), the model's own.
    rpre = (fmt([mean(owner_first(r["preemptions"], r["owner"])[i] for r in rs) for i in range(n)], "{:.0f}")
            if all(r.get("preemptions") for r in rs) else "-")
    spre = fmt(owner_first([w.get("preemptions", 0) for w in s["workers"]], owner), "{:.0f}")
    print(f"| {real_name} | real | {' | '.join(f'{x:.0f}' for x in rl)} | {rhit:.3f} | {fmt(rshare)} | {fmt(rpeak, '{:.0f}')} | {rpre} |")
    print(f"| {sim_name} | sim | {' | '.join(f'{x:.0f}' for x in sl)} | {shit:.3f} | {fmt(sshare)} | {fmt(speak, '{:.0f}')} | {spre} |")
    share_pts = max(abs(a - b) for a, b in zip(rshare, sshare)) * 100
    print(f"| | error | {' | '.join(error(a, b) for a, b in zip(rl, sl))} | {shit - rhit:+.3f} | {share_pts:.0f} points at most | | |")

# The same TTFTs by wave: a burst's first `clients` requests leave together, each later one when its
# client's previous answer is complete (from the client's and the simulator's per-request records).
waves = (per_burst + clients - 1) // clients
print("\nTTFT by wave (wave k: each client's request k of a burst), p50 / p90 in ms, real (all runs' requests) "
      "against sim; and the share of requests whose TTFT is over 2 s\n")
print("| router | " + " | ".join(f"wave {k}" for k in range(waves)) + " | over 2 s | first to last token p10 / p50 / p90 (ms) |")
print("|---|" + "---|" * (waves + 2))
for real_name, sim_name, found in pairs(results, sim_path, names):
    files = run_records(work, real_name)
    if not files or found is None:
        continue
    real = [json.loads(line) for f in files for line in open(f)]
    real_by = [[r["ttft_s"] for r in real if r["index"] // clients == k and r["ttft_s"] is not None] for k in range(waves)]
    rows = found[1].get("per_request", [])
    # The simulator numbers requests over the whole run, from the warm-up at 0; the client within a burst.
    sim_by = [[r["ttft_s"] for r in rows if (r["index"] - 1) % per_burst // clients == k and r["ttft_s"] is not None]
              for k in range(waves)]
    cells = []
    for rb, sb in zip(real_by, sim_by):
        rp, sp = [quantile(rb, q) * 1000 for q in (0.5, 0.9)], [quantile(sb, q) * 1000 for q in (0.5, 0.9)]
        cells.append(f"{rp[0]:.0f} / {rp[1]:.0f} real, {sp[0]:.0f} / {sp[1]:.0f} sim ({error(rp[0], sp[0])} / {error(rp[1], sp[1])})")
    slow = lambda xs: sum(x > 2 for x in xs) / max(1, len(xs))
    all_real = [x for b in real_by for x in b]
    all_sim = [x for b in sim_by for x in b]
    # The decode's own spread: requests that share an engine's steps drift apart only through it.
    decode = lambda xs: " / ".join(f"{quantile(xs, q) * 1000:.0f}" for q in (0.1, 0.5, 0.9))
    real_decode = [r["e2e_s"] - r["ttft_s"] for r in real if r["ttft_s"] is not None and r["e2e_s"] is not None]
    sim_decode = [r["e2e_s"] - r["ttft_s"] for r in rows if r["ttft_s"] is not None and r["e2e_s"] is not None]
    print(f"| {real_name} | " + " | ".join(cells) + f" | {slow(all_real):.1%} real, {slow(all_sim):.1%} sim"
          f" | {decode(real_decode)} real, {decode(sim_decode)} sim |")

# Where a burst's spread starts: from the pacer logs (each step's start, the requests it first ran
# and when the engine queued each) and the client's send times.
print("\nA burst's first steps, real (ms from the burst's first request leaving; p10 / p50 / p90)\n")
print("| router | engines queue wave 0 | each engine's first step begins | after its first request was queued | "
      "engines' first steps apart | requests in a first step (1 / 2 / 3+) |")
print("|---|---|---|---|---|---|")
for real_name, _, _ in pairs(results, sim_path, names):
    paces = sorted(glob.glob(f"{work}/{real_name}-1.pace/e*.pace.jsonl"))
    sends = f"{work}/{real_name}-1.requests.jsonl"
    if not paces or not glob.glob(sends):
        continue
    d = intake_delays(paces, sends, clients)
    if not d["first_step_after_send"]:
        print(f"| {real_name} | no queueing stamps in its pacer logs or send times in its records | | | | |")
        continue
    q3 = lambda xs: " / ".join(f"{quantile(xs, q):.0f}" for q in (0.1, 0.5, 0.9))
    counts = d["first_step_requests"]
    print(f"| {real_name} | {q3(d['wave0_queued_after_send'])} | {q3(d['first_step_after_send'])} | "
          f"{q3(d['first_step_after_queued'])} | {q3(d['first_step_spread'])} | "
          f"{sum(c == 1 for c in counts)} / {sum(c == 2 for c in counts)} / {sum(c >= 3 for c in counts)} |")

# Where a request's TTFT goes, real: each part's p50 / p90 over the requests the pacer logs name
# (fidelity_common.ttft_parts). The simulator models to_engine and delivery as the profile's
# dispatch and delivery, fitted to these (sim-profile.sh).
print("\nWhere a request's TTFT goes, real (ms, p50 / p90 of each part; the parts' p50s need not add up to the TTFT's)\n")
q2 = lambda xs: f"{quantile(xs, 0.5):.0f} / {quantile(xs, 0.9):.0f}"
print("| router | requests | " + " | ".join(TTFT_PARTS) + " | TTFT | prefill's steps past their targets |")
print("|---|---|" + "---|" * (len(TTFT_PARTS) + 2))
for real_name, _, _ in pairs(results, sim_path, names):
    parts, total = runs_ttft_parts(work, real_name)
    if not parts:
        print(f"| {real_name} | 0 of {total}: no request ids in its pacer logs or records | " + " | " * (len(TTFT_PARTS) + 1))
        continue
    ttft = [sum(p[k] for k in TTFT_PARTS) for p in parts]
    print(f"| {real_name} | {len(parts)} of {total} | " + " | ".join(q2([p[k] for p in parts]) for k in TTFT_PARTS)
          + f" | {q2(ttft)} | {q2([p['late'] for p in parts])} |")

# The same TTFTs cut where the step that first runs the request begins: before it (the way to the
# engine, the intake, the queue) and after it (the prefill steps, the first token's delivery), by
# wave, real against the simulator's per-request records; the real "after" also less its steps'
# time past their targets (the model's steps keep time).
print(f"\nTTFT before and after the step that first runs the request, by wave: p50 / p90 in ms, real against sim\n")
print("| router | " + " | ".join(f"wave {k} before | after" for k in range(waves)) + " |")
print("|---|" + "---|---|" * waves)
for real_name, sim_name, found in pairs(results, sim_path, names):
    parts, _ = runs_ttft_parts(work, real_name)
    rows = found[1].get("per_request", []) if found else []
    if not parts or not rows:
        continue
    cells = []
    for k in range(waves):
        real_k = [p for p in parts if p["index"] // clients == k]
        sim_k = [r for r in rows if (r["index"] - 1) % per_burst // clients == k
                 and r.get("first_step_s") is not None and r["ttft_s"] is not None]
        before = [p["to_engine"] + p["intake"] + p["queue"] for p in real_k]
        after = [p["prefill"] + p["delivery"] for p in real_k]
        on_time = [p["prefill"] - p["late"] + p["delivery"] for p in real_k]
        sim_before = [r["first_step_s"] * 1000 for r in sim_k]
        sim_after = [(r["ttft_s"] - r["first_step_s"]) * 1000 for r in sim_k]
        cells.append(f"{q2(before)} real, {q2(sim_before)} sim")
        cells.append(f"{q2(after)} real ({q2(on_time)} with its steps on time), {q2(sim_after)} sim")
    print(f"| {real_name} | " + " | ".join(cells) + " |")
PY
