"""TIRx -> CUDA source through TVM's CUDA code generator."""

from __future__ import annotations

import re

import tvm

from .meta import KernelMeta

_ENTRY = re.compile(r'extern "C" __global__ void (?:__cluster_dims__\([^)]*\) )?(?:__launch_bounds__\(\d+(?:,\s*\d+)?\) )?'
                    r'(\w+)\(([^)]*)\)\s*\{')


def target_for(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def emit_cuda(func, meta: KernelMeta, arch: str) -> tuple[str, str, list[str]]:
    """CUDA source, the entry symbol, and the names of the parameters it kept, in order
    (TVM drops parameters the kernel never touches)."""
    mod = tvm.compile(tvm.IRModule({"main": func}), target=target_for(arch), tir_pipeline="tirx")
    source = mod.mod.imports[0].inspect_source()
    if meta.ctas_per_sm > 1:  # cap registers so that many CTAs fit on an SM (setmaxnreg rebalances them)
        source = re.sub(r"__launch_bounds__\((\d+)\)", rf"__launch_bounds__(\1, {meta.ctas_per_sm})", source)
    if meta.cluster > 1:  # compile-time cluster dims: a plain cuLaunchKernel launches clusters
        source = source.replace('extern "C" __global__ void ',  # the declaration and the definition
                                f'extern "C" __global__ void __cluster_dims__{meta.cluster_dims} ')
    m = _ENTRY.search(source)
    if m is None:
        raise RuntimeError("tile_ops: could not find the kernel entry in TVM's CUDA output")
    names = [p.strip().split()[-1] for p in m.group(2).split(",") if p.strip()]
    params = [n[: -len("_ptr")] if n.endswith("_ptr") else n for n in names]
    return source, m.group(1), params
