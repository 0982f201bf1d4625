"""What fidelity.sh and incident-fidelity.sh share: a real run's results against `kvgate sim`'s, each
real router paired with the simulator's model of it, and the latency columns both tables print."""

import collections
import json
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
