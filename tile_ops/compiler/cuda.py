"""Statements and expressions that TIRx has no intrinsic for: one PTX instruction from TVM's table-driven
``T.ptx`` dialect, and calls of small CUDA functions whose source travels with the call (each module keeps
the helpers it uses beside it)."""

from __future__ import annotations

from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T


def emit_ptx(name, *args):
    """One PTX instruction, as a statement."""
    T.evaluate(TS.ptx[name](*args))


def helper(name: str, source: str, *args, return_type="void"):
    """A call of the CUDA function ``name`` defined in ``source`` (an expression; wrap a void one in
    ``T.evaluate``)."""
    return TS.cuda.func_call(name, *args, source_code=source, return_type=return_type)


_GRID_X = """
__forceinline__ __device__ int tile_ops_grid_x() { return gridDim.x; }
"""
_WARP_UNIFORM = """
__forceinline__ __device__ int tile_ops_warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
"""
_ONCE = """
__forceinline__ __device__ int tile_ops_once(int v) { return v; }
"""
_EXP2 = """
__forceinline__ __device__ float tile_ops_exp2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
"""


def grid_x():
    """gridDim.x: a persistent grid's size, which the launcher chooses per device."""
    return helper("tile_ops_grid_x", _GRID_X, return_type="int32")


def warp_uniform(v):
    """``v`` as lane 0 holds it (``__shfl_sync``, all threads converged), so nvcc knows it is warp-uniform."""
    return helper("tile_ops_warp_uniform", _WARP_UNIFORM, v, return_type="int32")


def once(v):
    """``v`` as a call TVM's simplifier does not see through: bound to a variable (``T.Bind``), it is computed
    there once instead of being inlined into every use (TVM inlines pure integer bindings)."""
    return helper("tile_ops_once", _ONCE, v, return_type="int32")


def exp2_approx(x):
    """2^x in float32 as one MUFU.EX2 (ex2.approx.ftz: 2 ulp, results under 2^-126 flushed to 0); exp2f
    keeps subnormal results with a compare and two multiplies around it, 3 of a softmax's ~9
    instructions per score."""
    return helper("tile_ops_exp2", _EXP2, x, return_type="float32")


def l2_cache_hint(eviction: str | None) -> tuple[str, list]:
    """(modifier, operands) that give a TMA or cp.async load T.copy's ``eviction_policy``: ``.L2::cache_hint``
    and a 64-bit policy, made here by createpolicy, giving every line the load brings in that priority;
    nothing for the normal priority (``None``)."""
    if eviction is None:
        return "", []
    policy = T.alloc_local([1], "uint64")
    IRBuilder.name(f"l2_{eviction}", policy)
    emit_ptx(f"createpolicy.fractional.L2::{eviction}.b64", policy[0])
    return ".L2::cache_hint", [policy[0]]
