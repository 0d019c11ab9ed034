#!/usr/bin/env bash
# One device call: GPU tests, then the kernel benchmarks named in $1 (default: gdn).
# Usage on the lent H200:  bash benchmarks/run_h200.sh "gdn qsa moe_hc"
set -u
export PYTHONPATH=src OUT=${OUT:-bench_out} TRITON_DEFAULT_FP_FUSION=1
mkdir -p "$OUT"
if ls .device_wheels/*.whl >/dev/null 2>&1; then  # flash-linear-attention, the GDN peer (pure Python + Triton)
  for w in .device_wheels/*.whl; do python -m zipfile -e "$w" /tmp/peers; done
  export PYTHONPATH=src:/tmp/peers
  python -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %H %cd' 2>/dev/null || true
if [ "${RUN_GPU_TESTS:-1}" = 1 ]; then
  timeout 200 python -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -15
fi
for b in ${1:-gdn}; do
  echo "=== bench_$b"
  timeout ${BENCH_TIMEOUT:-240} python benchmarks/bench_$b.py 2>&1 | tail -60
done
