"""``T.fill(buf, value)`` / ``T.clear(buf)``: every element of a fragment, local array or shared tile."""

from __future__ import annotations

import math

from tvm.tirx.script import builder as T

from ...lang.ir import Fill
from ..exprs import broadcastable, cast, dtype_bits, unflatten, widest
from . import TileOp, tile_op


@tile_op(Fill)
class FillOp(TileOp):
    def writes(self, node):
        return [node.buffer]

    def lower(self, lw, node, vm):
        b = node.buffer
        value = lw.expr(node.value, vm)
        if b.scope == "fragment":
            with T.unroll(0, lw.infer.layouts[b].local_size) as r:
                T.buffer_store(lw.frags[b], cast(value, b.dtype), [r])
        elif b.scope == "local":
            with T.unroll(0, math.prod(b.shape)) as r:
                T.buffer_store(lw.locals[b], cast(value, b.dtype), [r] if len(b.shape) == 1 else unflatten(r, b.shape))
        else:
            bits = dtype_bits(b.dtype)
            vec = widest(bits, lambda v: lw.vector_ok(b, 0, v) and broadcastable(bits, v))
            lw.flat_loop(list(b.shape), lambda idx: lw.store(b, idx, value, vec=vec), vec)
