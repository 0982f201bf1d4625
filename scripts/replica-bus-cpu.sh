#!/usr/bin/env bash
# What sharing reservations costs one replica: its CPU while 7 emulated peers decide 875 requests a
# second over the bus (1,000 a second across 8 replicas with this one's share), against its CPU with
# the bus connected and quiet. Needs nats-server (scripts/setup-nats.sh) and a release build.
#   scripts/replica-bus-cpu.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
nats=${KVGATE_NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
cargo build -q --release -p kvgate -p kvgate-gateway --example replica_peers
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
gw_port=$(free_port)
"$nats" -a 127.0.0.1 -p "$port" >/dev/null 2>&1 &
nats_pid=$!
workers=()
for i in $(seq 0 50); do workers+=(--worker "http://127.0.0.1:$((20000 + i)),id=w$i"); done
target/release/kvgate serve --port "$gw_port" --replica-bus "nats://127.0.0.1:$port" --replica-id measured "${workers[@]}" >/dev/null 2>&1 &
gw=$!
trap 'kill $gw $nats_pid 2>/dev/null' EXIT
sleep 3
ticks() { awk '{print $14 + $15}' "/proc/$gw/stat"; }
hz=$(getconf CLK_TCK)
quiet0=$(ticks); sleep "$secs"; quiet1=$(ticks)
busy0=$(ticks)
target/release/examples/replica_peers "nats://127.0.0.1:$port" kvgate.reservations 7 875 51 "$secs"
busy1=$(ticks)
python3 -c "import json,urllib.request; v=json.load(urllib.request.urlopen('http://127.0.0.1:$gw_port/admin/replicas')); print('the replica received', v['received'], 'messages and applied', v['applied'])"
python3 - "$quiet0" "$quiet1" "$busy0" "$busy1" "$hz" "$secs" <<'PY'
import sys
q0, q1, b0, b1, hz, secs = map(float, sys.argv[1:])
quiet, busy = (q1 - q0) / hz / secs, (b1 - b0) / hz / secs
print(f"replica CPU, bus quiet: {quiet * 100:.2f}% of a core; 7 peers at 875 decisions/s: {busy * 100:.2f}%; sharing costs {(busy - quiet) * 100:.2f}%")
PY
