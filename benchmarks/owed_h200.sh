#!/usr/bin/env bash
# The H200 runs issues 19 and 21 still owe (RESULTS.md G1, K1b, K5o), as one device call of ~560 s:
#   1. pytest -m gpu tests/gpu from a cold Triton cache (and benchmarks/diag_async.py if the async test fails);
#   2. GDN prefill vs fla 0.6.0 at 1x8K / 1x32K, bf16 and fp16, with the pipeline_lead variants (fla's wheels on
#      PYTHONPATH: flash-linear-attention and fla-core 0.6.0);
#   3. the AWQ MoE at 8 / 40 fp16 tokens with the variants aimed at the H200's gap.
# Usage there: OUT=... PYTHONPATH=src:<wheels> bash benchmarks/owed_h200.sh
set -o pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"; export OUT
T0=$(date +%s)
export TRITON_CACHE_DIR=$(mktemp -d)
timeout 250 python3 -m pytest -m gpu tests/gpu -q -n 8 --dist loadfile -p no:cacheprovider -rfEs > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests.log" | tail -25
grep -q "FAILED.*async" "$OUT/gpu_tests.log" && timeout 100 python3 benchmarks/diag_async.py 2>&1 | tail -12
export TRITON_CACHE_DIR=$(mktemp -d)
GDN_STAGES=k1_prefill,k1_variants GDN_SHAPES=1x8K,1x32K GDN_VARIANTS=default,pipe2_lead60,pipe2_lead70,pipe3_lead50 \
  timeout "${GDN_LIMIT:-170}" python3 benchmarks/bench_gdn.py > "$OUT/gdn.log" 2>&1; echo "gdn rc=$? $(( $(date +%s) - T0 )) s"
python3 benchmarks/gdn_rows.py
[ $(( $(date +%s) - T0 )) -lt 440 ] && timeout "${MOE_LIMIT:-75}" python3 benchmarks/bench_quant.py --moe --moe-ms 8,40 \
  --moe-dtypes fp16 --moe-variants pdl,pdl-b64,fx,fx-pdl,pdl-sd2x,pdl-su2x,pdl-eo > "$OUT/moe.log" 2>&1
echo "moe rc=$? $(( $(date +%s) - T0 )) s"; tail -40 "$OUT/moe.log"
