"""tile_ops.compiler — tile IR -> TIRx -> CUDA.

``compile_program(prog, arch)`` infers layouts, lowers the tile ops for the target under the kernel's
schedule, and returns the CUDA source with the ``KernelMeta`` a launcher needs (entry, grid, block, shared
memory, parameters, tensor maps).  The package's ``__init__`` imports no TVM: the kernels' heuristics and the
JIT read ``targets`` and ``meta`` without it.  Its rooms (compiler/README.md): ``lower`` (the driver),
``infer`` and ``layout``, ``memory``, ``ops/`` (one unit per tile op), ``schedules/``, ``targets/``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .meta import WORKSPACE, KernelMeta
from .targets import Target

if TYPE_CHECKING:
    from ..lang.ir import Program


@dataclass
class CompiledKernel:
    source: str  # CUDA
    meta: KernelMeta
    tir: str  # the lowered TIRx, as TVMScript (for reading)
    codegen_s: float = 0.0  # of the compile, the seconds in TVM's passes and CUDA code generator (emit_cuda)


def _indexed_too_far(kernel: str, huge: dict) -> ValueError:
    what = ", ".join(f"{name} {tuple(shape)} ({math.prod(shape):,} elements)" for name, shape in huge.items())
    return ValueError(f"{kernel}: {what}: 2^31 elements or more, which this kernel addresses with 32-bit offsets "
                      f"(accepted: tensors of fewer than 2^31 elements; on sm_90a, larger ones only where every "
                      f"copy of them is a TMA copy). Split the problem, e.g. along M, into parts below that")


def check_grid(kernel: str, grid, arch: str) -> None:
    """``grid`` within CUDA's limits, else ValueError."""
    if grid[0] >= 2**31 or max(grid[1:]) > 65535:
        raise ValueError(f"{kernel}: a launch grid of {tuple(grid)} blocks, past CUDA's limits (x below 2^31, y and "
                         f"z at most 65535; for the library's gemm on {arch}, y counts M's row tiles and z the batch). "
                         f"Split the problem into launches within them")


def compile_program(prog: Program, arch: str = "sm_80", sms: int | None = None) -> CompiledKernel:
    """CUDA for ``prog`` on ``arch``; ``sms``: the SM count of the GPU it is for (default: the arch's table)."""
    from .codegen import emit_cuda
    from .lower import lower

    lowered = lower(prog, Target.of(arch, sms))
    meta = lowered.meta
    if all(isinstance(g, int) for g in meta.grid):  # a T.dynamic grid is checked at each launch
        check_grid(prog.name, meta.grid, arch)
    huge = {name: shape for name, shape, _ in meta.params
            if all(isinstance(d, int) for d in shape) and math.prod(shape) >= 2**31}
    by_tma = {spec["tensor"] for spec in meta.tensormaps.values()}
    if any(name not in by_tma for name in huge):  # indexed for sure; TVM can abort (bad_alloc) building it
        raise _indexed_too_far(prog.name, {n: s for n, s in huge.items() if n not in by_tma})
    t0 = time.perf_counter()
    try:
        source, entry, kept = emit_cuda(lowered.func, meta, arch)
    except Exception as e:  # a flattened offset past int32 is a literal TVM refuses
        if huge:
            raise _indexed_too_far(prog.name, huge) from e
        raise
    if any(name in kept for name in huge):  # its pointer is indexed (not a TMA descriptor): 32-bit offsets
        raise _indexed_too_far(prog.name, {n: s for n, s in huge.items() if n in kept})
    known = ({name for name, _, _ in meta.params} | {name for name, _ in meta.dims + meta.scalars}
             | set(meta.tensormaps) | {WORKSPACE})
    if not set(kept) <= known:  # a value the launcher cannot pass (TVM hoisted an expression to the host side)
        raise RuntimeError(f"tile_ops: {prog.name}'s CUDA entry takes {sorted(set(kept) - known)}, which is no "
                           f"parameter, T.dynamic size or tensor map of the program; please report this kernel")
    codegen_s = time.perf_counter() - t0
    return CompiledKernel(source, meta.replace(entry=entry, kept=kept), lowered.func.script(), codegen_s)
