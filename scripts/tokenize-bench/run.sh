#!/usr/bin/env bash
# The gateway's own CPU cost on ~32 KB prompts with a real tokenizer, side by side in one run, in
# front of a static upstream (nginx) that answers at once: SMG 1.13 cache_aware (matches text, no
# tokenizer) and kvgate with the tokenizer three ways:
#   kvgate-routed  tokenizes only as far as routing needs; no engine holds anything here, so that
#                  is up to the first block (a stand-in for a fleet that has not seen the prompts)
#   kvgate-held    the same, with a stand-in engine (publisher.py) holding the shared prefix's
#                  blocks and every growing conversation's, so the held part is tokenized through
#                  (from the prompt cache): for growing-chat, every request's whole prompt
#   kvgate-whole   every prompt tokenized whole through the prompt cache (--tokenize-whole: what a
#                  gRPC worker, which takes every id, costs)
# Workloads: the shared tokenize bench's (a 32 KB prefix shared by all with a unique question, as
# completions and as a chat system prompt; a different 32 KB text each time) and growing-chat
# (workloads.py). Needs nginx and wrk (Debian: nginx-light, wrk), ../shared beside the checkout, and
# the real-engine venv for the publisher (scripts/real-engines/setup.sh).
# Usage: scripts/tokenize-bench/run.sh KVGATE_BIN TOKENIZER_JSON [SMG_BIN] [SECONDS] [CONNECTIONS]
# WORKLOADS="shared-chat ..." runs only those workloads (all four by default); ROUNDS=R runs every
# cell R times, the gateways' order rotated each round, and reports medians (1 by default).
set -u
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
KV=${1:?usage: run.sh KVGATE_BIN TOKENIZER_JSON [SMG_BIN] [SECONDS] [CONNECTIONS]}; TOK=${2:?tokenizer.json}
SMG=${3:-}; D=${4:-8}; C=${5:-16}; ROUNDS=${ROUNDS:-1}
shared=$(cd "$root/../shared" && pwd) || { echo "../shared is missing" >&2; exit 1; }
PY=$root/target/real-engines/venv/bin/python
[ -x "$PY" ] || { echo "$PY is missing: run scripts/real-engines/setup.sh" >&2; exit 1; }
S=$(mktemp -d); UP=39301; PX=39302; KVP=39303
for port in $UP $PX $KVP 39310 29311 39311 39312 39313; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "port $port is in use: is an earlier run still stopping?" >&2; exit 1; fi
done
python3 "$shared/tools/tokenize-bench/make_workloads.py" "$S" || exit 1
python3 "$here/workloads.py" "$S" || exit 1
sed -e "s#SCRATCH#$S#g" -e "s#UPSTREAM#$UP#g" -e "s#PROXY#$PX#g" "$shared/tools/proxy-bench/nginx.conf.template" \
  | sed -e 's#access_log off;#access_log off; client_body_buffer_size 1m;#' > "$S/nginx.conf"
nginx -c "$S/nginx.conf" || exit 1
pids=(); names=(); ports=()
cleanup() {
  # SMG takes a while to stop; one still stopping holds its ports against the next run's.
  for p in "${pids[@]}"; do pkill -P "$p" 2>/dev/null; kill "$p" 2>/dev/null; done
  for _ in $(seq 50); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 0.1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  kill "$(cat "$S/nginx.pid")" 2>/dev/null
}
trap cleanup EXIT
template=$shared/tools/tokenize-bench/chatml.jinja
up() {  # NAME PORT ARGS...: starts a kvgate
  local name=$1 port=$2; shift 2
  "$KV" serve --host 127.0.0.1 --port "$port" --block-size 16 --tokenizer "$TOK" --chat-template "$template" "$@" >"$S/$name.log" 2>&1 &
  pids+=($!); names+=("$name"); ports+=("$port")
}
ready() {  # PORT
  local body='{"model":"fake-model","prompt":"hi","max_tokens":8}'
  for _ in $(seq 60); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' -m 2 -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$1/v1/completions")" = 200 ] && return 0
    sleep 0.5
  done
  echo "gateway on port $1 did not come up" >&2; return 1
}
if [ -n "$SMG" ]; then
  "$SMG" launch --host 127.0.0.1 --port 39310 --prometheus-port 29311 --worker-urls "http://127.0.0.1:$UP" --policy cache_aware --log-level warn >"$S/smg.log" 2>&1 &
  pids+=($!); names+=(smg-cache_aware); ports+=(39310)
fi
up kvgate-routed 39311 --worker "http://127.0.0.1:$UP"
up kvgate-whole 39312 --worker "http://127.0.0.1:$UP" --tokenize-whole
for port in "${ports[@]}"; do ready "$port" || exit 1; done
# The held prefixes' ids, as kvgate computes them (the first question of each shared workload).
prefix=$(python3 -c "import sys; s=open(sys.argv[1]).read(); print(s[s.index('[[')+2:s.index(']]')], end='')" "$S/shared-completion.lua")
python3 - "$prefix" > "$S/held-bodies.txt" <<'PYEOF'
import json, sys
p = sys.argv[1]
print(json.dumps({"prompt": p + " question 1 about the text"}))
print(json.dumps({"messages": [{"role": "system", "content": p}, {"role": "user", "content": "question 1 about the text"}]}))
PYEOF
# And each growing conversation's longest request, which every shorter one of it starts with.
cat "$S/growing-held-bodies.txt" >> "$S/held-bodies.txt"
k=0; held=()
while read -r body; do
  k=$((k + 1))
  curl -s -H 'content-type: application/json' -d "$body" http://127.0.0.1:39311/admin/tokenize > "$S/held-$k.json"
  held+=("$S/held-$k.json")
done < "$S/held-bodies.txt"
"$PY" "$here/publisher.py" "tcp://127.0.0.1:$KVP" 16 "${held[@]}" > "$S/publisher.log" 2>&1 &
pids+=($!)
up kvgate-held 39313 --worker "http://127.0.0.1:$UP,engine=vllm,kv_events=tcp://127.0.0.1:$KVP"
ready 39313 || exit 1
for _ in $(seq 40); do grep -q joined "$S/publisher.log" && break; sleep 0.25; done
grep -q joined "$S/publisher.log" || { echo "kvgate-held never subscribed to the stand-in engine" >&2; exit 1; }
sleep 1
blocks=$(curl -s http://127.0.0.1:39313/metrics | awk '/^kvgate_engine_blocks_held/{n+=$NF} END{print n+0}')
echo "kvgate-held's index holds $blocks blocks of the shared prefixes and the conversations"
[ "$blocks" -gt 0 ] || { echo "kvgate-held holds no block: the stand-in engine's events never arrived" >&2; exit 1; }
# Each round runs every workload on every gateway, the gateways' order rotated a place a round;
# the table gives each cell's median over the rounds (these machines are noisy).
n=${#ports[@]}
for r in $(seq "$ROUNDS"); do
  for w in ${WORKLOADS:-shared-completion shared-chat unique-completion growing-chat}; do
    for i in $(seq 0 $((n - 1))); do
      k=$(((i + r - 1) % n))
      timeout $((D + 30)) wrk -t1 -c"$C" -d"${D}s" --latency -s "$S/$w.lua" "http://127.0.0.1:${ports[$k]}/" |
        awk -v n="${names[$k]}" -v w="$w" -v r="$r" '
          function ms(v) { if (v ~ /us$/) return v / 1000; if (v ~ /ms$/) return v + 0; if (v ~ /s$/) return v * 1000; return v }
          / 50%/{p50=ms($2)} / 99%/{p99=ms($2)} /Requests\/sec/{q=$2} /Non-2xx/{e=$NF}
          END{printf "%s %s %s %.0f %.2f %.2f %d\n", r, w, n, q, p50, p99, (e==""?0:e)}' | tee -a "$S/cells.txt"
    done
  done
done
echo "medians over $ROUNDS round(s): workload, gateway, req/s (over SMG's), p50 ms, p99 ms, non-2xx"
python3 - "$S/cells.txt" <<'PYEOF'
import statistics, sys
cells = {}
for line in open(sys.argv[1]):
    _, w, n, q, p50, p99, e = line.split()
    cells.setdefault((w, n), []).append((float(q), float(p50), float(p99), int(e)))
med = {k: [statistics.median(x[i] for x in v) for i in range(3)] + [sum(x[3] for x in v)] for k, v in cells.items()}
for (w, n), (q, p50, p99, e) in med.items():
    smg = med.get((w, "smg-cache_aware"))
    ratio = f" ({q / smg[0]:.2f}x)" if smg and n != "smg-cache_aware" else ""
    print(f"{w:<18} {n:<16} {q:>8.0f}{ratio:<9} p50 {p50:6.2f}  p99 {p99:6.2f}  non-2xx {e}")
PYEOF
for port in 39311 39312 39313; do
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^kvgate_tokenize_(partial_prompts|estimate_ratio_(sum|count)|cache_(hits|misses|miss_bytes)_total)" | sed "s/^/  port $port: /"
done
