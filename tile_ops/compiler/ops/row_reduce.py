"""``T.row_reduce_store``: a tile stored with each row scaled by a factor of the row's statistics over every
tile of the row, which the grid's x blocks (same y) hold: a row split over many CTAs without a cluster,
normalized once all of them are in (the fused softmax's rows).  It needs the warp-specialized schedule's
persistent tile walk: the consumers publish each tile's row statistics to the workspace and stage the
tile; the producer warpgroup's second warp (``statistics_warp``) waits until every tile of the row block
has published and computes each row's factor (the op's expression of every block's statistics), and the
staged tile is stored, rescaled, after the block's next main loop (``store_pending``)."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...lang.ir import RowReduceStore, error
from ..cuda import emit_ptx, helper
from ..meta import FLAG_SLOTS
from ..schedules.stream_k import flag_signal, flag_wait
from . import Container, tile_op, unit
from .copy import copy

# this reader is done with the row block's statistics; the last of its `count` readers resets the
# flag and the count for the next launch (kernel boundaries order those stores before its reads)
_ROW_STATS_READ = """
__forceinline__ __device__ void tile_ops_row_stats_read(float* flags, int flag, int done, int count) {
  int* f = reinterpret_cast<int*>(flags);
  int before;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(f + done) : "memory");
  if (before == count - 1) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" :: "l"(f + flag) : "memory");
    asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" :: "l"(f + done) : "memory");
  }
}
"""


@tile_op(RowReduceStore)
class RowReduceStoreOp(Container):
    orders_itself = True  # (its publish needs no barrier)
    walks_tiles = True  # a row's tiles run at the same time, on distinct CTAs
    uses_producer_warp = True  # the statistics warp

    def mbarriers(self, lw, node):
        return 4  # "published" and "factors ready", by tile parity

    def init_mbarriers(self, lw, node):
        for slot in (0, 1):  # every consumer thread; every lane of the statistics warp
            emit_ptx("mbarrier.init.shared::cta.b64", _published(lw, node, slot), lw.threads)
            emit_ptx("mbarrier.init.shared::cta.b64", _factors_ready(lw, node, slot), 32)

    def setup(self, lw, nodes):
        """The consumers' record of a staged tile to store, and its block (x, y)."""
        lw.pending = T.alloc_local([3], "int32")
        IRBuilder.name("pending_tile", lw.pending)
        T.buffer_store(lw.pending, 0, [0])

    def lower(self, lw, node, vm):
        """Tile t of the block: publish its rows' (max, sum) to the workspace (the statistics warp signals
        them, off the consumers' path) and stage the tile in place of the previous one, which
        ``store_pending`` stored after the main loop."""
        if not lw.ws:  # (on sm_90a, ``check`` refuses it while planning)
            raise error(node.loc, "T.row_reduce_store needs the warp-specialized sm_90a path (TMA loads, "
                                  "wgmma, a producer warpgroup); this kernel is compiled without it")
        bx, by = (lw.expr(v) for v in lw.kernel.block_vars[:2])
        lay = lw.infer.layouts[node.stats[0]]
        owner = lay.owner(lw.tid)
        with T.If(owner if owner is not None else tirx.const(True, "bool")):
            with T.Then():
                for r in range(lay.local_size):
                    at = _stats_index(lw, node, bx, by, lay.coords(lw.tid, r)[0])
                    for v, stat in enumerate(node.stats):
                        T.buffer_store(lw.workspace, lw.frags[stat][r], [at + v])
        emit_ptx("mbarrier.arrive.shared::cta.b64", _published(lw, node, tirx.floormod(lw.ws.walk.tile_ordinal, 2)))
        lw.sync()  # TMA has read the staged tile (wait_stores_read): it can be rewritten
        copy(lw, node.stage, vm)
        for i, v in enumerate((1, bx, by)):
            T.buffer_store(lw.pending, v, [i])


    def check_schedule(self, lw, node):
        _check_schedule(lw, node)

    def workspace_floats(self, lw, node):
        """Every stat of every row of every tile (after the workspace's flags)."""
        gx, gy = lw.kernel.grid[:2]
        return gx * gy * node.tile.shape[0] * len(node.stats)

    def workspace_flags(self, lw, node):
        """Two per row of tiles (grid y): one per parity of the tile walk."""
        return 2 * lw.kernel.grid[1]

    def producer_warp(self, lw, node, cta):
        _statistics_warp(lw, node, cta)

    def finish_tile(self, lw, node, tile):
        """Store the block's staged tile, its tile ``tile``, if there is one: right after the next tile's
        main loop (its factors were computed during that loop, and TMA reads it while the consumers compute
        the new tile's softmax), and after the block's last tile."""
        with T.If(lw.pending[0] == 1):
            with T.Then():
                _store_pending(lw, node, tile)


def _check_schedule(lw, node):
    k = lw.kernel
    if not lw.ws:
        raise error(node.loc, "T.row_reduce_store needs the warp-specialized sm_90a path: one T.Pipelined "
                              "main loop of TMA loads and wgmma gemms")
    if node.store not in lw.ws.stores:
        raise error(node.loc, "T.row_reduce_store: its destination must be a tile of a global tensor that "
                              "TMA can store (16-byte aligned rows)")
    lay = lw.infer.layouts[node.stats[0]]
    if any(lw.infer.layouts[s] != lay for s in node.stats) or not hasattr(lay, "owner"):
        raise error(node.loc, f"T.row_reduce_store: the stats ({', '.join(s.name for s in node.stats)}) must be row "
                              f"reductions of the tile")
    if isinstance(k.grid[1], int) and 2 * k.grid[1] > FLAG_SLOTS:  # a T.dynamic one: checked at launch
        raise error(node.loc, f"T.row_reduce_store: {k.grid[1]} row blocks; at most {FLAG_SLOTS // 2}")
    if lw.ws.outer:  # the previous tile is stored after the one main loop of a tile
        raise error(node.loc, "T.row_reduce_store needs the T.Pipelined loop at the kernel's top level")


def _stats_index(lw, node, bx, by, row):
    gx, bM = lw.kernel.grid[0], node.tile.shape[0]
    return FLAG_SLOTS + ((by * gx + bx) * bM + row) * len(node.stats)


def _published(lw, node, slot):
    """The consumers have stored the row statistics of their tile of this parity."""
    return lw.memory.mbarrier(node, slot)


def _factors_ready(lw, node, slot):
    """The row-statistics warp has written the row factors of the tile of this parity."""
    return lw.memory.mbarrier(node, 2 + slot)


def _store_pending(lw, node, ordinal):
    """The staged tile of the block's tile ``ordinal`` times its row factors, stored by TMA."""
    slot = tirx.floormod(ordinal, 2)
    # the tile was staged in the accumulator's thread mapping, before a main loop that has no consumer
    # barrier; the rescale reads it row-major (compute-sanitizer racecheck found this one missing)
    lw.sync()
    T.evaluate(TS.cuda.mbarrier_wait(_factors_ready(lw, node, slot), tirx.floormod(tirx.floordiv(ordinal, 2), 2)))
    unit(node.rescale).lower(lw, node.rescale, {node.slot: slot})
    lw.sync()  # the rescaled tile, complete and fenced for TMA
    bx, by = lw.kernel.block_vars[:2]
    copy(lw, node.store, {bx: lw.pending[1], by: lw.pending[2]})
    T.buffer_store(lw.pending, 0, [0])


def _statistics_warp(lw, node, cta):
    """Per tile of the block, once its consumers have published the tile's row statistics: make them
    visible at GPU scope and count them on the row block's flag; wait until every tile of the row
    block has; compute each row's factor from every tile's statistics into the staged tile's slot; count
    this reader, the last of the row block's resetting the flag for the next launch."""
    gx, gy = lw.kernel.grid[:2]
    bM = node.tile.shape[0]
    lane = tirx.floormod(lw.tid, 32)
    flags = T.address_of(lw.workspace[0])
    with lw.ws.walk.tiles(cta):
        bx, by = (lw.expr(v) for v in lw.kernel.block_vars[:2])
        o = lw.ws.walk.tile_ordinal
        slot = tirx.floormod(o, 2)
        T.evaluate(TS.cuda.mbarrier_wait(_published(lw, node, slot), tirx.floormod(tirx.floordiv(o, 2), 2)))
        with T.If(lane == 0):
            with T.Then():
                T.evaluate(flag_signal(flags, by))
        T.evaluate(flag_wait(flags, by, gx, reset=False))  # every lane: the row block's last reader resets
        for q in range(bM // 32):  # (wgmma tiles: bM is a multiple of 64)
            row = lane + 32 * q
            stats = {var: lw.workspace[_stats_index(lw, node, j, by, row) + v]  # (after the flag's acquire)
                     for j, vars_ in enumerate(node.peers) for v, var in enumerate(vars_)}
            stats.update({var: lw.workspace[_stats_index(lw, node, bx, by, row) + v] for v, var in enumerate(node.own)})
            lw.store(node.factors, [slot, row], lw.expr(node.factor, stats))
        # every lane releases its own factors (racecheck does not follow a warp sync into one arrive)
        emit_ptx("mbarrier.arrive.shared::cta.b64", _factors_ready(lw, node, slot))
        T.evaluate(TS.cuda.warp_sync())  # every lane is past its spin on the flag before it may be reset
        with T.If(lane == 0):
            with T.Then():
                T.evaluate(helper("tile_ops_row_stats_read", _ROW_STATS_READ, flags, by, gy + by, gx))
