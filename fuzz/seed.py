#!/usr/bin/env python3
"""Writes the fuzz targets' starting corpus (fuzz/corpus/TARGET/seed-*) from the engines' recorded
wire vectors in ../shared/data/kv-events and a few hand-written inputs of each shape. Idempotent;
scripts/fuzz.sh runs it before fuzzing. Inputs the fuzzers find are merged into the same folders
(FUZZ_MERGE=1 scripts/fuzz.sh)."""
import json, pathlib, struct, sys

root = pathlib.Path(__file__).resolve().parent
shared = root.parent.parent / "shared" / "data" / "kv-events"
SEP = b"\xfe\xfd"


def write(target, name, data):
    d = root / "corpus" / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data)


def zmtp_frame(flags, body):
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_peer(socket_type, messages):
    greeting = bytearray(64)
    greeting[0], greeting[9], greeting[10] = 0xFF, 0x7F, 3
    greeting[12:16] = b"NULL"
    name, value = b"Socket-Type", socket_type.encode()
    ready = bytes([5]) + b"READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    out = bytes(greeting) + zmtp_frame(4, ready)
    for frames in messages:
        for i, f in enumerate(frames):
            out += zmtp_frame(1 if i + 1 < len(frames) else 0, f)
    return out


if shared.is_dir():
    for path in sorted(shared.glob("*.json")):
        v = json.loads(path.read_text())
        name = path.stem
        payloads = v.get("payload_hex", [])
        for i, payload in enumerate([payloads] if isinstance(payloads, str) else payloads):
            write("kv_events", f"{name}-payload{i}", b"\x00" + bytes.fromhex(payload))
        messages = v.get("frames_hex", [])
        if messages and isinstance(messages[0], str):
            messages = [messages]
        messages = [[bytes.fromhex(f) for f in m] for m in messages]
        mode = b"\x02" if v.get("kind") == "replay" else b"\x01"
        for i, frames in enumerate(messages):
            write("kv_events", f"{name}-frames{i}", mode + SEP.join(frames))
        if messages:
            sock = "ROUTER" if v.get("kind") == "replay" else "PUB"
            write("zmtp", name, (b"\x01" if sock == "ROUTER" else b"\x00") + zmtp_peer(sock, messages))
else:
    print(f"fuzz/seed.py: {shared} is missing; the kv_events and zmtp seeds are skipped", file=sys.stderr)

write("zmtp", "empty-pub", b"\x00" + zmtp_peer("PUB", []))

write("prometheus", "vllm", b"""# HELP vllm:num_requests_running Number of requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:cache_config_info{block_size="32",num_gpu_blocks="256"} 1.0
""")
write("prometheus", "sglang", b"""sglang:num_running_reqs{model_name="m"} 3
sglang:num_queue_reqs{model_name="m"} 1
sglang:token_usage{model_name="m"} 0.5
sglang:gen_throughput{model_name="m"} 120.5
sglang:num_waiting_uncached_tokens{model_name="m"} 2048
sglang:page_size{model_name="m"} 32
""")

write("engine_json", "loads", json.dumps({"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1,
      "num_waiting_uncached_tokens": 512, "num_used_tokens": 100, "max_total_num_tokens": 8192,
      "token_usage": 0.1, "gen_throughput": 10.0, "max_running_requests": 64}]}).encode())
write("engine_json", "server-info", json.dumps({"page_size": 32, "max_total_num_tokens": 65536,
      "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557"})}).encode())

chat = {"model": "m", "stream": True, "max_tokens": 16, "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "2"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
write("openai_request", "chat", b"\x00" + json.dumps(chat).encode())
write("openai_request", "completions", b"\x01" + json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode())
write("openai_request", "completions-ids", b"\x01" + json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode())
write("openai_request", "generate", b"\x02" + json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 4}}).encode())
write("openai_request", "responses", b"\x03" + json.dumps({"model": "m", "input": [{"role": "user", "content": "hi"}], "instructions": "x"}).encode())
write("openai_request", "embeddings", b"\x04" + json.dumps({"model": "m", "input": ["a", "b"]}).encode())
write("openai_request", "rerank", b"\x05" + json.dumps({"model": "m", "query": "q", "documents": ["a", "b"]}).encode())

write("workers_file", "lines", b"\x00http://10.0.0.1:8000 engine=vllm,kv_events=tcp://10.0.0.1:5557\n# comment\nhttp://10.0.0.2:8000\n")
write("workers_file", "json", b"\x01" + json.dumps({"workers": [{"url": "http://10.0.0.1:8000", "engine": "sglang",
      "kv_events": "tcp://10.0.0.1:5557", "block_size": 32}, "grpc://10.0.0.3:50051"]}).encode())

# A replica envelope as msgpack: [kind, version, replica, seq, body]; the fuzzer finds the rest.
write("replica_message", "minimal", bytes([0x95, 0xA3]) + b"kvg" + bytes([0x01, 0xA1]) + b"r" + bytes([0x00, 0x90]))

# Protobuf: field 1 (a nested message) with a varint inside; field tags reach every oneof.
for mode in range(4):
    write("grpc_message", f"mode{mode}", bytes([mode]) + bytes([0x0A, 0x04, 0x08, 0x01, 0x10, 0x02]))
