"""``T.reduce_max`` / ``T.reduce_min`` / ``T.reduce_sum`` over the rows of a gemm accumulator: each thread folds
its own columns, a quad's shuffles the row's 4 lanes, and shared memory the warps that split a row."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx import op as top
from tvm.tirx.script import builder as T

from ...lang.ir import Reduce, error
from ..exprs import cast
from ..layout import MmaAccumLayout
from . import TileOp, tile_op


def not_accumulator(node: Reduce):
    return error(node.loc, f"T.reduce_*: {node.src.name} must have a gemm accumulator layout "
                           f"(reduce a fragment produced by T.gemm or copied from one)")


def _across_warps(lw, node) -> bool:
    lay = lw.infer.layouts.get(node.src)
    return isinstance(lay, MmaAccumLayout) and lay.w.wn > 1


def tree_fold(op, values: list):
    """``op`` over ``values`` as a balanced tree: log2(n) dependent steps instead of n, on the softmax's
    critical path (max is exact in any order; a sum rounds in another order, no less accurately).  Each level
    goes through a local array: TVM's simplifier would fold a tree expression back into a chain."""
    if len(values) <= 2:
        return values[0] if len(values) == 1 else op(*values)
    level = T.alloc_local([(len(values) + 1) // 2], "float32")
    IRBuilder.name("level", level)
    while len(values) > 1:
        pairs = [values[i:i + 2] for i in range(0, len(values), 2)]
        for k, pair in enumerate(pairs):
            T.buffer_store(level, op(*pair) if len(pair) == 2 else pair[0], [k])
        values = [level[k] for k in range(len(pairs))]
    return values[0]


FOLDS = {  # kind -> (combine, identity)
    "max": (tirx.max, -tirx.infinity("float32")),
    "min": (tirx.min, tirx.infinity("float32")),
    "sum": (lambda a, b: a + b, tirx.const(0.0, "float32")),
}


@tile_op(Reduce)
class ReduceOp(TileOp):
    def reads(self, node, buffers):
        return [node.src] + ([] if node.clear else [node.dst])

    def writes(self, node):
        return [node.dst]

    def propagate(self, inf, node):
        src_l = inf.layouts.get(node.src)
        if node.src.scope != "fragment" or node.dst.scope != "fragment":
            raise error(node.loc, "T.reduce_*: source and destination must be fragments")
        if src_l is None:
            return False
        if len(node.src.shape) != 2 or node.dim not in (1, -1):
            raise error(node.loc, "T.reduce_*: only row reductions (dim=1) of 2-D fragments are supported")
        if not isinstance(src_l, MmaAccumLayout):
            raise not_accumulator(node)
        return inf.assign(node.dst, src_l.row_layout(), node)

    def require(self, inf, node):
        if node.src not in inf.layouts:  # a default would be a blocked layout: rows spread over threads
            raise not_accumulator(node)

    def touches_shared(self, lw, node):
        return _across_warps(lw, node)

    def writes_shared(self, lw, node):  # its partials, through the ops' scratch
        return _across_warps(lw, node)

    def scratch_bytes(self, lw, node):
        lay = lw.infer.layouts.get(node.src)
        return lay.w.M * lay.w.wn * 4 if _across_warps(lw, node) else 0

    def lower(self, lw, node, vm):
        src_l: MmaAccumLayout = lw.infer.layouts[node.src]
        dst_l = lw.infer.layouts[node.dst]
        op, init = FOLDS[node.kind]
        src, dst = lw.frags[node.src], lw.frags[node.dst]
        ni = src_l.ni
        part = T.alloc_local([dst_l.local_size], "float32")
        IRBuilder.name("partial", part)
        for rr in range(dst_l.local_size):
            mi, h = rr // 2, rr % 2
            own = [cast(src[(mi * ni + nj) * 4 + e], "float32") for nj in range(ni) for e in (2 * h, 2 * h + 1)]
            T.buffer_store(part, tree_fold(op, own) if own else init, [rr])
            for mask in (1, 2):  # the 4 lanes of a quad hold one row
                T.buffer_store(part, op(part[rr], top.tvm_warp_shuffle_xor(0xFFFFFFFF, part[rr], mask, 32, 32)), [rr])
        w = src_l.w
        if w.wn > 1:  # rows spread over warps: combine through shared memory
            lane = tirx.floormod(lw.tid, 32)
            wr, wc = src_l.warp_rc(lw.tid)
            lw.sync()
            with T.If(tirx.floormod(lane, 4) == 0):
                with T.Then():
                    for rr in range(dst_l.local_size):
                        row = dst_l.coords(lw.tid, rr)[0]
                        T.buffer_store(lw.scratch, part[rr], [row * w.wn + wc])
            lw.sync()
            for rr in range(dst_l.local_size):
                row = dst_l.coords(lw.tid, rr)[0]
                v = lw.scratch[row * w.wn]
                for c in range(1, w.wn):
                    v = op(v, lw.scratch[row * w.wn + c])
                T.buffer_store(part, v, [rr])
        for rr in range(dst_l.local_size):
            v = part[rr] if node.clear else op(cast(dst[rr], "float32"), part[rr])
            T.buffer_store(dst, cast(v, node.dst.dtype), [rr])
