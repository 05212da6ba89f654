"""``T.atomic_add(dst, src)``: a float32 fragment or shared tile added into a global window, one atomic
``red.global.add`` per element (two or four consecutive ones per instruction on sm_90a), predicated at the
tensor's edges; a shared tile on the warp-specialized sm_90a path by TMA's reduce-add instead (a box per
swizzle panel, rows past the tensor's edge dropped: warp_specialized's stores)."""

from __future__ import annotations

from tvm.tirx.script import builder as T

from ...lang.ir import AtomicAdd, error
from ..cuda import helper
from ..exprs import pad, squeeze
from . import TileOp, tile_op
from .copy import copy_extents

_ADD = {
    1: ("tile_ops_atomic_add", """
__forceinline__ __device__ void tile_ops_atomic_add(float* p, float a) { atomicAdd(p, a); }
"""),
    2: ("tile_ops_atomic_add2", """
__forceinline__ __device__ void tile_ops_atomic_add2(float* p, float a, float b) {
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
}
"""),
    4: ("tile_ops_atomic_add4", """
__forceinline__ __device__ void tile_ops_atomic_add4(float* p, float a, float b, float c, float d) {
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
}
"""),
}


@tile_op(AtomicAdd)
class AtomicAddOp(TileOp):
    def reads(self, node, buffers):
        return [node.src.buffer, node.dst.buffer]

    def writes(self, node):
        return [node.dst.buffer]

    def lower(self, lw, node, vm):
        if lw.ws and lw.ws.is_tma_store(node):  # a shared tile on the warp-specialized path: TMA's reduce-add
            return lw.ws.tma_store(node, vm)
        extents = copy_extents(lw, node)
        s_start = [lw.expr(x, vm) for x in node.src.starts]
        d_start = [lw.expr(x, vm) for x in node.dst.starts]
        src, dst = node.src.buffer, node.dst.buffer
        if src.scope == "shared":
            vec = _width(lw, dst, d_start, extents[-1])

            def one(idx):
                s_idx = [a + b for a, b in zip(s_start, pad(idx, s_start))]
                values = [lw.load(src, s_idx[:-1] + [s_idx[-1] + e]) for e in range(vec)]
                _add(lw, dst, [a + b for a, b in zip(d_start, pad(idx, d_start))], values)

            return lw.flat_loop(extents, one, vec)
        lay = lw.infer.layouts[src]
        if squeeze(lay.shape) != squeeze(extents):
            raise error(node.loc, f"T.atomic_add: fragment {src.name}{list(src.shape)} is added whole, got a "
                                  f"region of {extents}")
        vec = _width(lw, dst, d_start, lay.vec) if lay.local_size % max(lay.vec, 1) == 0 else 1
        with T.unroll(0, lay.local_size // vec) as rv:
            r = rv * vec
            idx = list(lay.coords(lw.tid, r))
            _add(lw, dst, [a + b for a, b in zip(d_start, pad(idx, d_start))],
                 [lw.frags[src][r + e] for e in range(vec)])


def _width(lw, dst, start, run: int) -> int:
    """Consecutive elements one instruction adds: 4 or 2 where sm_90a's vector atomics take them (aligned, within
    ``run``), else 1."""
    if not lw.target.hopper:
        return 1
    return next((v for v in (4, 2) if run % v == 0 and lw.vector_ok(dst, start[-1], v)), 1)


def _add(lw, dst, idx, values):
    name, source = _ADD[len(values)]
    pred = lw.in_bounds(dst, [0] * len(idx), idx)
    call = lambda: T.evaluate(helper(name, source, lw.global_ptr(dst, idx), *values))  # noqa: E731
    if pred is None:
        return call()
    with T.If(pred):
        with T.Then():
            call()
