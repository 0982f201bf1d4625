#!/usr/bin/env bash
# A small chat request's latency through kvgate (a real tokenizer) alone, and while 16 connections
# send 32 KB prompts that no cache holds (the tokenize bench's unique-completion workload). By
# default the prompt cache is off, so every long prompt is tokenized whole (the worst case, and
# what --tokenize-whole or a gRPC worker costs); ROUTED=1 keeps it on, and the long prompts are
# tokenized only as far as routing needs. HOG=1 (with ROUTED=1) adds the control: a busy loop
# outside kvgate, 10 nice steps down like kvgate's tokenizing threads, takes a core while the long
# prompts flow, so the small request shares the machine with as much CPU work at that priority as
# whole tokenization does, but none of it in kvgate; LONG=0 sends no long prompts (with HOG=1: the
# busy loop alone beside the small request). Needs nginx and wrk (Debian: nginx-light, wrk) and
# ../shared beside the checkout.
# Usage: [ROUTED=1] [HOG=1] [LONG=0] [ROUNDS=R] scripts/small-beside-long.sh KVGATE_BIN TOKENIZER_JSON
# Each round measures the small request alone, then beside the long prompts; with ROUNDS (default
# 2) over 2 it ends with the medians over the rounds.
set -u
KV=${1:?usage: small-beside-long.sh KVGATE_BIN TOKENIZER_JSON}; TOK=${2:?tokenizer.json}
shared=$(cd "$(dirname "$0")/../../shared" && pwd) || { echo "../shared is missing" >&2; exit 1; }
S=$(mktemp -d); UP=39201; PX=39202
python3 $shared/tools/tokenize-bench/make_workloads.py "$S" || exit 1
sed -e "s#SCRATCH#$S#g" -e "s#UPSTREAM#$UP#g" -e "s#PROXY#$PX#g" $shared/tools/proxy-bench/nginx.conf.template \
  | sed -e 's#access_log off;#access_log off; client_body_buffer_size 1m;#' > "$S/nginx.conf"
nginx -c "$S/nginx.conf" || exit 1
cache_mib=0; [ "${ROUTED:-0}" = 1 ] && cache_mib=64
KVGATE_TOKENIZE_CACHE_MIB=$cache_mib "$KV" serve --host 127.0.0.1 --port 39210 --worker "http://127.0.0.1:$UP" --tokenizer "$TOK" --chat-template $shared/tools/tokenize-bench/chatml.jinja >"$S/kv.log" 2>&1 &
kv=$!
body='{"model":"fake-model","prompt":"hi","max_tokens":8}'
for _ in $(seq 60); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' -m 2 -H 'content-type: application/json' -d "$body" "http://127.0.0.1:39210/v1/completions")" = 200 ] && break
  sleep 0.5
done
cat > "$S/small.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"fake-model","messages":[{"role":"user","content":"Say hello in one short sentence."}],"max_tokens":8}'
wrk.path = "/v1/chat/completions"
LUA
# wrk prints latencies with units; the summary wants milliseconds.
ms() { awk '{v=$1; if (v ~ /us$/) {sub(/us$/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v*=1000} printf "%.3f\n", v}'; }
small() { wrk -t1 -c4 -d8s --latency -s "$S/small.lua" http://127.0.0.1:39210/ | awk -v n="$1" '/ 50%/{p50=$2} / 99%/{p99=$2} /Requests\/sec/{r=$2} END{printf "%-34s req/s %9s  p50 %9s  p99 %9s\n", n, r, p50, p99}' | tee -a "$S/small.out"; }
for round in $(seq "${ROUNDS:-2}"); do
  small "small alone"
  : > "$S/big.out"
  if [ "${LONG:-1}" = 0 ]; then
    sleep 12 &
  else
    wrk -t1 -c16 -d12s -s "$S/unique-completion.lua" http://127.0.0.1:39210/ > "$S/big.out" 2>&1 &
  fi
  big=$!
  hog=
  if [ "${HOG:-0}" = 1 ]; then
    nice -n 10 sh -c 'while :; do :; done' &
    hog=$!
  fi
  sleep 2
  small "small beside 32 KB prompts (misses)"
  wait $big
  [ -z "$hog" ] || kill "$hog"
  awk '/Requests\/sec/{print "  32 KB prompts meanwhile: req/s " $2}' "$S/big.out" | tee -a "$S/small.out"
done
median() { sort -n | awk '{v[NR]=$1} END{print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
if [ "${ROUNDS:-2}" -gt 2 ]; then
  alone=$(grep '^small alone' "$S/small.out" | awk '{print $NF}' | ms | median)
  beside=$(grep '^small beside' "$S/small.out" | awk '{print $NF}' | ms | median)
  long=$(grep 'prompts meanwhile' "$S/small.out" | awk '{print $NF}' | median)
  echo "medians over ${ROUNDS} rounds: small p99 alone $alone ms, beside $beside ms (+$(awk -v a="$alone" -v b="$beside" 'BEGIN{printf "%.2f", b-a}') ms); long prompts $long req/s"
fi
kill $kv; kill "$(cat "$S/nginx.pid")"
