#!/usr/bin/env bash
# One device call for the engine issue: GPU tests (kernel path + CUDA graphs), then the end-to-end
# benchmark on the embedded default and on a real-width slice, graphs vs eager. Rows land in $OUT.
set -u
export PYTHONPATH=src OUT=${OUT:-bench_out} TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %H %cd' 2>/dev/null || true
if [ "${RUN_GPU_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25
fi
echo "=== e2e default"
timeout ${BENCH_TIMEOUT:-150} python benchmarks/bench_e2e.py --model default --compare-eager \
  --json "$OUT/e2e_default.json" 2>&1 | grep -v "^{" | tail -15
echo "=== e2e slice"
timeout ${BENCH_TIMEOUT:-240} python benchmarks/bench_e2e.py --model slice --layers ${SLICE_LAYERS:-8} --compare-eager \
  --kv-cache-gib ${SLICE_KV_GIB:-12} --json "$OUT/e2e_slice.json" 2>&1 | grep -v "^{" | tail -15
