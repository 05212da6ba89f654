"""Host cost per call of the ops' Python paths, on the CPU (no GPU needed), stage by stage.

    python benchmarks/host_overhead_cpu.py [--iters 20000] [--repeat 7] [--json out.json]

CPU tensors run the ops' CUDA code paths with stand-ins for what needs CUDA: the dispatcher's CPU
kernel is the CUDA implementation, the JIT returns a kernel without compiling, and the stream
lookup and the driver launch do nothing.  So each number is the host work of that path minus the
real ``torch.cuda.current_stream`` and ``cuLaunchKernel`` (and with ``torch.empty`` on the CPU
allocator).  Each is the fastest of ``--repeat`` runs of ``--iters`` calls.  For the GPU numbers (wall time
minus kernel time) see bench_overhead.py.
"""

import argparse
import contextlib
import importlib
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table, save  # noqa: E402

import tile_ops  # noqa: E402
from tile_ops.compiler.meta import KernelMeta  # noqa: E402
from tile_ops.jit.kernel import Kernel  # noqa: E402
from tile_ops.ops import fastpath  # noqa: E402

jit_mod = importlib.import_module("tile_ops.jit")  # the module: tile_ops.jit is the decorator
GEMM = importlib.import_module("tile_ops.ops.gemm").GEMM  # the ops' OpSpecs (tile_ops.ops.gemm is the function)
GEMM_SOFTMAX = importlib.import_module("tile_ops.ops.gemm_softmax").GEMM_SOFTMAX


class _NoLaunch:
    smem_bytes, name = 0, "stand_in"

    def bind(self, device):
        return (lambda handle, grid, block, smem, stream, args, name: None), 0


def _fake_build(key, trace, arch, out_idx):
    """A Kernel with the traced program's parameters and no cubin (nothing is compiled)."""
    params = [(buf.name, tuple(buf.shape), buf.dtype) for buf in trace().params]
    names = [name for name, _, _ in params]
    return Kernel(KernelMeta(name="stand_in", entry="stand_in", arch=arch, grid=(1, 1, 1), block=(128, 1, 1),
                             smem_bytes=0, params=params, kept=names, out_idx=out_idx), "", b"")


def install_stand_ins():
    jit_mod._load_or_build = _fake_build
    Kernel._fn = lambda self: _NoLaunch()
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda device: contextlib.nullcontext()
    # plans of host code that does nothing: a native plan's launch needs the driver
    for module, plan in (("gemm_launch", "gemm_plan"), ("gemm_softmax_launch", "gemm_softmax_plan")):
        setattr(importlib.import_module(f"tile_ops.kernels.{module}"), plan, lambda *args, **kw: lambda *ptrs: None)
    GEMM.op.register_kernel("cpu", GEMM.cuda)
    GEMM_SOFTMAX.op.register_kernel("cpu", GEMM_SOFTMAX.cuda)


def per_call_us(fn, iters, repeat):
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        best = min(best, time.perf_counter_ns() - t)
    return best / iters / 1e3


def cases(a, b):
    kernel = importlib.import_module("tile_ops.kernels.gemm_launch").get_gemm_kernel(a[None], b[None], a[None])[0]
    return {
        "tile_ops.gemm (fast path)": lambda: tile_ops.gemm(a, b),
        "torch.ops.tile_ops.gemm (dispatcher + plan)": lambda: torch.ops.tile_ops.gemm(a, b),
        "gemm checked path (a signature's first call)": lambda: GEMM.launch(a, b, None, None),
        "tile_ops.gemm_softmax (fast path)": lambda: tile_ops.gemm_softmax(a, b, 0.125),
        "torch.ops.tile_ops.gemm_softmax (dispatcher + plan)": lambda: torch.ops.tile_ops.gemm_softmax(a, b, 0.125),
        "fast path stage: fastpath.call (C++)": lambda: fastpath.call(GEMM.plan_id, (a, b, None), (None,), True),
        "  for scale: torch.empty from Python": lambda: torch.empty(64, 64, dtype=a.dtype),
        "  for scale: Kernel.launch_ptrs (the checked path's launch)": lambda: kernel.launch_ptrs([16, 32, 48, 64], a.device),
        "the dispatcher alone (trivial kernel)": lambda: torch.ops.tile_ops.gemm(a, b),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    install_stand_ins()
    a = torch.randn(64, 64, dtype=torch.float16)
    b = torch.randn(64, 64, dtype=torch.float16)
    for op in (torch.ops.tile_ops.gemm, lambda x, y: torch.ops.tile_ops.gemm_softmax(x, y, 0.125)):
        op(a, b)  # the checked path records the plans
    rows = []
    for name, fn in cases(a, b).items():
        if name.startswith("the dispatcher alone"):
            GEMM.op.register_kernel("cpu", lambda *_: torch.empty(64, 64, dtype=a.dtype))
        rows.append({"path": name, "us_per_call": round(per_call_us(fn, args.iters, args.repeat), 2)})
    print_table(rows, ["path", "us_per_call"], f"Host cost per call on the CPU with CUDA stand-ins, 64x64x64 fp16 "
                f"(torch {torch.__version__}, best of {args.repeat} x {args.iters})")
    save(rows, args.json)


if __name__ == "__main__":
    main()
