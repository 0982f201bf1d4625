"""A stand-in engine that holds a prompt's prefix in its KV cache, for scripts/tokenize-bench/run.sh.

Publishes vLLM's map-form BlockStored for the given token ids on a ZMQ XPUB socket: seq 0 as soon as
a subscriber joins (so kvgate sees no gap), then an empty batch every 200 ms, so the stream stays
live without the gateway re-reading thousands of blocks during the measurement.
Usage: publisher.py ENDPOINT BLOCK_SIZE TOKENS_JSON...  (each kvgate's /admin/tokenize answer for
one prompt, stored as its own sequence)
"""
import json
import struct
import sys
import time

import msgspec
import zmq

endpoint, block_size, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
events = []
for k, tokens_file in enumerate(files):
    ids = json.load(open(tokens_file))["tokens"]
    blocks = len(ids) // block_size
    hashes = [(k + 1) << 32 | b for b in range(blocks)]
    events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                   "token_ids": ids[: blocks * block_size], "block_size": block_size, "lora_id": None,
                   "medium": "GPU"})
socket = zmq.Context().socket(zmq.XPUB)
socket.bind(endpoint)
while socket.recv()[:1] != b"\x01":  # a subscription
    pass
print(f"subscriber joined: publishing {sum(len(e['block_hashes']) for e in events)} blocks", flush=True)
seq = 0
while True:
    payload = msgspec.msgpack.encode([time.time(), events if seq == 0 else [], None])
    socket.send_multipart([b"kv", struct.pack(">Q", seq), payload])
    seq += 1
    time.sleep(0.2)
