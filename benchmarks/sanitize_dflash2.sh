#!/usr/bin/env bash
# DFlash2 rounds through the speculative verify / commit CUDA graphs under compute-sanitizer (issue 19 item 6).
#
# The reverted attempt (benchmarks/RESULTS.md S2b) hit a CUDA illegal memory access in
# tests/gpu/test_spec_graphs_gpu.py::test_graph_rounds_equal_eager_rounds[dflash2-replay] on 2 of 3 runs of the
# whole GPU directory from a cold Triton cache. Every pass here starts from a fresh TRITON_CACHE_DIR.
#
#   benchmarks/sanitize_dflash2.sh [memcheck|exact|cold3|all]    (default: all; K=... picks the memcheck tests)
#
#   memcheck  the graph-round tests (MTP and DFlash2: per-draft slots and replay, C1 and C8) under
#             `compute-sanitizer --tool memcheck` with torch's caching allocator. memcheck only sees the
#             allocator's cudaMalloc segments: an access just past one tensor into its neighbour is invisible.
#   exact     the same under memcheck with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: every tensor is its own
#             stream-ordered allocation, which memcheck tracks, so a few bytes out of bounds are reported.
#   cold3     the whole GPU directory (`pytest -m gpu tests/gpu`) three times, each from a cold Triton cache,
#             without the sanitizer (the failure's own setting).
# WARM=1: each memcheck / exact pass first runs its tests without the sanitizer into its fresh cache, so the
# sanitized run loads the kernels instead of compiling them under memcheck (a cold C8 test did not finish in 320 s
# that way, 2026-12-06); the replays the sanitizer checks are the same.
# Prints one line per pass and exits non-zero when any failed; logs in ${OUT:-.}/sanitize_dflash2/.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
LOGS=${OUT:-.}/sanitize_dflash2
mkdir -p "$LOGS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "sanitize_dflash2.sh needs a CUDA device (the tests would only be skipped)" >&2
  exit 2
fi
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
TESTS="tests/gpu/test_spec_graphs_gpu.py::test_graph_rounds_equal_eager_rounds"
K=${K:-dflash2}  # pytest -k of the memcheck passes (memcheck is slow; K=replay, K="dflash2 and C8", K=mtp ...)
status=0

run_pass() {  # name, then the command; a fresh Triton cache for each pass
  local name=$1
  shift
  local cache
  cache=$(mktemp -d)
  case "$name:${WARM:-0}" in
    memcheck:1 | exact:1)  # compile the selected tests' kernels without the sanitizer first
      TRITON_CACHE_DIR=$cache python -m pytest -q -p no:cacheprovider -m gpu "$TESTS" -k "$K" \
        >"$LOGS/$name.warm.log" 2>&1
      ;;
  esac
  local start=$SECONDS
  TRITON_CACHE_DIR=$cache "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  rm -rf "$cache"
  local errors
  errors=$(grep -c "Invalid __global__\|Invalid __shared__\|illegal memory access" "$LOGS/$name.log")
  printf "| %-10s | rc %3d | %5ds | sanitizer/illegal-access lines %s | %s |\n" "$name" "$rc" $((SECONDS - start)) \
    "$errors" "$(grep -E "passed|failed|error|skipped" "$LOGS/$name.log" | tail -1)"
  [ "$rc" -eq 0 ] || status=1
}

memcheck() {  # NAME=VALUE settings for the run: the graph-round tests selected by $K under memcheck
  env "$@" "$CS" --tool memcheck --error-exitcode 99 --print-limit 50 --target-processes all \
    python -m pytest -q -p no:cacheprovider -m gpu "$TESTS" -k "$K" -rA
}

echo "| pass | exit | time | memcheck errors | pytest |"
echo "| --- | --- | --- | --- | --- |"
if [ "$MODE" = memcheck ] || [ "$MODE" = all ]; then
  run_pass memcheck memcheck REVOLTA_SANITIZE_PASS=memcheck
fi
if [ "$MODE" = exact ] || [ "$MODE" = all ]; then
  run_pass exact memcheck PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
fi
if [ "$MODE" = cold3 ] || [ "$MODE" = all ]; then
  for i in 1 2 3; do
    run_pass "cold-$i" python -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rf
  done
fi
exit $status
