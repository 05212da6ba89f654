"""``T.serial``, ``T.unroll`` and ``T.Pipelined`` loops.  A pipelined loop is the kernel's schedule's to
lower: the warp-specialized main loop (``schedules/warp_specialized``), or the cp.async pipeline
(``schedules/cp_async``) where its loads fill multi-buffered tiles; otherwise a plain loop.  Those two run a
``T.deferred()`` block at the end of its iteration (``deferred.in_order``)."""

from __future__ import annotations

from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...lang.ir import For, walk
from ..schedules import cp_async
from . import Container, tile_op, unit
from .copy import is_async_load
from .deferred import in_order


@tile_op(For)
class LoopOp(Container):
    def lower(self, lw, node, vm):
        extent = lw.expr(node.extent, vm)
        if lw.ws and node is lw.ws.loop:
            return lw.ws.consumer_loop(node, vm, extent)
        if node.kind == "pipelined" and node.num_stages > 1 and any(is_async_load(lw, s) for s in node.body):
            return cp_async.pipelined(lw, node, vm, extent)
        # an iteration's reads come after the previous one's writes
        lw.written |= set(lw.global_writes(node))
        lw.tma_written |= {n.dst.buffer for n in walk(node.body) if lw.ws and lw.ws.is_tma_store(n)}
        frame = T.unroll(0, extent) if node.kind == "unroll" else T.serial(0, extent)
        with frame as v:
            IRBuilder.name(node.var.name, v)
            inner = dict(vm)
            inner[node.var] = v
            lw.body(in_order(node.body), inner)
            if _races_next_iteration(lw, node):
                lw.sync()


def _races_next_iteration(lw, node: For) -> bool:
    """Whether an iteration's shared accesses can race the next one's, so the loop needs a barrier at
    its back edge: a (cp.async-less) pipelined loop touching shared memory, or a serial loop with two
    or more tile ops on shared memory, unless its first is a warp-specialized main loop whose
    mbarriers already order it after the previous iteration's readers."""
    touching = [s for s in node.body if unit(s).touches_shared(lw, s)]
    if node.kind == "pipelined":
        return bool(touching)
    if len(touching) < 2:
        return False
    return not (lw.ws and touching[0] is lw.ws.loop and lw.ws.deferred_wait)
