"""tile_ops.compiler — tile IR -> TIRx -> CUDA.

``compile_program(prog, arch)`` infers layouts, lowers tile ops for the target, and returns the
CUDA source with everything a launcher needs (entry, grid, block, shared memory, parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..lang import MAX_CLUSTER

if TYPE_CHECKING:  # the package itself stays TVM-free: the kernels' heuristics use wave_ctas
    from ..lang.ir import Program

SMS = 132  # of an H100 SXM / H200: warp-specialized kernels with more tiles than resident CTAs loop over them


def wave_ctas(cluster: int = 1) -> int:
    """Warp-specialized CTAs of one SM each that an H200 runs at once in clusters of ``cluster`` (an estimate
    for clusters of 4 and 8: GPCs hold whole clusters), a multiple of ``cluster``."""
    if cluster <= 2:
        return SMS // cluster * cluster
    return SMS // MAX_CLUSTER * MAX_CLUSTER // cluster * cluster


@dataclass
class CompiledProgram:
    source: str
    entry: str
    arch: str
    grid: tuple
    block: tuple
    smem_bytes: int
    params: list  # [(name, shape, dtype)] of the program, in order
    kept: list  # names of the parameters the CUDA entry takes, in order
    layouts: dict = field(default_factory=dict)
    tir: str = ""
    tensormaps: dict = field(default_factory=dict)  # CUDA parameter name -> TMA descriptor spec
    ctas_per_sm: int = 1
    cluster: int = 1
    persistent_tiles: int = 0
    workspace_floats: int = 0
    workspace_fixed_floats: int = 0
    waits_at_entry: bool = False  # griddepcontrol.wait first: it can be launched programmatically


def _indexed_too_far(kernel: str, huge: dict) -> ValueError:
    what = ", ".join(f"{name} {tuple(shape)} ({math.prod(shape):,} elements)" for name, shape in huge.items())
    return ValueError(f"{kernel}: {what}: 2^31 elements or more, which this kernel addresses with 32-bit offsets "
                      f"(accepted: tensors of fewer than 2^31 elements; on sm_90a, larger ones only where every "
                      f"copy of them is a TMA copy). Split the problem, e.g. along M, into parts below that")


def compile_program(prog: Program, arch: str = "sm_80") -> CompiledProgram:
    from .codegen import emit_cuda
    from .lower import lower

    lowered = lower(prog, arch)
    if lowered.grid[0] >= 2**31 or max(lowered.grid[1:]) > 65535:
        raise ValueError(f"{prog.name}: a launch grid of {tuple(lowered.grid)} blocks, past CUDA's limits (x below "
                         f"2^31, y and z at most 65535; for the library's gemm on {arch}, y counts M's row tiles and "
                         f"z the batch). Split the problem into launches within them")
    huge = {name: shape for name, shape, _ in lowered.params if math.prod(shape) >= 2**31}
    by_tma = {spec["tensor"] for spec in lowered.tensormaps.values()}
    if any(name not in by_tma for name in huge):  # indexed for sure; TVM can abort (bad_alloc) building it
        raise _indexed_too_far(prog.name, {n: s for n, s in huge.items() if n not in by_tma})
    try:
        source, entry, kept = emit_cuda(lowered, arch)
    except Exception as e:  # a flattened offset past int32 is a literal TVM refuses
        if huge:
            raise _indexed_too_far(prog.name, huge) from e
        raise
    if any(name in kept for name in huge):  # its pointer is indexed (not a TMA descriptor): 32-bit offsets
        raise _indexed_too_far(prog.name, {n: s for n, s in huge.items() if n in kept})
    return CompiledProgram(source, entry, arch, lowered.grid, lowered.block, lowered.smem_bytes,
                           lowered.params, kept, lowered.layouts, lowered.func.script(), lowered.tensormaps,
                           lowered.ctas_per_sm, lowered.cluster, lowered.persistent_tiles,
                           lowered.workspace_floats, lowered.workspace_fixed_floats, lowered.waits_at_entry)
