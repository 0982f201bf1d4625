#!/usr/bin/env bash
# SMG (the SGLang Model Gateway, PyPI `smg`), the gateway kvgate's users come from, into its own venv
# under target/smg-venv: the real-engine suite compares kvgate with SMG in gRPC mode, and the bench
# scripts run it side by side. Idempotent: a stamp names the installed version, so a second run
# returns at once. About 150 MB; ~20 s on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=1.13.0
venv=target/smg-venv
stamp="$venv/.kvgate-smg-$version"
[ -e "$stamp" ] && [ -x "$venv/bin/smg" ] && exit 0
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "smg==$version"
touch "$stamp"
