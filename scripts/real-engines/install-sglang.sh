#!/usr/bin/env bash
# Installs SGLang for CPU (PyPI `sglang`) into a virtual environment under target/, idempotently.
#
# `pip install sglang==0.5.23` cannot work here: the wheel requires CUDA-only kernel packages
# (flashinfer, flash-attn-4, sglang-kernel, deep-ep, ...) that fail to install or to load without a
# GPU. SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, --device cpu) needs none of them. So: download
# the wheel without dependencies, install its declared requirements minus the CUDA-only ones, with
# torch held at the version the wheel pins (PyPI's Linux build of it runs on CPU), then the wheel
# itself with --no-deps. The one module SGLang's CPU path still imports, `sgl_kernel`, is replaced
# by the import-only stand-in in scripts/real-engines/sglang-stand-in/ (see its docstring).
# About 7 GB and 2.5 to 10 minutes, depending on the network (no pip cache is kept: it would hold a
# second copy of every wheel); a second run finds the stamp and returns at once.
#
# Usage: scripts/real-engines/install-sglang.sh [VENV]   (default: target/real-engines/sglang-venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
sglang_version=0.5.23
torch_version=2.14.1
# The gRPC servicer SMG's workers run (`--smg-grpc-mode`); the wheel only asks for >=0.9.0.
servicer_version=0.14.1
venv="${1:-target/real-engines/sglang-venv}"
stamp="$venv/.kvgate-sglang-$sglang_version"
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
command -v python3 >/dev/null || { echo "install-sglang: python3 is required (with pip and venv)" >&2; exit 1; }

echo "install-sglang: installing sglang $sglang_version for CPU into $venv (about 7 GB the first time)" >&2
rm -rf "$venv"
scripts/real-engines/need-disk.sh 9 install-sglang
python3 -m venv "$venv"
# No pip cache: on a fresh machine it would only hold a second copy of every wheel (GBs).
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet --no-cache-dir)
wheels="$venv/.wheels"
mkdir -p "$wheels"
"${pip[@]}" download --no-deps --only-binary=:all: -d "$wheels" "sglang==$sglang_version"
wheel=$(ls "$wheels"/sglang-"$sglang_version"-*.whl | head -n 1)

# The wheel's own requirements less the CUDA-only packages, and torch held by a constraint so that
# nothing pulls another build of it.
"$venv/bin/python" - "$wheel" "$servicer_version" > "$wheels/requirements.txt" <<'PY'
import re
import sys
import zipfile
from email.parser import Parser

wheel, servicer = sys.argv[1], sys.argv[2]
# Kernels and runtimes that exist only for CUDA: they either fail to install here or need
# libcuda.so at import. The CPU engine imports none of them (sgl_kernel aside: see the stand-in).
cuda_only = {
    "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl",
    "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm",
    "sgl-flash-mla", "sglang-kernel", "tilelang", "torch-memory-saver", "torchaudio", "torchcodec",
}
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    spec, _, marker = req.partition(";")
    project = re.split(r"[\[<>=!~ ]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")
    if project in cuda_only:
        continue
    if project == "smg-grpc-servicer":
        spec = f"smg-grpc-servicer=={servicer}"
    print(spec.strip() + (f"; {marker.strip()}" if marker.strip() else ""))
# SGLang's ZMQ KV-event publisher encodes with msgpack, which the wheel does not declare.
print("msgpack")
PY
echo "torch==$torch_version" > "$wheels/constraints.txt"
"${pip[@]}" install "torch==$torch_version"
"${pip[@]}" install -c "$wheels/constraints.txt" -r "$wheels/requirements.txt"
"${pip[@]}" install --no-deps "$wheel"
PYTHONPATH=scripts/real-engines/sglang-stand-in SGLANG_USE_CPU_ENGINE=1 \
  "$venv/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2
rm -rf "$wheels"
touch "$stamp"
echo "install-sglang: done" >&2
