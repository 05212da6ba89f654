#!/usr/bin/env bash
# One device call: install (TVM from the carried kit), GPU tests, then the benchmarks; logs under $OUT.
# Each benchmark's latest result, with the settings below that produced it, is kept in benchmarks/RESULTS.md.
#   TESTS="tests/test_kernels_gpu.py"  narrows the tests (TESTS=none: none, e.g. without TVM; TEST_WORKERS: -n);
#   BENCHES="softmax overhead"  picks benchmarks: gemm gemm80 softmax overhead compile (the default list; none: none),
#     also sanitize, profile and sustained (seconds-long runs with clock and power; SUSTAINED_ARGS);
#     BENCH_ARGS  goes to bench_gemm.py (default --configs), SOFTMAX_ARGS to bench_gemm_softmax.py (e.g. --configs).
#   gemm times the Hopper path (sm_90a), gemm80 the Ampere-class path (sm_90) on the same GPU.
#   l2state: our default beside cuBLAS by L2 state, flush-buffer placement and L2 promotion (benchmarks/l2_state.py;
#     L2STATE_ARGS, e.g. --config 64x128x128/s4/t128/tma-store/cluster2 --states dirty,clean,warm).
#   profile: ncu counters of the default kernel vs cuBLAS at PROFILE_SHAPES (default 4096x4096x4096; PROFILE_ARGS,
#     e.g. --l2 dirty --l2-sources, which replays the whole process per pass; PROFILE_TIMEOUT, default 240 s).
#   compare: several configs beside cuBLAS, paired call by call in one loop, a process per round
#     (benchmarks/compare_configs.py; COMPARE_ARGS, e.g. --configs default,64x128x64/s8/t128/tma-store --shapes 1024x1024x4096).
#   runtime_m: the op's runtime-M kernels against the same configs compiled for a fixed M, paired beside cuBLAS
#     (benchmarks/ab_runtime_m.py; RUNTIME_M_ARGS, e.g. --shapes 4096x4096x4096 --no-sweep).
#   ab: a compiler patch (AB_PATCH) or another checkout (AB_TREE, e.g. `git archive` of an earlier commit, carried)
#     against main, alternating processes (benchmarks/ab_compiler.py; AB_ARGS, e.g. --benches gemm,softmax).
#   sanitize: compute-sanitizer memcheck/racecheck/synccheck over every kernel, both paths, small and
#     ragged shapes (benchmarks/sanitize.py; SANITIZE_ARGS), logs in $OUT/sanitize/.
#   TileLang beside us: ../shared/device/make-tilelang-kit.sh, then (no GPU needed)
#     TILE_OPS_CACHE_DIR=.tile_ops_cache python benchmarks/bench_gemm.py --compile-only;  carry .tlkit
#     and .tile_ops_cache (not .tvmkit: both do not fit) and run TESTS=none BENCHES=gemm BENCH_ARGS=--tilelang.
# A step that fails (exit status, or killed by its timeout) says so at once with "FAILED:", and the script
# goes on to the next step, then exits 1 listing them (also in $OUT/failures.txt); 0 only if every step passed.
set -uo pipefail
OUT=${OUT:-/tmp/tile_ops_out}; mkdir -p "$OUT"
failed=""
note() {  # note STEP STATUS [LIMIT_S]: record a failed step (STATUS 124: killed by `timeout LIMIT_S`)
  [ "$2" = 0 ] && return 0
  local why="exit status $2"
  [ "$2" = 124 ] && why="timed out after ${3:-?} s (its output is cut short)"
  [[ "$2" =~ ^[0-9]+$ ]] || why=$2
  echo "FAILED: $1: $why; log under $OUT" | tee -a "$OUT/failures.txt"
  failed="$failed $1"
}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TILE_OPS_CACHE_DIR=${TILE_OPS_CACHE_DIR:-/tmp/tile_ops_cache}
[ -d .tvmkit ] && source .tvmkit/install.sh
[ -d .tlkit ] && source .tlkit/install.sh  # TileLang, beside a precompiled cache instead of TVM (GPU.md)
[ -d .tile_ops_cache ] && export TILE_OPS_CACHE_DIR=$PWD/.tile_ops_cache  # bench_gemm.py --compile-only
# python -m pip: the extension builds against the torch of the python that runs everything below
python -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; echo "FAILED: install; log $OUT/install.log"; exit 1; }
# which launcher a process gets: tile_ops._C (built by the install) or tile_ops_C (JIT-built on first use, ~40 s)
python -c "from tile_ops.jit.launcher import get_launcher as g; print('launcher:', g().__name__)" 2>&1 | tail -1
grep -A3 "WARNING: building the tile_ops._C" "$OUT/install.log" | head -4
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
# -v: each test's result is logged as it ends ("[gw3] [ 45%] FAILED tests/..."), so a run cut short by the
# device's time limit still names its failures (pytest's summary comes only at the end)
[ "${TESTS:-}" = none ] || { python -m pytest ${TESTS:-tests} -m gpu -v -n ${TEST_WORKERS:-8} ${TEST_FLAGS--x} --timeout ${TEST_TIMEOUT:-300} -p no:benchmark 2>&1 | tee "$OUT/gpu_tests.log" | tail -2; note tests ${PIPESTATUS[0]}
  grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$OUT/gpu_tests.log" | head -20; }
T=${BENCH_TIMEOUT:-400}
for b in ${BENCHES:-gemm gemm80 softmax overhead compile}; do
  case $b in
    gemm) timeout $T python benchmarks/bench_gemm.py ${BENCH_ARGS:---configs} --json "$OUT/gemm.json" 2>&1 | tee "$OUT/bench_gemm.log" | tail -14; note $b ${PIPESTATUS[0]} $T ;;
    gemm80) timeout $T python benchmarks/bench_gemm.py --arch sm_90 --no-triton ${BENCH_ARGS:---configs} --json "$OUT/gemm80.json" 2>&1 | tee "$OUT/bench_gemm80.log" | tail -14; note $b ${PIPESTATUS[0]} $T ;;
    softmax) timeout $T python benchmarks/bench_gemm_softmax.py ${SOFTMAX_ARGS:-} --json "$OUT/gemm_softmax.json" 2>&1 | tee "$OUT/bench_softmax.log" | tail -8; note $b ${PIPESTATUS[0]} $T ;;
    sustained) timeout $T python benchmarks/bench_sustained.py ${SUSTAINED_ARGS:---variants default,raster8} --json "$OUT/sustained.json" 2>&1 | tee "$OUT/bench_sustained.log" | tail -14; note $b ${PIPESTATUS[0]} $T ;;
    overhead) timeout $T python benchmarks/bench_overhead.py --json "$OUT/overhead.json" 2>&1 | tee "$OUT/bench_overhead.log" | tail -24; note $b ${PIPESTATUS[0]} $T ;;
    sanitize) timeout $T python benchmarks/sanitize.py --out "$OUT" --budget $(( T - 20 )) ${SANITIZE_ARGS:-} 2>&1 | tee "$OUT/sanitize.log" | tail -24; note $b ${PIPESTATUS[0]} $T ;;
    l2state) timeout $T python benchmarks/l2_state.py ${L2STATE_ARGS:-} 2>&1 | tee -a "$OUT/l2_state.log" | tail -16; note $b ${PIPESTATUS[0]} $T ;;
    compare) timeout $T python benchmarks/compare_configs.py ${COMPARE_ARGS:?compare needs COMPARE_ARGS} --json "$OUT/compare.json" 2>&1 | tee -a "$OUT/compare.log" | tail -24; note $b ${PIPESTATUS[0]} $T ;;
    runtime_m) timeout $T python benchmarks/ab_runtime_m.py ${RUNTIME_M_ARGS:-} --json "$OUT/ab_runtime_m.json" 2>&1 | tee "$OUT/ab_runtime_m.log" | tail -24; note $b ${PIPESTATUS[0]} $T ;;
    ab) timeout $T python benchmarks/ab_compiler.py ${AB_TREE:+--tree "$AB_TREE"} ${AB_PATCH:-} --out "$OUT/ab" ${AB_ARGS:-} 2>&1 | tee "$OUT/ab.log" | tail -16; note $b ${PIPESTATUS[0]} $T ;;
    profile) for s in ${PROFILE_SHAPES:-4096x4096x4096}; do timeout ${PROFILE_TIMEOUT:-240} python benchmarks/profile_gemm.py --shape $s ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/profile.log" | tail -4; note "profile $s" ${PIPESTATUS[0]} ${PROFILE_TIMEOUT:-240}; done ;;
    compile) python benchmarks/compile_time.py --json "$OUT/compile_time.json" 2>&1 | tee "$OUT/compile_time.log" | tail -6; note $b ${PIPESTATUS[0]} ;;
    none) ;;
    *) note "$b" "unknown benchmark (BENCHES takes none gemm gemm80 softmax overhead compile sanitize l2state profile sustained compare runtime_m ab)" ;;
  esac
done
if [ -n "$failed" ]; then echo "gpu_session.sh: FAILED:$failed"; exit 1; fi
echo "gpu_session.sh: every step passed"
