"""TIRx -> CUDA source through TVM's CUDA code generator."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading

import tvm

from .meta import KernelMeta

_ENTRY = re.compile(r'extern "C" __global__ void (?:__cluster_dims__\([^)]*\) )?(?:__launch_bounds__\(\d+(?:,\s*\d+)?\) )?'
                    r'(\w+)\(([^)]*)\)\s*\{')


def target_for(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch})


@functools.lru_cache(maxsize=None)
def _register_dynamic_pipeline() -> str:
    """TVM's "tirx" pipeline without its common-subexpression elimination, for kernels with T.dynamic sizes:
    it would hoist expressions of them to the host side, as extra entry parameters the launcher does not
    know (the config switch for it, "tir.disable_cse_tir", is a key TVM 0.27's PassContext refuses)."""
    from tvm import s_tir, tirx
    from tvm.backend.cuda import transforms as cuda_transforms
    from tvm.tirx import compilation_pipeline as pipelines

    def factory():
        @tvm.transform.module_pass(opt_level=0)
        def passes(mod, _ctx):
            t = tirx.transform
            return tvm.ir.transform.Sequential([
                t.LowerTIRx(), s_tir.transform.UnifyThreadBinding(), t.StmtSimplify(), t.LowerTIRxOpaque(),
                t.FlattenBuffer(), t.BF16ComputeLegalize(), t.NarrowDataType(32), t.VectorizeLoop(True),
                t.UnrollLoop(), t.StmtSimplify(), t.FP8ComputeLegalize(), t.VerifyMemory(), t.AnnotateEntryFunc(),
                t.SplitHostDevice(), cuda_transforms.LowerIket(), t.MakePackedAPI(), t.FP8StorageLegalize(),
                t.BF16StorageLegalize()])(mod)

        _, host, device = pipelines.tirx_pipeline()
        return passes, host, device

    pipelines.register_tir_pipeline("tile_ops_dynamic", factory)
    return "tile_ops_dynamic"


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _source_only():
    """TVM's codegen builds its CUDA module through the CUDA runtime where that loads (a machine with a GPU
    driver), which compiles the source with NVRTC or nvcc on the spot: seconds per kernel, thrown away here
    since nvcc builds the cubin.  TVM_COMPILE_FORCE_FALLBACK makes it keep the source alone."""
    with _ENV_LOCK:
        before = os.environ.get("TVM_COMPILE_FORCE_FALLBACK")
        os.environ["TVM_COMPILE_FORCE_FALLBACK"] = "1"
        try:
            yield
        finally:
            if before is None:
                del os.environ["TVM_COMPILE_FORCE_FALLBACK"]
            else:
                os.environ["TVM_COMPILE_FORCE_FALLBACK"] = before


def emit_cuda(func, meta: KernelMeta, arch: str) -> tuple[str, str, list[str]]:
    """CUDA source, the entry symbol, and the names of the parameters it kept, in order
    (TVM drops parameters the kernel never touches)."""
    pipeline = _register_dynamic_pipeline() if meta.dims or meta.scalars else "tirx"
    with _source_only():
        mod = tvm.compile(tvm.IRModule({"main": func}), target=target_for(arch), tir_pipeline=pipeline)
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
