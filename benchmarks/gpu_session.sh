#!/usr/bin/env bash
# One device call: install (TVM from the carried kit), GPU tests, then the benchmarks; logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/tile_ops_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TILE_OPS_CACHE_DIR=${TILE_OPS_CACHE_DIR:-/tmp/tile_ops_cache}
[ -d .tvmkit ] && source .tvmkit/install.sh
pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python -m pytest ${TESTS:-tests} -m gpu -q -n 8 -x --timeout 300 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python benchmarks/bench_gemm.py ${BENCH_ARGS:---configs} --json "$OUT/gemm.json" 2>&1 | tee "$OUT/bench_gemm.log" | tail -16
python benchmarks/bench_gemm_softmax.py --json "$OUT/gemm_softmax.json" 2>&1 | tee "$OUT/bench_softmax.log" | tail -9
