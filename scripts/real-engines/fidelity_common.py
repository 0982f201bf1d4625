"""What fidelity.sh and incident-fidelity.sh share: a real run's results against `kvgate sim`'s, each
real router paired with the simulator's model of it, and the latency columns both tables print."""

import collections
import glob
import json
import math
import os
import statistics


def mean(xs):
    """The mean of the values that are there (NaN when none is)."""
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")


def error(real, sim):
    """The simulator's error, sim / real - 1, as a signed percentage."""
    return f"{sim / real - 1:+.0%}" if real else "n/a"


def pairs(results_path, sim_path, names):
    """For each (real config, sim policy) of `names`: the real runs and the simulated run, or None
    where either is missing."""
    real = [json.loads(line) for line in open(results_path)]
    runs = json.load(open(sim_path))["runs"]
    sim = {f"{r['policy']}:{r['mode']}" if r.get("mode") else r["policy"]: r for r in runs}
    for real_name, sim_name in names:
        rs = [r for r in real if r["config"] == real_name]
        yield real_name, sim_name, (rs, sim[sim_name]) if rs and sim_name in sim else None


def latencies(rs, s):
    """TTFT p50/p90/p99 and end-to-end p50 in ms: the real runs' means, then the simulator's."""
    real = [mean(r["ttft_ms"][p] for r in rs) for p in ("p50", "p90", "p99")] + [mean(r["e2e_ms"]["p50"] for r in rs)]
    sim = [s["ttft_s"][p] * 1000 for p in ("p50", "p90", "p99")] + [s["e2e_s"]["p50"] * 1000]
    return real, sim


def runs_count(results_path):
    """Runs of the config run most often in a results file."""
    counts = collections.Counter(json.loads(line)["config"] for line in open(results_path))
    return max(counts.values(), default=0)


def quantile(xs, q):
    """The nearest-rank quantile q of xs, as the incident client computes its own (NaN when empty)."""
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * q)] if xs else float("nan")


def step_gaps(paths):
    """Each busy step's time beyond its target, ms, from pacer logs: the wall time from the previous
    step's release to this one's, less this step's target (the host's gap between steps plus the
    step's overrun). Busy: the previous step had sequences decoding, so this one followed at once
    rather than waiting for a request. A gap over 50 ms is a stall of the host, not its routine."""
    gaps = []
    for path in paths:
        steps = [json.loads(line) for line in open(path)]
        for before, step in zip(steps, steps[1:]):
            if before["decode_seqs"] > 0:
                gap = (step["t"] - before["t"]) * 1000 - step["target_ms"]
                if gap < 50:
                    gaps.append(gap)
    return gaps



def stamped_steps(path):
    """The steps of a pacer log that carry its request stamps: `began_at`, and `admitted` entries of
    `[arrived, queued, prompt tokens]`, with the request's id after them in newer logs (an older
    pacer logged none, or `[arrived, tokens]`); `first_tokens` empty where the log has none."""
    steps = [step for step in map(json.loads, open(path)) if "began_at" in step]
    if any(len(a) not in (3, 4) for step in steps for a in step.get("admitted", [])):
        return []
    return [dict(step, admitted=step.get("admitted", []), first_tokens=step.get("first_tokens", [])) for step in steps]


# The parts of a request's time to first token, in order (`ttft_parts`).
TTFT_PARTS = ("to_engine", "intake", "queue", "prefill", "delivery")


def ttft_parts(pace_paths, requests_path):
    """Where each request's time to first token went, in ms, from the pacer logs (when its engine's
    API server took it, when the scheduler queued it, when its first step began, when the step that
    completed its prompt released its first token) joined by request id to the incident client's
    records (when it left, its TTFT, and the id its response carried): `to_engine`, from leaving
    the client to the engine's API server (the client's send, the router, the hop); `intake`, the
    API server (rendering, tokenizing) and the hand-over to the scheduler; `queue`, waiting for a
    step; `prefill`, its prompt's steps; `delivery`, from the first token's release to the client
    (detokenizing, the engine's and the router's streams). They add up to the TTFT. Besides them,
    `late`: how much of the prefill was its steps running past their targets (the CPU starved:
    the testbed, which the model leaves out), and the record's `index` in its burst. A list of
    dicts, one per request found in the logs with every stamp; the client's records of requests
    that are not are left out (an older log has no ids)."""
    seen = {}
    for path in pace_paths:
        # Each engine's paced time so far, to tell a prefill's steps' targets from their overrun.
        paced = 0.0
        for step in stamped_steps(path):
            for a in step["admitted"]:
                if len(a) == 4 and a[3] not in seen and a[0] is not None and a[1] is not None:
                    seen[a[3]] = {"arrived": a[0], "queued": a[1], "began": step["began_at"], "paced": paced}
            paced += step["target_ms"]
            for rid in step["first_tokens"]:
                if rid in seen and "released" not in seen[rid]:
                    seen[rid]["released"] = step["t"]
                    seen[rid]["targets"] = paced - seen[rid]["paced"]
    # vLLM's engine id for a completion is its response's id, the prompt's index and a suffix of its
    # own ("cmpl-ID-0-1a2b3c4d"); a chat completion's has no index.
    by_id = dict(seen)
    for rid, stamps in seen.items():
        for cut in (1, 2):
            by_id.setdefault(rid.rsplit("-", cut)[0], stamps)
    parts = []
    for line in open(requests_path):
        r = json.loads(line)
        stamps = by_id.get(r.get("id"))
        if stamps is None or "released" not in stamps or r.get("ttft_s") is None:
            continue
        times = [r["sent_at"], stamps["arrived"], stamps["queued"], stamps["began"], stamps["released"],
                 r["sent_at"] + r["ttft_s"]]
        part = {name: (b - a) * 1000 for name, a, b in zip(TTFT_PARTS, times, times[1:])}
        parts.append(dict(part, late=part["prefill"] - stamps["targets"], index=r["index"]))
    return parts


def intake_delays(pace_paths, requests_path, clients):
    """A burst's first requests on their way to the engines' first steps, from the pacer's logs
    (each step's start and the requests it first ran, with when the engine queued each) and the
    incident client's records (when each request left). For each burst and engine, the first step
    that ran a request of the burst: when it began after the burst's first request left, how many
    requests it ran, and how long after the earliest of them was queued. And for the burst's first
    wave (its first `clients` requests, sent together), when the engines queued them after the
    first left. Times in ms; a dict of lists."""
    sent = collections.defaultdict(list)
    for line in open(requests_path):
        r = json.loads(line)
        if r.get("sent_at") is not None:
            sent[r["burst"]].append(r["sent_at"])
    starts = sorted(min(times) for times in sent.values())
    out = {"first_step_after_send": [], "first_step_requests": [], "first_step_after_queued": [],
           "wave0_queued_after_send": [], "first_step_spread": []}
    engines = [stamped_steps(path) for path in pace_paths]
    for b, start in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else float("inf")
        queued, firsts = [], []
        for steps in engines:
            # The steps that ran a request of this burst for the first time.
            taken = [s for s in steps if start <= s["began_at"] < end
                     and any(a[1] is not None and a[1] >= start for a in s["admitted"])]
            queued += [a[1] for s in taken for a in s["admitted"] if a[1] is not None and a[1] >= start]
            if taken:
                first = taken[0]
                firsts.append(first["began_at"])
                out["first_step_after_send"].append((first["began_at"] - start) * 1000)
                out["first_step_requests"].append(len(first["admitted"]))
                earliest = min(a[1] for a in first["admitted"] if a[1] is not None)
                out["first_step_after_queued"].append((first["began_at"] - earliest) * 1000)
        out["wave0_queued_after_send"] += [(q - start) * 1000 for q in sorted(queued)[:clients]]
        if len(firsts) > 1:
            out["first_step_spread"].append((max(firsts) - min(firsts)) * 1000)
    return out


def intake_intervals(paths):
    """Each request's intake alone (the time from the engine's API server taking it to its
    scheduler being able to queue it, the server busy with it only), in ms, as the interval the
    pacer log bounds it to. The API server takes one request at a time, so a request that came in
    while an earlier one might still be in it (not queued yet) is left out: its time includes the
    wait. The scheduler queues what came in between steps: a request queued while the engine sat
    idle came in just then (an interval of width 0); one queued right after a step came in during
    that step, so after it began. Only requests with both stamps."""
    intervals = []
    for path in paths:
        steps = stamped_steps(path)
        ends = [(s["t"], s["began_at"]) for s in steps]
        stamped = [(a[0], a[1]) for s in steps for a in s["admitted"] if a[0] is not None and a[1] is not None]
        for arrived, queued in stamped:
            if any(other < arrived < other_queued for other, other_queued in stamped):
                continue
            high = max((queued - arrived) * 1000, 0.0)
            # The step that ended last before the queueing: the queueing came at its end (within
            # 2 ms) when the request had come in during it.
            before = [(t, began) for t, began in ends if t <= queued]
            low = high
            if before:
                t, began = before[-1]
                if queued - t < 0.002:
                    low = min(max((began - arrived) * 1000, 0.0), high)
            intervals.append((low, high))
    return intervals


def fit_lognormal(intervals):
    """The (median, p90) in ms of the lognormal most likely to have put each value in its
    [low, high] interval (a point where low = high): a maximum-likelihood fit to interval-censored
    data, by a coarse grid over the median and the spread and then a finer one around the best (no
    SciPy on the machines that run this). None when there is nothing to fit."""
    intervals = [(max(lo, 1e-3), max(hi, 1e-3)) for lo, hi in intervals]
    if not intervals:
        return None
    sqrt2, sqrt2pi = math.sqrt(2.0), math.sqrt(2.0 * math.pi)

    def log_likelihood(mu, sigma):
        total = 0.0
        for lo, hi in intervals:
            if hi - lo < 1e-3:
                z = (math.log(hi) - mu) / sigma
                total += -0.5 * z * z - math.log(sigma * hi * sqrt2pi)
            else:
                p = 0.5 * (math.erf((math.log(hi) - mu) / (sigma * sqrt2)) - math.erf((math.log(lo) - mu) / (sigma * sqrt2)))
                total += math.log(max(p, 1e-12))
        return total

    def best(mus, sigmas):
        return max(((log_likelihood(m, s), m, s) for m in mus for s in sigmas))[1:]

    mu, sigma = best([math.log(0.1) + i * 0.2 for i in range(50)], [0.05 + i * 0.1 for i in range(30)])
    mu, sigma = best([mu + (i - 10) * 0.02 for i in range(21)], [max(0.01, sigma + (i - 10) * 0.01) for i in range(21)])
    return math.exp(mu), math.exp(mu + 1.2815515655 * sigma)


def run_records(work, config=None):
    """The client's records of every run in a work directory (`CONFIG-ROUND.requests.jsonl`), or of
    CONFIG's runs only ("smg-cache_aware" is not "smg-cache_aware-unguarded"), sorted."""
    paths = []
    for path in sorted(glob.glob(f"{work}/*.requests.jsonl")):
        name, _, round_ = os.path.basename(path)[:-len(".requests.jsonl")].rpartition("-")
        if round_.isdigit() and (config is None or name == config):
            paths.append(path)
    return paths


def runs_ttft_parts(work, config=None):
    """`ttft_parts` over the runs `run_records` finds (each run's pacer logs are beside its records,
    in `CONFIG-ROUND.pace/`), and how many requests the records hold in all."""
    parts, total = [], 0
    for path in run_records(work, config):
        run = path[:-len(".requests.jsonl")]
        total += sum(1 for _ in open(path))
        parts += ttft_parts(sorted(glob.glob(f"{run}.pace/e*.pace.jsonl")), path)
    return parts, total
