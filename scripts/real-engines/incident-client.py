"""The incident's client (run by incident.sh): a long hot prefix, first served once through the router
so that one engine owns it, then bursts of requests that share it, from many clients at once.

Prints one JSON object: time to first token and end-to-end percentiles over every burst request, the
share of requests each engine served and its peak waiting queue (sampled from the engine's own
/metrics every 100 ms), the owner, and failures. Only the standard library: any python3 runs it.
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request

WORDS = (
    "alpha river stone cloud amber forest signal copper winter harbor lantern meadow orbit quartz summit "
    "velvet garden falcon mirror candle pepper marble thunder violet island anchor ribbon cactus"
).split()


def text(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def metric(port, name):
    """Sum of a metric's series on one engine."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def send(router, prompt, max_tokens, stream):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
    return first, time.perf_counter() - started


def quantile(xs, q):
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * q)] if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--ports", required=True, help="engine ports, comma-separated")
    ap.add_argument("--waiting", required=True, help="the engines' waiting-queue gauge")
    ap.add_argument("--running", required=True, help="the engines' running-requests gauge")
    ap.add_argument("--finished", required=True, help="the engines' finished-requests counter")
    ap.add_argument("--prefix-words", type=int, default=700)
    ap.add_argument("--question-words", type=int, default=250)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-burst", type=int, default=48)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    ports = [int(p) for p in a.ports.split(",")]
    rng = random.Random(a.seed)
    prefix = "[hot system prompt] " + text(rng, a.prefix_words) + "\n"

    def finished():
        return [metric(p, a.finished) for p in ports]

    def busy():
        return sum(metric(p, a.waiting) + metric(p, a.running) for p in ports)

    def settle():
        deadline = time.time() + 600
        while busy() > 0:
            if time.time() > deadline:
                raise SystemExit("incident-client: the engines did not go idle within 10 minutes")
            time.sleep(0.2)
        time.sleep(1.0)

    # One request makes one engine the prefix's owner, as the incident's popular prefix had one.
    before = finished()
    send(a.router, prefix + "warm-up question", 1, False)
    settle()
    owner = max(range(len(ports)), key=lambda i: finished()[i] - before[i])

    ttft, e2e, failures = [], [], []
    served = [0] * len(ports)
    peak = [0.0] * len(ports)
    owner_shares = []
    for burst in range(a.bursts):
        questions = [text(rng, a.question_words) for _ in range(a.per_burst)]
        before = finished()
        sampling = True

        def sample():
            while sampling:
                for i, p in enumerate(ports):
                    try:
                        peak[i] = max(peak[i], metric(p, a.waiting))
                    except OSError:
                        pass
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        lock = threading.Lock()

        def client(k):
            for j in range(k, a.per_burst, a.clients):
                try:
                    first, whole = send(a.router, prefix + f"question {burst}.{j}: " + questions[j], a.output, True)
                    with lock:
                        ttft.append(first)
                        e2e.append(whole)
                except Exception as err:  # every failure is counted and reported
                    with lock:
                        failures.append(str(err))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        settle()
        sampling = False
        sampler.join()
        after = finished()
        delta = [after[i] - before[i] for i in range(len(ports))]
        for i, d in enumerate(delta):
            served[i] += d
        owner_shares.append(delta[owner] / max(1.0, sum(delta)))

    def ms(seconds):
        return None if seconds is None else round(seconds * 1000, 1)

    total = max(1.0, sum(served))
    print(
        json.dumps(
            {
                "requests": len(ttft),
                "failures": len(failures),
                "first_failure": failures[0] if failures else None,
                "ttft_ms": {q: ms(quantile(ttft, v)) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
                "e2e_ms": {"p50": ms(quantile(e2e, 0.5)), "p90": ms(quantile(e2e, 0.9))},
                "owner": owner,
                "owner_share": round(statistics.mean(owner_shares), 3),
                "shares": [round(s / total, 3) for s in served],
                "peak_waiting": peak,
            }
        )
    )


if __name__ == "__main__":
    main()
