"""``T.cluster_allreduce``: fragments reduced elementwise over the blocks of a thread-block cluster (sm_90a),
through their shared memory, by the op's combine expression.

One owner thread per element sends its value(s) into slot ``rank`` of every block's exchange buffer with
``st.async`` (to the ``mapa`` address of the same offset in the peer), which counts the bytes on that
block's exchange mbarrier (complete_tx): no fence, no remote arrive.  One consumer thread arrives on its
own barrier expecting the bytes of all n blocks; every consumer waits on it and reduces the slots of its
elements.  Only the consumers take part, so a persistent producer runs ahead freely.  Buffer and barrier
alternate with the tile's parity: a peer can be at most one exchange ahead (it needs this block's values
of the next tile, sent after a consumer barrier that follows this block's reads of this one's), so it
never overwrites unread values or completes bytes onto a phase this block has not waited on.  The parity
is of the uses of this exchange this warpgroup has made (a stream-K writer's tile makes none), the same
count in every block of the cluster, which walk the same tiles.  One exchange per tile: the frontend
refuses an exchange inside a loop."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...lang.ir import ClusterReduce, error, walk
from ..cuda import emit_ptx
from ..exprs import flat_index
from ..targets import sm90
from . import TileOp, tile_op


@tile_op(ClusterReduce)
class ClusterReduceOp(TileOp):
    def reads(self, node, buffers):
        return list(node.buffers)

    def writes(self, node):
        return list(node.buffers)

    def touches_shared(self, lw, node):
        return False  # its exchange orders itself (a consumer barrier, then mbarriers)

    def regions(self, lw, node):
        """Two sets of slots, [parity][rank][element][value]: consecutive tiles alternate."""
        return [(_slots_name(node), 2 * lw.cluster * math.prod(node.buffers[0].shape) * len(node.buffers))]

    def mbarriers(self, lw, node):
        return 2 * lw.consumers  # per consumer warpgroup, one per tile parity

    def init_mbarriers(self, lw, node):
        for consumer in range(lw.consumers):  # one local arrival (expect_tx); the peers' bytes
            for parity in (0, 1):
                emit_ptx("mbarrier.init.shared::cta.b64", _exchanged(lw, node, parity, consumer), 1)

    def setup(self, lw, nodes):
        """The consumer's count of the uses of each exchange (its buffers' and barriers' parity and phase)."""
        lw.exchanges = T.alloc_local([len(nodes)], "int32")
        IRBuilder.name("exchanges", lw.exchanges)
        for i in range(len(nodes)):
            T.buffer_store(lw.exchanges, 0, [i])

    def lower(self, lw, node, vm):
        n, vals = lw.cluster, len(node.buffers)
        lay = lw.infer.layouts[node.buffers[0]]
        if any(lw.infer.layouts[b] != lay for b in node.buffers[1:]):
            raise error(node.loc, f"T.cluster_allreduce: {', '.join(b.name for b in node.buffers)} must have one "
                                  f"layout (e.g. reductions of the same tile)")
        i = _index(lw, node)
        count = lw.exchanges[i]
        parity = tirx.floormod(count, 2)
        frags, ex = [lw.frags[b] for b in node.buffers], lw.regions[(id(node), _slots_name(node))]
        bar = _exchanged(lw, node, parity)
        elems = math.prod(node.buffers[0].shape)
        base = parity * (n * elems * vals)  # slots [parity][rank][element][value]
        flat = [flat_index(lay.coords(lw.tid, r), node.buffers[0].shape) for r in range(lay.local_size)]
        rank = sm90.cluster_position(lw)[0]
        owner = lay.owner(lw.tid)
        # every consumer (of this warpgroup, with pingpong) is done reading this buffer's previous use (two
        # of its tiles ago) before the owners' values let a peer run ahead and overwrite it
        lw.sync()
        with T.If(lw.tid == 0):
            with T.Then():
                emit_ptx("mbarrier.arrive.expect_tx.shared::cta.b64", bar, n * elems * vals * 4)
        with T.If(owner if owner is not None else tirx.const(True, "bool")):
            with T.Then():
                for r in range(lay.local_size):
                    slot = ex.ptr_to([base + (rank * elems + flat[r]) * vals])
                    values = [f[r] for f in frags]
                    for peer in range(n):
                        sm90.cluster_put(slot, bar, tirx.const(peer, "uint32"), *values)
        phase = tirx.Cast("uint32", tirx.floormod(tirx.floordiv(count, 2), 2))
        sm90.cluster_wait(bar, phase)
        for r in range(lay.local_size):
            slots = {var: ex[base + (peer * elems + flat[r]) * vals + v]
                     for peer, vars_ in enumerate(node.peers) for v, var in enumerate(vars_)}
            values = [lw.expr(result, slots) for result in node.results]
            for frag, value in zip(frags, values):
                T.buffer_store(frag, value, [r])
        T.buffer_store(lw.exchanges, count + 1, [i])  # after the last use of `count` (a lazy load)


def _exchanges(lw) -> list:
    return [n for n in walk(lw.kernel.body) if isinstance(n, ClusterReduce)]


def _index(lw, node) -> int:
    return next(j for j, c in enumerate(_exchanges(lw)) if c is node)


def _slots_name(node) -> str:
    return f"{node.buffers[0].name}_cluster"


def _exchanged(lw, node, parity, consumer=None):
    """The mbarrier on which the exchange's values of tiles of ``parity`` complete (for ``consumer``, by
    default the running warpgroup's)."""
    consumer = lw.consumer if consumer is None else consumer
    return lw.memory.mbarrier(node, 2 * consumer + parity)
