#!/usr/bin/env bash
# Fetches the descriptors of SMG's gRPC worker protocol as the engines' servicers use them: the
# generated Python modules of the PyPI package `smg-grpc-proto` (never committed), written out as one
# encoded FileDescriptorSet for crates/worker-proto/tests/smg_descriptors.rs, which checks kvgate's own
# .proto definitions against it.
#
# Usage: scripts/fetch-smg-descriptors.sh [DEST]   (default: target/test-data/smg-grpc-proto)
set -euo pipefail
dest="${1:-target/test-data/smg-grpc-proto}"
version=0.4.28
protobuf=6.33.5
if [ -f "$dest/descriptors-$version.bin" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip=(python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$tmp/py")
"${pip[@]}" --no-deps "smg-grpc-proto==$version"
"${pip[@]}" "protobuf==$protobuf"
mkdir -p "$dest"
PYTHONPATH="$tmp/py" python3 - "$dest/descriptors-$version.bin" <<'PY'
import importlib
import sys

from google.protobuf import descriptor_pb2

modules = ["common_pb2", "sglang_scheduler_pb2", "vllm_engine_pb2"]
files = {}

def add(file_descriptor):
    # Dependencies first, each file once: a FileDescriptorSet a reader can resolve in order.
    if file_descriptor.name in files:
        return
    for dep in file_descriptor.dependencies:
        add(dep)
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    files[file_descriptor.name] = proto

for name in modules:
    add(importlib.import_module(f"smg_grpc_proto.generated.{name}").DESCRIPTOR)
out = descriptor_pb2.FileDescriptorSet(file=list(files.values()))
with open(sys.argv[1], "wb") as f:
    f.write(out.SerializeToString())
print(f"smg-grpc-proto descriptors: {', '.join(files)}")
PY
