"""Runtime M against static M (issue 41): at each shape, the kernel the op launches (M a T.dynamic size, one
kernel for every M) and the same config compiled with M fixed, timed call by call in one loop beside cuBLAS,
each checked against cuBLAS first.  Also the compile count of a token-count sweep.

    python benchmarks/ab_runtime_m.py [--shapes MxNxK,...] [--dtype float16] [--rep-ms 1500] [--json PATH]

Prints per shape: both kernels' TFLOP/s, runtime/static time ratio (within 2 %: the bar), and cuBLAS's (for
the fused softmax, TFLOP/s of its product, and cuBLAS's a @ b alone).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import BAR_SHAPES  # noqa: E402
from common import paired_medians  # noqa: E402

from tile_ops.kernels.gemm_launch import build_gemm, gemm_launcher, launch_config  # noqa: E402
from tile_ops.kernels.gemm_softmax import gemm_softmax  # noqa: E402
from tile_ops.kernels.gemm_softmax_launch import build_gemm_softmax  # noqa: E402
from tile_ops.autotune import config_for  # noqa: E402


def parse_shapes(text):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")] if text else BAR_SHAPES


def gemm_pair(M, N, K, dtype):
    """{name: fn} of cuBLAS, the runtime-M and the static-M launch of the op's config, checked first."""
    dt = getattr(torch, dtype)
    a, b = torch.randn(M, K, device="cuda").to(dt), torch.randn(K, N, device="cuda").to(dt)
    ref = a @ b
    cfg = launch_config(M, N, K, dtype)
    fns = {"cublas": lambda: torch.matmul(a, b)}
    for name, static in (("runtime", False), ("static", True)):
        kernel = build_gemm(M, N, K, dtype=dtype, out_dtype=dtype, cfg=cfg, static_m=static)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
        run = gemm_launcher(kernel, a.device)
        args = (a.data_ptr(), b.data_ptr(), out.data_ptr())
        run(*args)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"{name} M kernel at {M}x{N}x{K}: relative error {err:.2e} against cuBLAS")
        fns[name] = lambda run=run, args=args: run(*args)
    return fns, cfg


def softmax_pair(M, N, K, dtype):
    """{name: fn} of cuBLAS's a @ b, the runtime-M and the static-M fused gemm + softmax, checked first."""
    dt = getattr(torch, dtype)
    a, b = torch.randn(M, K, device="cuda").to(dt), torch.randn(K, N, device="cuda").to(dt)
    ref = torch.softmax(a.float() @ b.float() * 0.125, -1)
    cfg = config_for("gemm_softmax", M, N, K, dtype, a.device)
    fns = {"cublas": lambda: torch.matmul(a, b)}
    for name, kernel in (("runtime", build_gemm_softmax(M, N, K, 0.125, dtype, dtype, cfg)),
                         ("static", gemm_softmax(M, N, K, 0.125, dtype, dtype, cfg))):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dt)
        ptrs = [a.data_ptr(), b.data_ptr(), out.data_ptr()]
        run = kernel.launcher(a.device)
        run(ptrs)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"{name} M gemm_softmax at {M}x{N}x{K}: relative error {err:.2e}")
        fns[name] = lambda run=run, ptrs=ptrs: run(ptrs)
    return fns, cfg


def compile_sweep(N=4096, K=4096, dtype="float16", count=100):
    """How many gemm kernels 100 random token counts in 1..16384 build (N = K = 4096), and the configs chosen."""
    import random

    import tile_ops.jit as _  # noqa: F401
    jit_mod = sys.modules["tile_ops.jit"]
    built, original = [], jit_mod._load_or_build

    def counting(key, *args):
        built.append(key)
        return original(key, *args)

    jit_mod._load_or_build = counting
    try:
        configs = set()
        for M in random.Random(41).sample(range(1, 16385), count):
            cfg = launch_config(M, N, K, dtype)
            configs.add(cfg)
            build_gemm(M, N, K, dtype=dtype, out_dtype=dtype, cfg=cfg)
    finally:
        jit_mod._load_or_build = original
    return len(set(built)), len(configs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--rep-ms", type=int, default=1500)
    p.add_argument("--softmax-shapes", default="8192x2048x1024,4096x4096x4096")
    p.add_argument("--json", default="")
    p.add_argument("--no-sweep", action="store_true")
    args = p.parse_args()
    rows = []
    jobs = [("gemm", s, gemm_pair) for s in parse_shapes(args.shapes)]
    jobs += [("softmax", s, softmax_pair) for s in parse_shapes(args.softmax_shapes)] if args.softmax_shapes else []
    for op, (M, N, K), pair in jobs:
        fns, cfg = pair(M, N, K, args.dtype)
        ms = paired_medians(fns, rep_ms=args.rep_ms)
        tflops = {k: 2 * M * N * K / v / 1e9 for k, v in ms.items()}
        rows.append(dict(op=op, shape=f"{M}x{N}x{K}", config=str(cfg), ms=ms, tflops=tflops,
                         ratio=ms["runtime"] / ms["static"]))
        print(f"{op} {M}x{N}x{K}: runtime {tflops['runtime']:.0f} static {tflops['static']:.0f} cuBLAS "
              f"{tflops['cublas']:.0f} TFLOP/s; runtime/static time {rows[-1]['ratio']:.3f}", flush=True)
    sweep = None if args.no_sweep else compile_sweep(dtype=args.dtype)
    print(f"\n{torch.cuda.get_device_name()}, {args.dtype}, median of paired calls ({args.rep_ms} ms)")
    print(f"{'op':>8} {'shape':>18} {'runtime':>8} {'static':>8} {'cuBLAS':>8} {'rt/static':>9}  (TFLOP/s; time ratio)")
    for r in rows:
        t = r["tflops"]
        print(f"{r['op']:>8} {r['shape']:>18} {t['runtime']:8.0f} {t['static']:8.0f} {t['cublas']:8.0f} {r['ratio']:9.3f}")
    if sweep:
        print(f"100 random M in 1..16384 at N = K = 4096: {sweep[0]} gemm kernels built for {sweep[1]} configs chosen")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, sweep=sweep, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
