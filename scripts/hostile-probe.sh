#!/usr/bin/env bash
# Hostile probes of kvgate serve (issue 11's done-when), each role in its own process:
#   1. STREAMS concurrent slow streams through one gateway (default 9000; each needs 2 descriptors
#      in the gateway, so 10,000 need a hard limit of at least 20,300: `ulimit -Hn`);
#   2. 2,000 idle or dribbling sockets while a normal client sends 200 requests (its latency);
#   3. a second gateway limited to 1,024 descriptors (a common LimitNOFILE), flooded with 1,200 and
#      then 5,000 sockets that send one byte of a request and nothing more, while a normal client
#      sends 200 requests, each on a new connection (its latency).
# Usage: scripts/hostile-probe.sh [STREAMS] (STREAMS=0 skips probe 1). Builds release binaries;
# loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-9000}
cargo build --release -q -p kvgate
cargo build --release -q -p kvgate-gateway --example hostile_probe
probe=target/release/examples/hostile_probe
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
EP=$(free_port); GP=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$probe" engine "$EP" & pids+=($!)
# Admission off: the probe measures what the gateway can hold, not what the engine model admits.
target/release/kvgate serve --host 127.0.0.1 --port "$GP" --worker "http://127.0.0.1:$EP" --admission-wait-s 0 --log warn & pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$GP/ready" >/dev/null && break; sleep 0.1; done
echo "hard descriptor limit here: $(ulimit -Hn)"
if [ "$STREAMS" -gt 0 ]; then "$probe" streams "http://127.0.0.1:$GP" "$STREAMS"; fi
"$probe" idle "http://127.0.0.1:$GP" 2000

FP=$(free_port)
(ulimit -n 1024 && exec target/release/kvgate serve --host 127.0.0.1 --port "$FP" --worker "http://127.0.0.1:$EP" --admission-wait-s 0 --log warn) & pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$FP/ready" >/dev/null && break; sleep 0.1; done
echo "a gateway with 1,024 descriptors: $(curl -s "http://127.0.0.1:$FP/metrics" | grep '^kvgate_connections_cap ')"
"$probe" flood "http://127.0.0.1:$FP" 1200
"$probe" flood "http://127.0.0.1:$FP" 5000
curl -s "http://127.0.0.1:$FP/metrics" | grep '^kvgate_connections_shed_total' || true
