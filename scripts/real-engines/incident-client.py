"""The incident's client (run by incident.sh): a long hot prefix, first served once through the router
so that one engine owns it, then bursts of requests that share it, from many clients at once.

Prints one JSON object: time to first token and end-to-end percentiles over every burst request, the
share of requests each engine served and its peak waiting queue (sampled from the engine itself every
100 ms), the engines' prefix-cache hit rate as their responses report it, the owner, and failures.

Engines serving HTTP are read from their own /metrics; only the standard library is needed then. gRPC
workers (SMG's protocol: `--transport grpc`) serve no /metrics: their queues come from their own
`GetLoads` (the client then needs `grpcio` and `smg-grpc-proto`, as the engines' venvs have them), and
the requests each served from its servicer's log, which names every request it receives.
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


class HttpEngines:
    """Engines read from their own /metrics."""

    def __init__(self, ports, waiting, running, finished):
        self.ports, self.waiting_name, self.running_name, self.finished_name = ports, waiting, running, finished

    def waiting(self, i):
        return metric(self.ports[i], self.waiting_name)

    def running(self, i):
        return metric(self.ports[i], self.running_name)

    def finished(self, i):
        return metric(self.ports[i], self.finished_name)


# What a gRPC worker's servicer logs for each request it receives (smg-grpc-servicer 0.14.1).
RECEIVED = {"vllm": "Generate request ", "sglang": "Receive generation request: "}


class GrpcEngines:
    """gRPC workers: queues from `GetLoads`, requests received from their servicers' logs."""

    def __init__(self, ports, runtime, logs):
        import grpc  # only gRPC runs need them: the engines' venvs have both
        from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        pb, stub = {
            "vllm": (vllm_engine_pb2, vllm_engine_pb2_grpc.VllmEngineStub),
            "sglang": (sglang_scheduler_pb2, sglang_scheduler_pb2_grpc.SglangSchedulerStub),
        }[runtime]
        self.request = pb.GetLoadsRequest()
        self.stubs = [stub(grpc.insecure_channel(f"127.0.0.1:{p}")) for p in ports]
        self.logs, self.marker = logs, RECEIVED[runtime]

    def loads(self, i):
        return self.stubs[i].GetLoads(self.request, timeout=5).loads

    def waiting(self, i):
        return float(sum(rank.num_waiting_reqs for rank in self.loads(i)))

    def running(self, i):
        return float(sum(rank.num_running_reqs for rank in self.loads(i)))

    def finished(self, i):
        # Received, not finished: read once the engines are idle, the two are the same.
        with open(self.logs[i], errors="replace") as log:
            return float(sum(self.marker in line for line in log))


def metric(port, name):
    """Sum of a metric's series on one engine."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def send(router, prompt, max_tokens, stream, usage=None):
    """Time to the first event and to the end; the usage the last event carries goes to `usage`, with
    `sent_at` (the wall time the request left) and `id` (the first event's, which the engine names
    after its own request id: the pacer's log names requests by it)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    if usage is not None:
        usage["sent_at"] = time.time()
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
                if usage is not None and line.startswith(b"data: {"):
                    usage["id"] = json.loads(line[6:]).get("id")
            if usage is not None and line.startswith(b"data: {") and b'"usage"' in line:
                got = json.loads(line[6:]).get("usage")
                if got:
                    usage.update(got)
    return first, time.perf_counter() - started


def quantile(xs, q):
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * q)] if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--ports", required=True, help="engine ports, comma-separated")
    ap.add_argument("--waiting", help="the engines' waiting-queue gauge (HTTP)")
    ap.add_argument("--running", help="the engines' running-requests gauge (HTTP)")
    ap.add_argument("--finished", help="the engines' finished-requests counter (HTTP)")
    ap.add_argument("--transport", choices=["http", "grpc"], default="http")
    ap.add_argument("--runtime", choices=["vllm", "sglang"], default="vllm", help="the gRPC workers' runtime")
    ap.add_argument("--logs", help="the gRPC workers' logs, comma-separated, in --ports order")
    ap.add_argument("--prefix-words", type=int, default=700)
    ap.add_argument("--question-words", type=int, default=250)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-burst", type=int, default=48)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--requests-out", help="write one JSON line per request (burst, index, client, sent_s from the burst's start, sent_at wall time, id: the response's, ttft_s, e2e_s)"
    )
    a = ap.parse_args()
    ports = [int(p) for p in a.ports.split(",")]
    if a.transport == "grpc":
        engines = GrpcEngines(ports, a.runtime, a.logs.split(","))
    else:
        engines = HttpEngines(ports, a.waiting, a.running, a.finished)
    rng = random.Random(a.seed)
    prefix = "[hot system prompt] " + text(rng, a.prefix_words) + "\n"

    def finished():
        return [engines.finished(i) for i in range(len(ports))]

    def busy():
        return sum(engines.waiting(i) + engines.running(i) for i in range(len(ports)))

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
    records = []
    served = [0] * len(ports)
    peak = [0.0] * len(ports)
    owner_shares = []
    slowest = [0.0] * a.bursts
    prompt_tokens = cached_tokens = 0
    for burst in range(a.bursts):
        questions = [text(rng, a.question_words) for _ in range(a.per_burst)]
        before = finished()
        sampling = True

        def sample():
            while sampling:
                for i in range(len(ports)):
                    try:
                        peak[i] = max(peak[i], engines.waiting(i))
                    except Exception:  # a missed sample only
                        pass
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        lock = threading.Lock()
        burst_start = time.perf_counter()

        def client(k):
            nonlocal prompt_tokens, cached_tokens
            for j in range(k, a.per_burst, a.clients):
                try:
                    usage = {}
                    sent = time.perf_counter() - burst_start
                    first, whole = send(a.router, prefix + f"question {burst}.{j}: " + questions[j], a.output, True, usage)
                    with lock:
                        records.append(
                            {
                                "burst": burst,
                                "index": j,
                                "client": k,
                                "sent_s": sent,
                                "sent_at": round(usage["sent_at"], 6),
                                "id": usage.get("id"),
                                "ttft_s": first,
                                "e2e_s": whole,
                            }
                        )
                        ttft.append(first)
                        e2e.append(whole)
                        slowest[burst] = max(slowest[burst], first)
                        prompt_tokens += usage.get("prompt_tokens", 0)
                        cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
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

    if a.requests_out:
        with open(a.requests_out, "w") as out:
            for r in sorted(records, key=lambda r: (r["burst"], r["index"])):
                out.write(json.dumps(r) + "\n")
    total = max(1.0, sum(served))
    print(
        json.dumps(
            {
                "requests": len(ttft),
                "failures": len(failures),
                "first_failure": failures[0] if failures else None,
                "ttft_ms": {q: ms(quantile(ttft, v)) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
                "e2e_ms": {"p50": ms(quantile(e2e, 0.5)), "p90": ms(quantile(e2e, 0.9))},
                "slowest_ttft_ms_by_burst": [ms(s) for s in slowest],
                "owner": owner,
                "owner_share": round(statistics.mean(owner_shares), 3),
                "shares": [round(s / total, 3) for s in served],
                "peak_waiting": peak,
                "reported_hit_rate": round(cached_tokens / prompt_tokens, 3) if prompt_tokens else None,
            }
        )
    )


if __name__ == "__main__":
    main()
