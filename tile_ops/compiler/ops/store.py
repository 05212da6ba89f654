"""``buf[i, j] = value``: an element assignment that every thread runs (a local or global buffer)."""

from __future__ import annotations

from ...lang.ir import Store, error
from ..exprs import collect_loads
from . import TileOp, tile_op


def loaded(expr, buffers) -> list:
    """The program's buffers that ``expr`` loads from."""
    return [b for b in (buffers.get(var) for var, _ in collect_loads(expr)) if b is not None]


@tile_op(Store)
class StoreOp(TileOp):
    def reads(self, node, buffers):
        return loaded(node.value, buffers) + ([] if node.mask is None else loaded(node.mask, buffers))

    def writes(self, node):
        return [node.buffer]

    def lower(self, lw, node, vm):
        if node.buffer.scope == "fragment":
            raise error(node.loc, f"fragment {node.buffer.name} can only be written inside T.Parallel or by tile ops")
        # predicated as in T.Parallel: global indices past the end read 0 and write nothing
        lw.guarded_store(node.buffer, [lw.expr(i, vm) for i in node.indices], lw.expr(node.value, vm, guard=True),
                         mask=None if node.mask is None else lw.expr(node.mask, vm, guard=True))
