"""Per-call host overhead of the ops on a tiny shape: wall time per call minus the kernel's time.

    python benchmarks/bench_overhead.py [--json out.json]

Wall time per call: many back-to-back calls, then one synchronize (the host is the bottleneck at
this size, so this is the host's cost per call). Kernel time: the same launch captured in a CUDA
graph and replayed (no host work). The bar for tile_ops.gemm is under 10 microseconds.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bench_ms, print_table, save  # noqa: E402

import tile_ops  # noqa: E402


def wall_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_ms(g.replay) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    a = torch.randn(64, 64, dtype=torch.float16, device="cuda")
    b = torch.randn(64, 64, dtype=torch.float16, device="cuda")
    cases = {
        "tile_ops.gemm": lambda: tile_ops.gemm(a, b),
        "torch.ops.tile_ops.gemm": lambda: torch.ops.tile_ops.gemm(a, b),
        "tile_ops.gemm_softmax": lambda: tile_ops.gemm_softmax(a, b, 0.125),
        "torch.matmul": lambda: torch.matmul(a, b),
    }
    rows = []
    for name, fn in cases.items():
        w, k = wall_us(fn), graph_us(fn)
        rows.append({"op": name, "wall_us": round(w, 2), "kernel_us": round(k, 2), "overhead_us": round(w - k, 2)})
    print_table(rows, list(rows[0]), f"Per-call overhead, 64x64x64 fp16, on {torch.cuda.get_device_name()}")
    save(rows, args.json)


if __name__ == "__main__":
    main()
