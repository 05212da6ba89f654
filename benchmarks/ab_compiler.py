"""A compiler change against main on the GPU: both variants' GEMMs beside cuBLAS, in alternating processes.

    python benchmarks/ab_compiler.py PATCH [--shapes MxNxK,...] [--rounds 3] [--out DIR] [--compile-only]

PATCH is a unified diff of the package (``git diff -- tile_ops > lean.patch``). The variant runs from a copy of
``tile_ops`` with the patch applied, first on PYTHONPATH. The JIT cache keys hash the compiler's sources, so
both variants build into and find their kernels in one cache: ``--compile-only`` fills it on a machine without
a GPU, and a device run with that cache carried needs no TVM (set TILE_OPS_CACHE_DIR alike on both).

Each round runs ``bench_gemm.py --no-triton`` once as main and once as the variant; each process pairs its
kernel with cuBLAS call by call. Rounds, not one long process, because a kernel's speed at a short grid is
drawn per process (at 1000^3 one of two modes ~0.65 us apart, kept for the whole process). The table gives every
process's ratio to cuBLAS and their medians.
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


def environ(variant_root=None) -> dict:
    """The environment of a bench process: main's package, or the variant's copy ahead of it."""
    env = dict(os.environ)
    paths = ([variant_root] if variant_root else []) + [REPO] + env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def bench(env, shapes: str, *extra) -> list:
    """``bench_gemm.py --no-triton`` over ``shapes`` (and ``extra`` arguments) in a process of its own."""
    cmd = [sys.executable, os.path.join(HERE, "bench_gemm.py"), "--no-triton", "--shapes", shapes, *extra]
    subprocess.run(cmd, env=env, check=True)
    return cmd


def summary(out: str) -> list:
    """Rows of (dtype, shape, main's ratios, the variant's ratios, their medians, our µs by median, cuBLAS's)."""
    runs = {}
    for variant in ("main", "variant"):
        for path in sorted(glob.glob(os.path.join(out, f"{variant}[0-9]*.json"))):
            for r in json.load(open(path))["rows"]:
                M, N, K = map(int, r["shape"].split()[0].split("x"))
                us = lambda tflops: 2 * M * N * K / tflops / 1e6 if tflops else float("nan")  # noqa: E731
                runs.setdefault((r["dtype"], r["shape"]), {}).setdefault(variant, []).append(
                    (r["vs_cuBLAS"], us(r["tile_ops"]), us(r["cuBLAS"])))
    med = lambda xs, i: round(statistics.median(x[i] for x in xs), 3) if xs else float("nan")  # noqa: E731
    return [{"dtype": dt, "shape": shape,
             "main": " ".join(f"{x[0]:.3f}" for x in d.get("main", [])),
             "variant": " ".join(f"{x[0]:.3f}" for x in d.get("variant", [])),
             "main_med": med(d.get("main", []), 0), "variant_med": med(d.get("variant", []), 0),
             "main_us": med(d.get("main", []), 1), "variant_us": med(d.get("variant", []), 1),
             "cuBLAS_us": med(d.get("main", []) + d.get("variant", []), 2)}
            for (dt, shape), d in runs.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("patch", help="a unified diff of tile_ops/ (paths a/tile_ops/..., b/tile_ops/...)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxNxK (bench_gemm.py's --shapes)")
    p.add_argument("--rounds", type=int, default=3, help="processes of each variant, alternating")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/ab_compiler", help="JSON of every process")
    p.add_argument("--compile-only", action="store_true", help="build both variants' kernels into the cache, stop")
    args = p.parse_args()
    args.out = os.path.abspath(args.out)  # it goes on the processes' PYTHONPATH
    os.makedirs(args.out, exist_ok=True)
    variant = environ(overlay(args.patch, os.path.join(args.out, "variant_root")))
    if args.compile_only:  # the architecture the GPU runs: bench_gemm.py's default there
        for env in (environ(), variant):
            bench(env, args.shapes, "--arch", "sm_90a", "--compile-only")
        return
    for name in ("main", "variant"):  # an earlier run's rounds would join this one's medians
        for old in glob.glob(os.path.join(args.out, f"{name}[0-9]*.json")):
            os.remove(old)
    for i in range(1, args.rounds + 1):
        for name, env in (("main", environ()), ("variant", variant)):
            bench(env, args.shapes, "--json", os.path.join(args.out, f"{name}{i}.json"))
    from common import print_table

    print_table(summary(args.out), ["dtype", "shape", "main", "variant", "main_med", "variant_med", "main_us",
                                    "variant_us", "cuBLAS_us"],
                f"ours / cuBLAS, one process each, main against {os.path.basename(args.patch)} "
                f"(medians; µs by median)")


if __name__ == "__main__":
    main()
