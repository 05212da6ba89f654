"""A compiler change against main on the GPU: both variants' kernels beside cuBLAS, in alternating processes.

    python benchmarks/ab_compiler.py (PATCH | --tree DIR) [--benches gemm,softmax] [--shapes MxNxK,...]
                                     [--softmax-shapes MxNxK,...] [--rounds 3] [--out DIR] [--compile-only]

PATCH is a unified diff of the package (``git diff -- tile_ops > lean.patch``): the variant runs from a copy of
``tile_ops`` with the patch applied, first on PYTHONPATH, with main's benchmark scripts.  ``--tree DIR`` is a
whole other checkout (``tile_ops/``, ``csrc/``, ``setup.py``, ``benchmarks/``: e.g. ``git archive COMMIT`` of
the commit before a restructuring): the variant runs its own scripts and its own extension, built in place
here when missing.  The JIT cache keys hash the compiler's sources, so both variants build into and find
their kernels in one cache: ``--compile-only`` fills it on a machine without a GPU, and a device run with
that cache carried needs no TVM (set TILE_OPS_CACHE_DIR alike on both).

Each round runs each bench (``bench_gemm.py --no-triton``, ``bench_gemm_softmax.py``) once as main and once as
the variant; each process times its kernel beside cuBLAS.  Rounds, not one long process, because a
kernel's speed at a short grid is drawn per process (at 1000^3 one of two modes ~0.65 us apart, kept for
the whole process).  The table gives every process's ratio to cuBLAS (for the fused softmax: cuBLAS's
a @ b time over the fused kernel's) and their medians.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_SHAPES = "1000x1000x1000,1024x1024x4096,2048x2048x2048,4096x4096x4096,16x8192x8192"
DEFAULT_SOFTMAX_SHAPES = "8192x2048x1024,4096x4096x4096,16384x1024x512,4096x64x512,2048x8192x256"
BENCHES = {"gemm": "bench_gemm.py", "softmax": "bench_gemm_softmax.py"}


def overlay(patch: str, dest: str) -> str:
    """``dest``/tile_ops: a copy of the package (built extension included) with ``patch`` applied; ``dest``."""
    shutil.rmtree(os.path.join(dest, "tile_ops"), ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "tile_ops"), os.path.join(dest, "tile_ops"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["git", "apply", "--verbose", os.path.abspath(patch)], cwd=dest, capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"ab_compiler: {patch} does not apply to this tile_ops:\n{proc.stderr.strip()}")
    return dest


def prepare_tree(tree: str) -> str:
    """``tree``, a checkout whose ``tile_ops`` is the variant, with its extension built in place if missing."""
    tree = os.path.abspath(tree)
    if not os.path.isdir(os.path.join(tree, "tile_ops")) or not os.path.isdir(os.path.join(tree, "benchmarks")):
        sys.exit(f"ab_compiler: --tree {tree} must hold tile_ops/ and benchmarks/ (and csrc/, setup.py)")
    if not glob.glob(os.path.join(tree, "tile_ops", "_C*.so")):
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True,
                       stdout=subprocess.DEVNULL)
    return tree


def environ(variant_root=None) -> dict:
    """The environment of a bench process: main's package, or the variant's copy ahead of it."""
    env = dict(os.environ)
    paths = ([variant_root] if variant_root else []) + [REPO] + env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def bench(env, script: str, shapes: str, *extra) -> list:
    """A bench script over ``shapes`` (and ``extra`` arguments) in a process of its own."""
    cmd = [sys.executable, script, *(["--no-triton"] if script.endswith("bench_gemm.py") else []),
           "--shapes", shapes, *extra]
    subprocess.run(cmd, env=env, check=True)
    return cmd


def _ratios(bench_name: str, row: dict) -> tuple:
    """(ours vs cuBLAS, our µs, cuBLAS's µs) of a JSON row of the bench."""
    if bench_name == "softmax":
        return row["cublas_mm_us"] / row["fused_us"], row["fused_us"], row["cublas_mm_us"]
    M, N, K = map(int, row["shape"].split()[0].split("x"))
    us = lambda tflops: 2 * M * N * K / tflops / 1e6 if tflops else float("nan")  # noqa: E731
    return row["vs_cuBLAS"], us(row["tile_ops"]), us(row["cuBLAS"])


def summary(out: str) -> list:
    """Rows of (bench, dtype, shape, main's ratios, the variant's ratios, their medians, our µs by median,
    cuBLAS's)."""
    runs = {}
    for variant in ("main", "variant"):
        for bench_name in BENCHES:
            for path in sorted(glob.glob(os.path.join(out, f"{bench_name}_{variant}[0-9]*.json"))):
                for r in json.load(open(path))["rows"]:
                    key = (bench_name, r.get("dtype", "float16"), r["shape"])
                    runs.setdefault(key, {}).setdefault(variant, []).append(_ratios(bench_name, r))
    med = lambda xs, i: round(statistics.median(x[i] for x in xs), 3) if xs else float("nan")  # noqa: E731
    rows = []
    for (bench_name, dt, shape), d in runs.items():
        main, variant = d.get("main", []), d.get("variant", [])
        rows.append({"bench": bench_name, "dtype": dt, "shape": shape,
                     "main": " ".join(f"{x[0]:.3f}" for x in main),
                     "variant": " ".join(f"{x[0]:.3f}" for x in variant),
                     "main_med": med(main, 0), "variant_med": med(variant, 0),
                     "variant/main": round(med(variant, 0) / med(main, 0), 3) if main and variant else float("nan"),
                     "main_us": med(main, 1), "variant_us": med(variant, 1), "cuBLAS_us": med(main + variant, 2)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("patch", nargs="?", help="a unified diff of tile_ops/ (paths a/tile_ops/..., b/tile_ops/...)")
    p.add_argument("--tree", help="instead of a patch: a checkout whose tile_ops (and benchmarks) is the variant")
    p.add_argument("--benches", default="gemm", help=f"comma-separated, of {', '.join(BENCHES)}")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxNxK (bench_gemm.py's --shapes)")
    p.add_argument("--softmax-shapes", default=DEFAULT_SOFTMAX_SHAPES, help="bench_gemm_softmax.py's --shapes")
    p.add_argument("--rounds", type=int, default=3, help="processes of each variant, alternating")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/ab_compiler", help="JSON of every process")
    p.add_argument("--compile-only", action="store_true", help="build both variants' kernels into the cache, stop")
    args = p.parse_args()
    if bool(args.patch) == bool(args.tree):
        p.error("give a PATCH or --tree DIR (one of them)")
    benches = args.benches.split(",")
    if not set(benches) <= set(BENCHES):
        p.error(f"--benches {args.benches}: accepted: {', '.join(BENCHES)}")
    args.out = os.path.abspath(args.out)  # it goes on the processes' PYTHONPATH
    os.makedirs(args.out, exist_ok=True)
    root = prepare_tree(args.tree) if args.tree else overlay(args.patch, os.path.join(args.out, "variant_root"))
    scripts = os.path.join(root if args.tree else REPO, "benchmarks")
    variants = (("main", environ(), HERE), ("variant", environ(root), scripts))
    shapes = {"gemm": args.shapes, "softmax": args.softmax_shapes}
    if args.compile_only:  # the architecture the GPU runs: bench_gemm.py's default there
        for _, env, where in variants:
            bench(env, os.path.join(where, BENCHES["gemm"]), args.shapes, "--arch", "sm_90a", "--compile-only")
        return
    for old in glob.glob(os.path.join(args.out, "*_main[0-9]*.json")) + glob.glob(
            os.path.join(args.out, "*_variant[0-9]*.json")):  # an earlier run's rounds would join this one's medians
        os.remove(old)
    for i in range(1, args.rounds + 1):
        for name in benches:
            for variant, env, where in variants:
                bench(env, os.path.join(where, BENCHES[name]), shapes[name], "--json",
                      os.path.join(args.out, f"{name}_{variant}{i}.json"))
    from common import print_table

    what = os.path.basename(args.patch or args.tree.rstrip("/"))
    print_table(summary(args.out), ["bench", "dtype", "shape", "main", "variant", "main_med", "variant_med",
                                    "variant/main", "main_us", "variant_us", "cuBLAS_us"],
                f"ours / cuBLAS, one process each, main against {what} (medians; µs by median)")


if __name__ == "__main__":
    main()
