#!/usr/bin/env bash
# Fails with a clear message when the disk under target/ has less than GB gigabytes free, before an
# install that would otherwise stop half-way with pip's "[Errno 28] No space left on device".
#
# Usage: scripts/real-engines/need-disk.sh GB WHAT   (WHAT names the install in the message)
set -euo pipefail
cd "$(dirname "$0")/../.."
need_gb=$1
what=$2
mkdir -p target
free_kb=$(df -Pk target | awk 'NR == 2 { print $4 }')
if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
  echo "$what: needs about $need_gb GB free on the disk under $(pwd)/target, and $((free_kb / 1024 / 1024)) GB is free." >&2
  echo "$what: free some space (old build outputs: cargo clean; other checkouts' target/ folders) and run again." >&2
  exit 1
fi
