"""The gRPC path's own cost (grpc-path.sh): the same kind of request sent straight to a gRPC worker
(`Generate`, the prompt's token ids in, token ids out) or through a router over HTTP (a streamed
completion of the prompt's text, which the router tokenizes, as SMG 1.13 takes no token-id prompts),
timed at the client. Every request has a prompt of its own (random words, about PROMPT tokens, so no
prefix is cached) and generates exactly OUTPUT tokens (`ignore_eos`).

Prints one JSON object: time to first token and end to end (ms, p50 and p90) of REQUESTS requests
one after another, each one's decode rate (tokens after the first over the time after the first),
and the output tokens per second of CONCURRENCY clients at once.

Run with the vLLM venv's python, which has grpcio and the protocol's stubs for either runtime.
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * q))]


class Direct:
    """Generate on the worker itself, as a gateway in front of it would call it."""

    def __init__(self, port, runtime):
        import grpc
        from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.runtime = runtime
        if runtime == "vllm":
            self.pb, self.stub = vllm_engine_pb2, vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        else:
            self.pb, self.stub = sglang_scheduler_pb2, sglang_scheduler_pb2_grpc.SglangSchedulerStub(self.channel)

    def run(self, request_id, prompt, output):
        pb = self.pb
        tokenized = pb.TokenizedInput(original_text=prompt[0], input_ids=prompt[1])
        if self.runtime == "vllm":
            params = pb.SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
            request = pb.GenerateRequest(request_id=request_id, tokenized=tokenized, sampling_params=params, stream=True)
        else:
            params = pb.SamplingParams(temperature=0, max_new_tokens=output, ignore_eos=True)
            request = pb.GenerateRequest(request_id=request_id, tokenized=tokenized, sampling_params=params, stream=True)
        start = time.perf_counter()
        first, tokens = None, 0
        for message in self.stub.Generate(request):
            if message.HasField("chunk") and message.chunk.token_ids:
                if first is None:
                    first = time.perf_counter() - start
                # The Python servicers count per chunk; the ids are what was generated.
                tokens += len(message.chunk.token_ids)
        return first, time.perf_counter() - start, tokens


class Router:
    """A streamed completion of the same token ids through a router's OpenAI API."""

    def __init__(self, port):
        self.url = f"http://127.0.0.1:{port}/v1/completions"

    def run(self, request_id, prompt, output):
        body = {"model": "tiny", "prompt": prompt[0], "max_tokens": output, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        request = urllib.request.Request(self.url, json.dumps(body).encode(), {"content-type": "application/json"})
        start = time.perf_counter()
        first, tokens = None, 0
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and first is None:
                    first = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return first, time.perf_counter() - start, tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["direct", "router"])
    p.add_argument("port", type=int)
    p.add_argument("--runtime", default="vllm")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(a.tokenizer)
    client = Direct(a.port, a.runtime) if a.mode == "direct" else Router(a.port)
    rng = random.Random(a.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def prompt():
        """Random words of about `a.prompt` tokens: (text, its ids as the engines' servers add them)."""
        words = []
        while True:
            words += ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(64)]
            text = " ".join(words)
            ids = tokenizer.encode(text).ids  # with the BOS the engines' completions add
            if len(ids) >= a.prompt:
                return text, ids

    # Warm-up: the first request of a connection pays for its set-up.
    client.run("warm", prompt(), 4)
    ttft, e2e, rate = [], [], []
    for i in range(a.requests):
        first, total, tokens = client.run(f"seq-{a.seed}-{i}", prompt(), a.output)
        if first is None or tokens != a.output:
            raise SystemExit(f"request {i}: first token {first}, {tokens} tokens of {a.output}")
        ttft.append(first * 1000)
        e2e.append(total * 1000)
        rate.append((tokens - 1) / (total - first))

    prompts = [[prompt() for _ in range(a.requests // a.concurrency)] for _ in range(a.concurrency)]
    produced = [0] * a.concurrency
    errors = []

    def worker(k):
        try:
            for j, one in enumerate(prompts[k]):
                produced[k] += client.run(f"con-{a.seed}-{k}-{j}", one, a.output)[2]
        except Exception as e:  # reported below, not swallowed
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"concurrent requests failed: {errors[:3]}")
    print(json.dumps({
        "ttft_p50": quantile(ttft, 0.5), "ttft_p90": quantile(ttft, 0.9),
        "e2e_p50": quantile(e2e, 0.5), "e2e_p90": quantile(e2e, 0.9),
        "decode_tok_s": statistics.median(rate),
        "concurrent_tok_s": sum(produced) / wall,
    }))


if __name__ == "__main__":
    main()
