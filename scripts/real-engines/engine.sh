#!/usr/bin/env bash
# Starts or stops one real engine (vLLM or SGLang, on the CPU) serving the tiny model, in its own
# process group.
#
#   scripts/real-engines/engine.sh start NAME PORT KV_ENDPOINT REPLAY_PORT KV_TOKENS [RUN_DIR] [RUNTIME] [TRANSPORT] [TASK]
#   scripts/real-engines/engine.sh stop NAME [RUN_DIR]
#   scripts/real-engines/engine.sh wait NAME PORT [TIMEOUT_S] [RUN_DIR]
#
# RUNTIME is `vllm` (the default) or `sglang`. TRANSPORT is `http` (the default: the engine's own
# OpenAI server) or `grpc`: SMG's gRPC worker protocol on PORT, served by `smg-grpc-servicer`
# (vLLM's `vllm.entrypoints.launchers.grpc_server`, SGLang's `--smg-grpc-mode`), with the servicers'
# warm-up off (SGLang's assumes a 128k vocabulary and crashes the tiny model's scheduler) and no HTTP
# server; `wait` then asks the standard gRPC health service. KV_ENDPOINT is the engines' own `endpoint` form (both
# share the publisher code): `tcp://*:P` binds the engine's PUB socket (kvgate connects);
# `tcp://127.0.0.1:P` makes the engine connect (kvgate must bind). The replay socket is always bound
# by the engine. KV_TOKENS is the KV cache size in tokens (8192 is 256 blocks of 32); the longest
# prompt is capped at what fits, less one block (at most 4,096 tokens). SGLang takes it as
# --max-total-tokens; vLLM as --kv-cache-memory-bytes, at the tiny model's bytes a token for the dtype.
# TASK is `generate` (the default) or `embed`: the tiny model served as an embedding model
# (vLLM's --runner pooling --convert embed, SGLang's --is-embedding), for /v1/embeddings and Embed.
#
# The engines compute in float32 (KVGATE_ENGINE_DTYPE; bfloat16, the model's own, for `embed`).
# On CPUs without AVX-512 BF16, bfloat16 is emulated and slow: on the 2-core AVX2 machine of
# 2026-12-07 one 2,048-token prefill took 320 ms in bfloat16 and 140 ms in float32 on vLLM, 270 and
# 112 ms on SGLang. A paced step must outlast the engine's own compute, so the cheaper the better.
#
# vLLM flags beyond the basics: --enforce-eager (no graph capture: starts in ~25 s instead of ~40 s),
# --trust-request-chat-template (tests render other templates through /tokenize), and
# --enable-prompt-tokens-details (usage reports cached_tokens, the engine's own cache hits); and
# VLLM_SERVER_DEV_MODE=1 for POST /reset_prefix_cache (the demo empties caches between runs with it).
#
# `start` returns at once; `wait` polls /health and /v1/models until the engine serves, failing
# early (with the log's tail) if the process dies.
#
# SGLang runs its CPU engine (SGLANG_USE_CPU_ENGINE=1, --device cpu, the torch_native attention
# backend) with the import-only `sgl_kernel` stand-in on PYTHONPATH; any call to the stand-in is
# recorded in RUN_DIR/sgl_kernel-calls.log, which the suite requires to stay absent. Its page size is
# the block size (32), --enable-metrics serves `sglang:*` on /metrics, --enable-cache-report puts
# `cached_tokens` in usage, --sleep-on-idle parks an idle scheduler on its sockets (by default it
# polls them without pause: while a trial loaded one engine of the suite's fleet, top showed three
# SGLang schedulers at 31-69% of a core each), and its KV events get the same endpoint, replay socket and topic as vLLM's. The pid of the process group leader is in
# RUN_DIR/NAME.pid, its log in RUN_DIR/NAME.log. `stop` sends SIGTERM to the whole group, then
# SIGKILL after 10 s. Everything lives under target/ (default RUN_DIR: target/real-engines/run).
#
# Paced like a GPU (scripts/real-engines/pacer/kvgate_pacer.py): with KVGATE_PACE_PROFILE set (the JSON
# that `kvgate profile NAME` prints) each scheduler step takes the profile's step time for its batch,
# times KVGATE_PACE_SCALE (default 1); each step is logged to RUN_DIR/NAME.pace.jsonl unless
# KVGATE_PACE_LOG names another file.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
model="$root/target/real-engines/model"
cmd="${1:?usage: engine.sh start|stop|wait NAME ...}"
name="${2:?engine name}"

# Whether any live (non-zombie) process is in process group $1. `kill -0` also counts zombies, which
# linger when nothing reaps the engine's orphaned children.
# (cat, not awk, opens the files: processes come and go during the scan, and awk would stop at the
# first one that vanished. cat then fails, and under pipefail its failure was the pipeline's: with
# other processes starting and ending, the group read as gone, `stop` sent no signal and deleted the
# pid file, and the engine ran on with nothing left to stop it. awk reads to the end, so that cat
# never dies of SIGPIPE.)
group_alive() {
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } |
    awk -v g="$1" '{ sub(/^.*\) /, ""); if ($3 == g && $1 != "Z") found = 1 } END { exit !found }'
}

# Whether engine $1 (its group leader's pid) lives: the leader itself (which may not have called
# setsid yet right after `start`) or any process of its group.
engine_alive() {
  local state
  state=$(sed -e 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  { [ -n "$state" ] && [ "$state" != Z ]; } || group_alive "$1"
}

stop_group() {
  local pidfile="$1"
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  if group_alive "$pid"; then
    kill -s TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
      group_alive "$pid" || break
      sleep 0.1
    done
    kill -s KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

case "$cmd" in
  start)
    port="${3:?port}"; kv_endpoint="${4:?kv endpoint}"; replay_port="${5:?replay port}"; kv_tokens="${6:?kv tokens}"
    run="${7:-$root/target/real-engines/run}"
    runtime="${8:-vllm}"
    transport="${9:-http}"
    task="${10:-generate}"
    case "$transport" in
      http|grpc) ;;
      *) echo "engine.sh: unknown transport $transport (http or grpc)" >&2; exit 2 ;;
    esac
    # embed: the same model served as an embedding model (it pools its last hidden state).
    case "$task" in
      generate) vllm_task=(); sglang_task=() ;;
      embed) vllm_task=(--runner pooling --convert embed); sglang_task=(--is-embedding) ;;
      *) echo "engine.sh: unknown task $task (generate or embed)" >&2; exit 2 ;;
    esac
    case "$runtime" in
      vllm) venv="$root/target/real-engines/venv" ;;
      sglang) venv="$root/target/real-engines/sglang-venv" ;;
      *) echo "engine.sh: unknown runtime $runtime (vllm or sglang)" >&2; exit 2 ;;
    esac
    [ -x "$venv/bin/python" ] || { echo "engine.sh: no $runtime venv at $venv; run scripts/real-engines/setup.sh" >&2; exit 1; }
    [ -f "$model/config.json" ] || { echo "engine.sh: no model at $model; run scripts/real-engines/setup.sh" >&2; exit 1; }
    mkdir -p "$run/$name.cache" "$run/$name.tmp"
    stop_group "$run/$name.pid"
    # What `wait` asks: the OpenAI server, or the gRPC health service with this venv's grpcio.
    if [ "$transport" = grpc ]; then echo "$venv" > "$run/$name.grpc"; else rm -f "$run/$name.grpc"; fi
    # The tiny model's KV a token: 2 layers x K and V x 2 KV heads x 32 dims x the dtype's bytes.
    # An embedding engine keeps the model's bfloat16: it is never paced, and in float32 SGLang's
    # vectors of a multi-input request differed in their last digits (relative 3e-5) between its own
    # server and its gRPC worker, where the suite holds them equal bit for bit (CI, 2026-12-08).
    default_dtype=float32
    [ "$task" = embed ] && default_dtype=bfloat16
    dtype="${KVGATE_ENGINE_DTYPE:-$default_dtype}"
    case "$dtype" in
      float32) kv_token_bytes=1024 ;;
      bfloat16|float16) kv_token_bytes=512 ;;
      *) echo "engine.sh: unknown KVGATE_ENGINE_DTYPE $dtype (float32, bfloat16 or float16)" >&2; exit 2 ;;
    esac
    kv_bytes=$((kv_tokens * kv_token_bytes))
    # The longest sequence must fit the KV cache with a block to spare, or vLLM refuses to start.
    max_len=$((kv_tokens - 32))
    [ "$max_len" -gt 4096 ] && max_len=4096
    # Pacing: the pacer's sitecustomize goes first on PYTHONPATH, so every process of the engine
    # (the API server and the engine core it spawns) loads it.
    pythonpath=""
    if [ -n "${KVGATE_PACE_PROFILE:-}" ]; then
      pythonpath="$root/scripts/real-engines/pacer"
      export KVGATE_PACE_LOG="${KVGATE_PACE_LOG:-$run/$name.pace.jsonl}"
      rm -f "$KVGATE_PACE_LOG"
    fi
    kv_config=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "%s", "replay_endpoint": "tcp://*:%s", "topic": "kv"}' "$kv_endpoint" "$replay_port")
    # setsid: the engine and every process it forks share one process group, stopped as one.
    # Niced, in its own scheduler autogroup as well (setsid makes one, and a process's nice counts
    # only within its group): three busy engines on 2 cores otherwise starve the suite's process,
    # kvgate included, for seconds at a time (a process beside the suite stalled 52 times over 0.3 s,
    # 27 s in all, in three suites; niced, not once in seven).
    # kvgate runs on CPUs of its own in a deployment; here it must not wait behind the engines.
    # OMP binding off and one thread each, or every engine of a fleet pins itself to core 0.
    niced=(setsid sh -c 'echo 10 > /proc/self/autogroup 2>/dev/null || true; exec nice -n 10 "$@"' engine)
    if [ "$runtime" = vllm ] && [ "$transport" = grpc ]; then
      env -u VLLM_CPU_KVCACHE_SPACE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        SMG_VLLM_SERVICER_WARMUP=off PYTHONPATH="$pythonpath" \
        VLLM_CACHE_ROOT="$run/$name.cache" TMPDIR="$run/$name.tmp" \
        VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
        "${niced[@]}" "$venv/bin/python" -m vllm.entrypoints.launchers.grpc_server \
          --model "$model" --served-model-name tiny --host 127.0.0.1 --port "$port" \
          --enable-prefix-caching --block-size 32 --max-model-len "$max_len" --enforce-eager --dtype "$dtype" \
          --kv-cache-memory-bytes "$kv_bytes" "${vllm_task[@]}" \
          --kv-events-config "$kv_config" > "$run/$name.log" 2>&1 < /dev/null &
    elif [ "$runtime" = vllm ]; then
      env -u VLLM_CPU_KVCACHE_SPACE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        VLLM_SERVER_DEV_MODE=1 PYTHONPATH="$pythonpath" \
        VLLM_CACHE_ROOT="$run/$name.cache" TMPDIR="$run/$name.tmp" \
        VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
        "${niced[@]}" "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
          --model "$model" --served-model-name tiny --host 127.0.0.1 --port "$port" \
          --enable-prefix-caching --block-size 32 --max-model-len "$max_len" --enforce-eager --dtype "$dtype" \
          --kv-cache-memory-bytes "$kv_bytes" --trust-request-chat-template --enable-prompt-tokens-details \
          "${vllm_task[@]}" --kv-events-config "$kv_config" > "$run/$name.log" 2>&1 < /dev/null &
    else
      # SGLang's KV pool is sized in tokens; the same bytes hold the same tokens as vLLM's.
      sglang_kv_config=$(printf '{"publisher": "zmq", "endpoint": "%s", "replay_endpoint": "tcp://*:%s", "topic": "kv"}' "$kv_endpoint" "$replay_port")
      # In gRPC mode, /metrics would take PORT + 1, which may be another engine's: no metrics.
      sglang_mode=(--enable-metrics)
      [ "$transport" = grpc ] && sglang_mode=(--smg-grpc-mode)
      # Paced, SGLang runs its normal loop (kvgate_pacer.py's _pace_sglang says why).
      [ -n "$pythonpath" ] && sglang_mode+=(--disable-overlap-schedule)
      env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 SGLANG_USE_CPU_ENGINE=1 SMG_SGLANG_SERVICER_WARMUP=off \
        PYTHONPATH="${pythonpath:+$pythonpath:}$root/scripts/real-engines/sglang-stand-in" KVGATE_SGL_KERNEL_LOG="$run/sgl_kernel-calls.log" \
        OMP_NUM_THREADS=1 \
        TMPDIR="$run/$name.tmp" XDG_CACHE_HOME="$run/$name.cache" TRITON_CACHE_DIR="$run/$name.cache/triton" \
        "${niced[@]}" "$venv/bin/python" -m sglang.launch_server \
          --model-path "$model" --served-model-name tiny --host 127.0.0.1 --port "$port" \
          --device cpu --attention-backend torch_native --page-size 32 \
          --max-total-tokens "$kv_tokens" --context-length "$max_len" --dtype "$dtype" \
          "${sglang_mode[@]}" "${sglang_task[@]}" --enable-cache-report --skip-server-warmup --trust-request-chat-template --sleep-on-idle \
          --kv-events-config "$sglang_kv_config" > "$run/$name.log" 2>&1 < /dev/null &
    fi
    echo $! > "$run/$name.pid"
    ;;
  wait)
    port="${3:?port}"; timeout_s="${4:-240}"; run="${5:-$root/target/real-engines/run}"
    pid=$(cat "$run/$name.pid")
    for _ in $(seq 1 $((timeout_s * 2))); do
      if ! engine_alive "$pid"; then
        echo "engine.sh: engine $name exited during start-up; the first errors in $run/$name.log:" >&2
        # The root cause comes first; the tail is mostly the API server's traceback of the exit.
        grep -n -m 12 -E "Error|Exception|error:|Traceback" "$run/$name.log" >&2 || true
        echo "engine.sh: the end of $run/$name.log:" >&2
        tail -n 30 "$run/$name.log" >&2
        exit 1
      fi
      if [ -f "$run/$name.grpc" ]; then
        if "$(cat "$run/$name.grpc")/bin/python" - "$port" 2>/dev/null <<'PY'
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

channel = grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}")
answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
sys.exit(0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1)
PY
        then
          exit 0
        fi
      elif curl -fsS "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; then
        exit 0
      fi
      sleep 0.5
    done
    echo "engine.sh: engine $name not ready on port $port after ${timeout_s}s; the end of $run/$name.log:" >&2
    tail -n 30 "$run/$name.log" >&2
    exit 1
    ;;
  stop)
    run="${3:-$root/target/real-engines/run}"
    stop_group "$run/$name.pid"
    ;;
  *)
    echo "engine.sh: unknown command $cmd (start, wait or stop)" >&2
    exit 2
    ;;
esac
