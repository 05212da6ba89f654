"""Sustained GEMM throughput beside cuBLAS, with the SM clock and board power it ran at.

On the H200 a large fp16 GEMM holds the board at its power cap (~600-700 W) and the SM clock well under its
1980 MHz maximum, so throughput is energy per FLOP times the cap: what decides a 1 % race is the work each
FLOP costs (L2 and shared-memory traffic), measured here by running each kernel back to back for
``--seconds`` while ``nvidia-smi`` samples clock and power, alternating ours and cuBLAS ``--rounds`` times.

    python benchmarks/bench_sustained.py [--shapes 4096x4096x4096,...] [--variants default,raster8]
        [--seconds 1.5] [--rounds 2] [--json out.json]
"""

import argparse
import dataclasses
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import LARGE_SHAPES, pick_shapes, print_table, save  # noqa: E402

from tile_ops.kernels.gemm_defaults import default_config  # noqa: E402
from tile_ops.kernels.gemm_launch import build_gemm  # noqa: E402

# a variant: "default", or "+"-joined changes to a shape's default config: rasterN (panels of N column tiles,
# 0: grid order), clusterN (B multicast to N M tiles), cluster_nN (A multicast to N N tiles); e.g. raster8
# (the v13 default), cluster2+raster0
CHANGES = {"raster": "swizzle", "cluster": "cluster", "cluster_n": "cluster_n"}
_TERM = re.compile(r"(raster|cluster_n|cluster)(\d+)")


def variant_changes(name: str) -> dict:
    """The GemmConfig fields a variant name changes ({} for "default"); ValueError for a malformed name."""
    if name == "default":
        return {}
    terms = [_TERM.fullmatch(t) for t in name.split("+")]
    if not all(terms):
        raise ValueError(f"variant {name!r}: 'default' or '+'-joined rasterN, clusterN, cluster_nN (e.g. raster8, "
                         f"cluster2+raster0)")
    return {CHANGES[t[1]]: int(t[2]) for t in terms}


TOLERANCE = 5e-3  # relative Frobenius error of fp16 against float64


def sustain(fn, seconds):
    """(ms per call, median SM MHz, median W) over ``seconds`` of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    smi = shutil.which("nvidia-smi")
    sampler = smi and subprocess.Popen([smi, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                        "-lms", "100"], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0, calls = time.time(), 0
    while time.time() - t0 < seconds:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    samples = []
    if sampler:
        sampler.terminate()
        lines = sampler.communicate()[0].strip().splitlines()[3:]  # the first samples predate the load
        samples = [tuple(map(float, ln.split(","))) for ln in lines if ln.count(",") == 1]
    med = (lambda i: statistics.median(s[i] for s in samples)) if samples else (lambda i: float("nan"))
    return start.elapsed_time(end) / calls, med(0), med(1)


def _rounded(x):
    """An integer, or "-" where nvidia-smi gave no samples (missing, or a run too short for them)."""
    return "-" if math.isnan(x) else round(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="comma-separated MxNxK of the four large shapes (default: all)")
    p.add_argument("--variants", default="default", help="comma-separated: default, or changes to it joined by "
                   "'+': rasterN, clusterN, cluster_nN (e.g. default,raster8,cluster2+raster0)")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    try:
        variants = {name: variant_changes(name) for name in args.variants.split(",")}
    except ValueError as e:
        p.error(f"--variants: {e}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels build without one: python -m tile_ops precompile)")
    rows = []
    for M, N, K in pick_shapes(LARGE_SHAPES, args.shapes):
        a = torch.randn(M, K, dtype=torch.float16, device="cuda")
        b = torch.randn(K, N, dtype=torch.float16, device="cuda")
        c = torch.empty(M, N, dtype=torch.float16, device="cuda")
        ref = a.double() @ b.double()
        ptrs = [a.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr()]
        runs = {"cuBLAS": lambda: torch.matmul(a, b)}
        for name, changes in variants.items():
            try:
                kernel = build_gemm(M, N, K, cfg=dataclasses.replace(default_config(M, N, K), **changes))
            except ValueError as e:  # e.g. a cluster that does not divide the M tiles
                print(f"{M}x{N}x{K} {name}: {e}", file=sys.stderr)
                continue
            c.fill_(float("nan"))
            kernel.launch_ptrs(ptrs, a.device)
            err = ((c.double() - ref).norm() / ref.norm()).item()
            if not err < TOLERANCE:
                print(f"WRONG {M}x{N}x{K} {name}: relative error {err:.1e}", file=sys.stderr)
                continue
            runs[name] = (lambda k: lambda: k.launch_ptrs(ptrs, a.device))(kernel)
        seen = {name: [] for name in runs}
        for _ in range(args.rounds):  # alternate: the board's temperature drifts for all alike
            for name, fn in runs.items():
                seen[name].append(sustain(fn, args.seconds))
        tflops = {name: 2 * M * N * K / statistics.median(s[0] for s in v) / 1e9 for name, v in seen.items()}
        for name, v in seen.items():
            mhz, watts = statistics.median(s[1] for s in v), statistics.median(s[2] for s in v)
            rows.append({"shape": f"{M}x{N}x{K}", "kernel": name, "TFLOP/s": round(tflops[name], 1),
                         "vs_cuBLAS": round(tflops[name] / tflops["cuBLAS"], 3), "SM MHz": _rounded(mhz),
                         "W": _rounded(watts), "TFLOP/kJ": _rounded(1000 * tflops[name] / watts)})
        del a, b, c, ref
    print_table(rows, ["shape", "kernel", "TFLOP/s", "vs_cuBLAS", "SM MHz", "W", "TFLOP/kJ"],
                f"Sustained fp16 GEMM ({args.rounds} x {args.seconds} s each) on {torch.cuda.get_device_name()}")
    print("\n".join(geomean_lines(rows)))
    save(rows, args.json, None, x=("shape", "kernel"), ys=("TFLOP/s",), ylabel="TFLOP/s")


def geomean_lines(rows) -> list:
    """Each variant's geometric mean ratio to cuBLAS over the shapes it ran (issue 4's large-shape bar)."""
    ratios = {}
    for r in rows:
        if r["kernel"] != "cuBLAS":
            ratios.setdefault(r["kernel"], []).append(r["vs_cuBLAS"])
    return [f"{name}: geomean {statistics.geometric_mean(v):.3f} of cuBLAS over {len(v)} shape(s)"
            for name, v in ratios.items()]


if __name__ == "__main__":
    main()
