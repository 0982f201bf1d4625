#!/usr/bin/env bash
# What sharing reservations costs one replica of 8 at 1,000 decisions a second in all.
#
# The measured replica serves its own share, 125 requests a second (short completions on a mock
# engine), in two runs of SECONDS each:
#   alone:   no bus;
#   sharing: on a nats-server, with 7 emulated peers deciding the other 875 a second
#            (crates/gateway/examples/replica_peers.rs), so the replica publishes its own changes
#            and applies theirs.
# The difference in the replica's CPU time (from /proc) is what sharing costs it. A third figure,
# the sharing run without the replica's own traffic, isolates what receiving costs.
# Needs nats-server (scripts/setup-nats.sh); builds the release binaries.
#   scripts/replica-bus-cpu.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
nats=${KVGATE_NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
cargo build -q --release -p kvgate -p kvgate-gateway --example replica_peers
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
nats_port=$(free_port)
engine_port=$(free_port)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
"$nats" -a 127.0.0.1 -p "$nats_port" >/dev/null 2>&1 &
pids+=($!)
target/release/kvgate mock-engine --port "$engine_port" --kv-port 0 --replay-port 0 --speedup 50 >/dev/null 2>&1 &
pids+=($!)
# One live engine and 50 named ones that never answer: peers' changes name all 51.
workers=(--worker "http://127.0.0.1:$engine_port,id=w0")
for i in $(seq 1 50); do workers+=(--worker "http://127.0.0.1:$((20000 + i)),id=w$i"); done
hz=$(getconf CLK_TCK)
cpu_s() { awk -v hz="$hz" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }

# Sends 125 short completions a second to $1 for $2 seconds; prints how many answered 200.
own_traffic() {
  python3 - "$1" "$2" <<'PY'
import http.client, json, sys, threading, time
port, secs = int(sys.argv[1]), float(sys.argv[2])
body = json.dumps({"model": "mock-model", "prompt": "a short prompt", "max_tokens": 4})
ok = [0]
lock = threading.Lock()
def one():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    status = c.getresponse().status
    c.close()
    with lock:
        ok[0] += status == 200
start, n, threads = time.time(), 0, []
while time.time() - start < secs:
    due = int((time.time() - start) * 125)
    while n < due:
        t = threading.Thread(target=one); t.start(); threads.append(t); n += 1
    time.sleep(0.002)
for t in threads:
    t.join()
print(f"{ok[0]} of {n} own requests answered 200")
PY
}

# Starts a replica (with the bus if $1 is 1) on a free port; sets gw and gw_port.
start_replica() {
  gw_port=$(free_port)
  local bus=()
  if [ "$1" = 1 ]; then bus=(--replica-bus "nats://127.0.0.1:$nats_port" --replica-id measured); fi
  target/release/kvgate serve --port "$gw_port" --admission-wait-s 0 "${bus[@]}" "${workers[@]}" >/dev/null 2>&1 &
  gw=$!
  pids+=("$gw")
  sleep 3
}

start_replica 0
a0=$(cpu_s "$gw"); own_traffic "$gw_port" "$secs"; a1=$(cpu_s "$gw")
kill "$gw"
start_replica 1
b0=$(cpu_s "$gw")
target/release/examples/replica_peers "nats://127.0.0.1:$nats_port" kvgate.reservations 7 875 51 "$secs" &
peers=$!
own_traffic "$gw_port" "$secs"
wait "$peers"
b1=$(cpu_s "$gw")
sleep 2
c0=$(cpu_s "$gw")
target/release/examples/replica_peers "nats://127.0.0.1:$nats_port" kvgate.reservations 7 875 51 "$secs"
c1=$(cpu_s "$gw")
python3 -c "import json,urllib.request; v=json.load(urllib.request.urlopen('http://127.0.0.1:$gw_port/admin/replicas')); print('the replica published', v['published'], 'messages, received', v['received'], 'and applied', v['applied'])"
python3 - "$a0" "$a1" "$b0" "$b1" "$c0" "$c1" "$secs" <<'PY'
import sys
a0, a1, b0, b1, c0, c1, secs = map(float, sys.argv[1:])
alone, sharing, receiving = (a1 - a0) / secs, (b1 - b0) / secs, (c1 - c0) / secs
print(f"replica CPU: alone at 125 req/s {alone * 100:.2f}% of a core; sharing with 7 peers at 875 decisions/s {sharing * 100:.2f}%;"
      f" sharing costs {(sharing - alone) * 100:.2f}% of a core (receiving alone, no own traffic: {receiving * 100:.2f}% in all)")
PY
