"""Per-call host overhead of the ops on a tiny problem: wall time per call minus kernel time per call.

    python benchmarks/bench_overhead.py [--shape 64x64x64] [--iters 10000] [--json out.json]

For each call path, on one fp16 problem:

* wall_us: ``--iters`` back-to-back calls, then one synchronize, per call (median of 5 runs).  At
  this size the host is the bottleneck, so this is what a call costs the program.
* kernel_us: the same call captured ``GRAPH_CALLS`` times in one CUDA graph, replayed and timed
  with CUDA events, per call (median of 5): the GPU time of the call's kernels, no host work.
* overhead_us = wall_us - kernel_us (the bar for tile_ops.gemm: under 10 µs).  Near 0 or below:
  the host keeps ahead of the GPU.
* host_us: the host's own time per call (batches of ``HOST_BATCH`` calls, timed without waiting for
  the GPU, small enough not to fill the launch queue; median).

Paths: ``tile_ops.gemm`` / ``tile_ops.gemm_softmax`` on their eager fast path (checked to be
taken), the same ops through the dispatcher (``torch.ops.tile_ops.*``), and ``torch.matmul``.  Then issue
41's: host time per ``tile_ops.gemm`` call at token counts never seen, after 100 random ones (``unseen_m_us``).
"""

import argparse
import importlib
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table, save  # noqa: E402

import tile_ops  # noqa: E402
from tile_ops.jit import Kernel  # noqa: E402
from tile_ops.jit.kernel import Sized  # noqa: E402
from tile_ops.ops import fastpath  # noqa: E402

GEMM = importlib.import_module("tile_ops.ops.gemm").GEMM  # the ops' OpSpecs (tile_ops.ops.gemm is the function)
GEMM_SOFTMAX = importlib.import_module("tile_ops.ops.gemm_softmax").GEMM_SOFTMAX

BAR_US = 10.0
GRAPH_CALLS = 200
HOST_BATCH = 200


def wall_us(fn, iters):
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(runs)


def kernel_us(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(runs)


def host_us(fn, batches=50):
    runs = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(HOST_BATCH):
            fn()
        runs.append((time.perf_counter() - t) / HOST_BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(runs)


def host_stages(a, b):
    """The fast path's host stages, each timed alone like host_us: where a call's microseconds go."""
    out = tile_ops.gemm(a, b)
    index = a.device.index
    sized = importlib.import_module("tile_ops.kernels.gemm_launch").get_gemm_kernel(a[None], b[None], out[None])[0]
    kernel, dims = (sized.launchable, sized.dims) if isinstance(sized, Sized) else (sized, ())
    if not isinstance(kernel, Kernel):  # split-K or padded: several launches, no one launch to take apart
        print(f"host stages: {kernel!r} is several kernels; they are timed for single-kernel shapes only")
        return []
    lib_launch, handle = kernel._fn().bind(index)
    grid, block = kernel.grid_on(index, dims), kernel.meta.block
    smem, name = kernel._fn().smem_bytes, kernel._fn().name
    ptrs = [a.data_ptr(), b.data_ptr(), out.data_ptr(), out.data_ptr()]
    stream, args = torch._C._cuda_getCurrentRawStream(index), kernel._entry_args.build(ptrs, index, dims=dims)
    stages = {
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "fastpath.call (C++: checks, lookup, torch.empty, launch)":
            lambda: fastpath.call(GEMM.plan_id, (a, b, None), (None,), True),
        "  for scale: torch.empty (output, from Python)": lambda: torch.empty(*out.shape, dtype=out.dtype, device=a.device),
        "  for scale: the extension's launch (from Python)": lambda: lib_launch(handle, grid, block, smem, stream, args, name),
        "tile_ops.gemm (all)": lambda: tile_ops.gemm(a, b),
        "torch.matmul (all)": lambda: torch.matmul(a, b),
    }
    return [{"stage": name, "host_us": round(host_us(fn, batches=20), 2)} for name, fn in stages.items()]


def unseen_m_us(K, N, count=200, warm=100, seed=41):
    """Issue 41's measure: host time per ``tile_ops.gemm`` call at a token count M never seen before, after
    ``warm`` random M in 1..16384 built their configs' kernels and recorded their plan families (views of one
    buffer).  (µs per call, the share of those calls a recorded plan or family served)."""
    rng = random.Random(seed)
    seen = rng.sample(range(1, 16385), warm)
    unseen = [m for m in rng.sample(range(1, 16385), count + warm) if m not in seen][:count]
    a = torch.randn(16384, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    fastpath.clear()
    for M in seen:
        tile_ops.gemm(a[:M], b)
    served = sum(fastpath.call(GEMM.plan_id, (a[:M], b, None), (None,), True) is not None for M in unseen)
    torch.cuda.synchronize()  # (a family lookup records nothing: the timed calls meet the same state)
    t = time.perf_counter()
    for M in unseen:
        tile_ops.gemm(a[:M], b)
    per_call = (time.perf_counter() - t) / count * 1e6
    torch.cuda.synchronize()
    return per_call, served / count


def check_fast_path_taken(a, b, scale):
    """The fast-path rows must not silently measure the dispatcher path."""
    planned = (fastpath.call(GEMM.plan_id, (a, b, None), (None,), True) is not None
               and fastpath.call(GEMM_SOFTMAX.plan_id, (a, b), (scale, None), True) is not None)
    if not planned:
        raise SystemExit("bench_overhead: tile_ops.gemm / gemm_softmax would not take the eager fast path here")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="64x64x64", help="MxNxK")
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--json")
    args = p.parse_args()
    M, N, K = map(int, args.shape.split("x"))
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    scale = K ** -0.5
    cases = {
        "tile_ops.gemm (fast path)": lambda: tile_ops.gemm(a, b),
        "torch.ops.tile_ops.gemm (dispatcher)": lambda: torch.ops.tile_ops.gemm(a, b),
        "tile_ops.gemm_softmax (fast path)": lambda: tile_ops.gemm_softmax(a, b, scale),
        "torch.ops.tile_ops.gemm_softmax (dispatcher)": lambda: torch.ops.tile_ops.gemm_softmax(a, b, scale),
        "torch.matmul": lambda: torch.matmul(a, b),
    }
    for fn in cases.values():  # compile / load the kernels and record the plans
        fn()
    check_fast_path_taken(a, b, scale)
    ref = torch.matmul(a.double(), b.double())
    for name, got, want in (("tile_ops.gemm", tile_ops.gemm(a, b), ref),
                            ("tile_ops.gemm_softmax", tile_ops.gemm_softmax(a, b, scale), torch.softmax(scale * ref, -1))):
        err = ((got.double() - want).norm() / want.norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"bench_overhead: {name} is wrong here (relative error {err:.1e})")
    rows = []
    for name, fn in cases.items():
        w, k = wall_us(fn, args.iters), kernel_us(fn)
        rows.append({"path": name, "wall_us": round(w, 2), "kernel_us": round(k, 2),
                     "overhead_us": round(w - k, 2), "host_us": round(host_us(fn), 2)})
    print_table(rows, list(rows[0]), f"Per-call overhead (wall - kernel), {M}x{N}x{K} fp16, on "
                f"{torch.cuda.get_device_name()} (torch {torch.__version__})")
    overhead = rows[0]["overhead_us"]
    print(f"tile_ops.gemm overhead {overhead} us: {'under' if overhead < BAR_US else 'OVER'} the {BAR_US:g} us bar "
          f"(torch.matmul: {rows[-1]['overhead_us']} us)")
    new_m, served = unseen_m_us(K, N)
    print(f"tile_ops.gemm at a token count never seen (N={N}, K={K}), after 100 random ones in 1..16384: "
          f"{new_m:.1f} us of host time per call; {served:.0%} of such calls served by a plan family")
    stages = host_stages(a, b)
    if stages:
        print_table(stages, list(stages[0]), "Host time of the fast path's stages (each alone, per call)")
    save({"paths": rows, "host_stages": stages, "unseen_m_host_us": round(new_m, 2), "unseen_m_served": served},
         args.json)


if __name__ == "__main__":
    main()
