#!/usr/bin/env bash
# What sharing reservations costs one replica of 8 at 1,000 decisions a second in all.
#
# Two release replicas run side by side with the same 51 workers (one mock engine that answers, 50
# named ones that do not, so that the peers' changes name 51): `shared` on a nats-server, `alone`
# without a bus. In each round:
#   full:      both serve their own 125 short completions a second, from one load generator that
#              sends to both alike, while 7 emulated peers (crates/gateway/examples/replica_peers.rs)
#              decide the other 875 a second on the bus: `shared` publishes its changes and applies
#              theirs;
#   receiving: the peers' traffic alone, no own traffic.
# Both replicas run at the same time under the same load, so what the machine's other processes
# do to one they do to the other: the difference of their CPU times (from /proc) is what sharing
# costs. Needs nats-server (scripts/setup-nats.sh); builds the release binaries.
# With STREAM_TOKENS=N the own requests stream N tokens each (SSE) instead of answering 4 at once:
# a replica that forwards streams is awake most of the time, and a bus message costs it less than
# it costs an otherwise idle replica (the default, the worst case).
#   scripts/replica-bus-cpu.sh [SECONDS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
rounds=${2:-3}
nats=${KVGATE_NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}
cargo build -q --release -p kvgate
cargo build -q --release -p kvgate-gateway --example replica_peers
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
nats_port=$(free_port)
engine_port=$(free_port)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
"$nats" -a 127.0.0.1 -p "$nats_port" >/dev/null 2>&1 &
pids+=($!)
target/release/kvgate mock-engine --port "$engine_port" --kv-port 0 --replay-port 0 --speedup 50 >/dev/null 2>&1 &
pids+=($!)
workers=(--worker "http://127.0.0.1:$engine_port,id=w0")
for i in $(seq 1 50); do workers+=(--worker "http://127.0.0.1:$((20000 + i)),id=w$i"); done
hz=$(getconf CLK_TCK)
cpu_s() { awk -v hz="$hz" '{print ($14 + $15) / hz}' "/proc/$1/stat"; }

# Sends 125 short completions a second to each port in "$1" (comma-separated) for $2 seconds over
# keep-alive connections; prints how many answered 200.
own_traffic() {
  python3 - "$1" "$2" "${STREAM_TOKENS:-0}" <<'PY'
import http.client, json, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
ports, secs, stream = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2]), int(sys.argv[3])
request = {"model": "mock-model", "prompt": "a short prompt", "max_tokens": stream or 4}
if stream:
    request["stream"] = True
body = json.dumps(request)
local = threading.local()
ok, failed, lock = [0], [0], threading.Lock()
def one(port):
    conns = local.__dict__.setdefault("conns", {})
    try:
        c = conns.get(port) or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conns[port] = c
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        good = r.status == 200
    except Exception:
        conns.pop(port, None)
        good = False
    with lock:
        ok[0] += good
        failed[0] += not good
with ThreadPoolExecutor(32) as pool:
    start, n = time.time(), 0
    while time.time() - start < secs:
        due = int((time.time() - start) * 125)
        while n < due:
            for p in ports:
                pool.submit(one, p)
            n += 1
        time.sleep(0.002)
print(f"own traffic: {ok[0]} answered 200, {failed[0]} did not")
PY
}

# Starts a replica (with the bus if $1 is 1) on a free port, waits until it answers; prints "pid port".
start_replica() {
  local port bus=()
  port=$(free_port)
  if [ "$1" = 1 ]; then bus=(--replica-bus "nats://127.0.0.1:$nats_port" --replica-id measured); fi
  target/release/kvgate serve --port "$port" --admission-wait-s 0 "${bus[@]}" "${workers[@]}" >/dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "$pid $port"
}

peers() { target/release/examples/replica_peers "nats://127.0.0.1:$nats_port" kvgate.reservations 7 875 51 "$secs" >/dev/null; }

results=()
for round in $(seq "$rounds"); do
  read -r shared shared_port < <(start_replica 1)
  read -r alone alone_port < <(start_replica 0)
  pids+=("$shared" "$alone")
  sleep 2 # the first health checks and load polls of 51 workers
  s0=$(cpu_s "$shared"); a0=$(cpu_s "$alone")
  peers &
  peer_pid=$!
  own_traffic "$shared_port,$alone_port" "$secs"
  wait "$peer_pid"
  s1=$(cpu_s "$shared"); a1=$(cpu_s "$alone")
  sleep 1
  s2=$(cpu_s "$shared"); a2=$(cpu_s "$alone")
  peers
  s3=$(cpu_s "$shared"); a3=$(cpu_s "$alone")
  counts=$(python3 -c "import json,urllib.request; v=json.load(urllib.request.urlopen('http://127.0.0.1:$shared_port/admin/replicas')); print(v['published'], v['received'])")
  kill "$shared" "$alone"
  while kill -0 "$shared" 2>/dev/null || kill -0 "$alone" 2>/dev/null; do sleep 0.1; done
  results+=("$round $s0 $s1 $a0 $a1 $s2 $s3 $a2 $a3 $counts")
done

python3 - "$secs" "${results[@]}" <<'PY'
import statistics, sys
secs = float(sys.argv[1])
rows = []
print("| round | full: shared | full: alone | full: sharing costs | receiving: shared | receiving: alone | receiving costs | published | received |")
print("|---|---|---|---|---|---|---|---|---|")
for line in sys.argv[2:]:
    f = line.split()
    r = int(f[0]); s0, s1, a0, a1, s2, s3, a2, a3 = map(float, f[1:9]); published, received = f[9], f[10]
    full_s, full_a = (s1 - s0) / secs * 100, (a1 - a0) / secs * 100
    recv_s, recv_a = (s3 - s2) / secs * 100, (a3 - a2) / secs * 100
    rows.append((full_s - full_a, recv_s - recv_a))
    print(f"| {r} | {full_s:.2f}% | {full_a:.2f}% | **{full_s - full_a:.2f}%** | {recv_s:.2f}% | {recv_a:.2f}% | {recv_s - recv_a:.2f}% | {published} | {received} |")
print(f"median over {len(rows)} rounds of {secs:.0f} s: sharing costs {statistics.median(r[0] for r in rows):.2f}% of a core"
      f" with own traffic, {statistics.median(r[1] for r in rows):.2f}% receiving alone")
PY
