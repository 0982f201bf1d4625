#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser that reads outside bytes (fuzz/fuzz_targets), on stable
# Rust: libFuzzer (the libfuzzer-sys crate builds it with the system's C++ compiler) driven by the
# compiler's own sanitizer-coverage passes, which is what cargo-fuzz does without its nightly-only
# sanitizers. Debug assertions and overflow checks stay on.
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
#   SECONDS per target (default 60); 0 replays the corpus only. All targets when none is named.
#   FUZZ_MERGE=1 rewrites the corpus kept in the repo (fuzz/corpus/TARGET) as the smallest set of
#   inputs, old and new, that covers what they all cover; otherwise new inputs stay under
#   target/fuzz/new/TARGET.
#
# Each input may take at most 1 s and allocate at most 512 MiB at once (libFuzzer's -timeout and
# -malloc_limit_mb); a panic, an abort, a hang or a larger allocation fails the run, and the input
# is kept under target/fuzz/artifacts/TARGET for `target/fuzz/<triple>/release/TARGET FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
all=(kv_events zmtp prometheus engine_json openai_request workers_file replica_message grpc_message)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")

# libfuzzer-sys compiles libFuzzer, which is C++.
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || { echo "fuzz.sh: a C++ compiler is needed to build libFuzzer (g++ or clang++)" >&2; exit 1; }
  sudo=""; [ "$(id -u)" != 0 ] && sudo="sudo"
  echo "installing g++ from Debian's packages (libFuzzer is C++)"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q g++ >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q g++ >/dev/null
  }
fi
python3 fuzz/seed.py
triple=$(rustc -vV | sed -n 's/^host: //p')
# Only the fuzz targets' code is instrumented: --target keeps RUSTFLAGS off build scripts and
# procedural macros, which libFuzzer does not link into.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
export CARGO_TARGET_DIR=target/fuzz
export CARGO_INCREMENTAL=0
cargo build --quiet --release --locked --manifest-path fuzz/Cargo.toml --target "$triple" --bins

failed=()
for t in "${targets[@]}"; do
  bin="target/fuzz/$triple/release/$t"
  [ -x "$bin" ] || { echo "fuzz: no target named $t (targets: ${all[*]})" >&2; exit 2; }
  new="target/fuzz/new/$t"
  artifacts="target/fuzz/artifacts/$t"
  mkdir -p "$new" "$artifacts" "fuzz/corpus/$t"
  limits=(-timeout=1 -rss_limit_mb=2048 -malloc_limit_mb=512 -artifact_prefix="$artifacts/" -print_final_stats=1)
  log="target/fuzz/$t.log"
  if [ "$secs" = 0 ]; then
    run=("$bin" "${limits[@]}" -runs=0 "fuzz/corpus/$t")
  else
    run=("$bin" "${limits[@]}" -max_total_time="$secs" "$new" "fuzz/corpus/$t")
  fi
  if "${run[@]}" > "$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    echo "fuzz $t: ${execs:-?} inputs, $cov, corpus $(ls "fuzz/corpus/$t" | wc -l) + $(ls "$new" | wc -l) new"
  else
    echo "fuzz $t: FAILED; the input is under $artifacts, the log at $log:" >&2
    grep -E "ERROR|panicked|SUMMARY|Test unit written" "$log" | head -20 >&2 || tail -20 "$log" >&2
    failed+=("$t")
  fi
  if [ "${FUZZ_MERGE:-0}" = 1 ] && [ "$secs" != 0 ]; then
    merged=$(mktemp -d)
    "$bin" "${limits[@]}" -set_cover_merge=1 "$merged" "fuzz/corpus/$t" "$new" > "target/fuzz/$t.merge.log" 2>&1
    rm -rf "fuzz/corpus/$t" && mv "$merged" "fuzz/corpus/$t" && chmod 755 "fuzz/corpus/$t"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}" >&2
  exit 1
fi
