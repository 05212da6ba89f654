"""Shared memory: one arena per block, laid out as the program's tiles (one buffer per pipeline stage for
the tiles a ``T.Pipelined`` loop fills), the tile ops' scratch and regions, then the mbarriers.

With two consumer warpgroups (pingpong) each has its own copy of what is not a pipeline stage.  Where
every CTA runs one tile, the tiles only the epilogue touches lie over the pipeline's stages, dead by then."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..lang.errors import SharedMemoryError
from ..lang.ir import Copy, For, error, walk
from .cuda import emit_ptx
from .exprs import dtype_bits
from .layout import SharedLayout
from .ops import accessed, unit

ALIGN = 128  # bytes; every shared buffer starts on a 128-byte line
ALIGN_SM90 = 1024  # TMA and wgmma read 128-byte swizzle atoms of 8 rows from 1024-byte boundaries


class MemoryPlan(NamedTuple):
    tiles: list  # [(buffer, byte offset, elems per stage, stages, layout, copy_bytes)]
    scratch_offset: int  # the tile ops' scratch: their largest need, in a block of scratch_bytes
    scratch_need: int
    scratch_bytes: int
    regions: list  # [(node, name, byte offset, float32 slots, copy_bytes)]
    barriers: dict  # owner -> index of its first mbarrier
    barrier_offset: int
    total: int  # bytes


@dataclass
class SharedTile:
    buf: object  # the program's TileBuffer
    view: object  # 1-D tirx buffer over the arena
    layout: SharedLayout | None  # None for 1-D tiles
    stages: int
    stage_elems: int


def pipelined_loads(loop: For) -> list:
    """The global -> shared copies of a pipelined loop's body: its loads, issued stages ahead."""
    return [s for s in loop.body if isinstance(s, Copy) and s.src.buffer.scope == "global"
            and s.dst.buffer.scope == "shared"]


def stage_counts(kernel) -> dict:
    """Shared tiles filled by global->shared copies inside T.Pipelined get one buffer per stage."""
    stages = {}
    for loop in walk(kernel.body):
        if isinstance(loop, For) and loop.kind == "pipelined":
            for st in pipelined_loads(loop):
                stages[st.dst.buffer] = max(stages.get(st.dst.buffer, 1), loop.num_stages)
    return stages


def check_staged_uses(body, stages: dict, buffers: dict) -> None:
    """A tile a T.Pipelined loop fills holds one buffer per stage; outside the loop none of them is "the"
    tile (the last iteration's stage depends on the trip count), so it is used only inside."""
    for node in body:
        if isinstance(node, For):
            if node.kind != "pipelined":
                check_staged_uses(node.body, stages, buffers)
            continue
        used = [b for b in accessed(node, buffers) if stages.get(b, 1) > 1]
        if used:
            raise error(node.loc, f"{used[0].name} is filled by a T.Pipelined loop ({stages[used[0]]} "
                                  f"stages, one buffer each) and used outside it; accepted: use it inside the "
                                  f"loop, or copy what is needed after it into a tile the loop does not fill")


def check_pipelined_loads(loop: For, buffers: dict) -> None:
    """A T.Pipelined loop issues its global->shared loads stages ahead, one buffer of each tile a step:
    so a tile takes one load an iteration, before anything in the iteration uses it (a second load, or
    one after a read, would land in the buffer the iteration reads, unordered with it)."""
    seen = set()
    loads = pipelined_loads(loop)
    for node in loop.body:
        if any(node is c for c in loads):
            tile = node.dst.buffer
            if id(tile) in seen:
                raise error(node.loc, f"{tile.name} is loaded here after an earlier load or use of it in the same "
                                      f"T.Pipelined iteration; the loop loads each tile once per iteration, ahead, "
                                      f"before its uses: use another tile for a second operand")
            seen.add(id(tile))
        else:
            seen |= {id(b) for b in accessed(node, buffers) if b.scope == "shared"}


def align(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


class Memory:
    """The arena of one kernel: ``plan()`` is pure (the warp-specialized schedule sizes CTAs with it before
    anything is emitted); ``declare()`` binds the views the lowering uses."""

    def __init__(self, lw):
        self.lw = lw
        self.alignment = ALIGN_SM90 if lw.target.hopper else ALIGN

    def plan(self) -> MemoryPlan:
        lw = self.lw
        tiles = []
        shared = [b for b in lw.kernel.allocs if b.scope == "shared"]
        epilogue, dead = self._epilogue_overlay(shared)
        if epilogue:  # the dead tiles first, the epilogue's laid over them from 0, then the rest
            dead_end = self._place(dead, 0, tiles)
            placed = {id(b) for b in dead + epilogue}
            offset = self._place([b for b in shared if id(b) not in placed],
                                 max(dead_end, self._place(epilogue, 0, tiles)), tiles)
        else:
            offset = self._place(shared, 0, tiles)
        scratch_offset = offset
        need = max([0] + [unit(n).scratch_bytes(lw, n) for n in walk(lw.kernel.body)])
        scratch = align(need)
        offset += scratch * lw.consumers
        regions = []
        for node in walk(lw.kernel.body):
            for name, slots in unit(node).regions(lw, node):
                regions.append((node, name, offset, slots, align(slots * 4)))
                offset += align(slots * 4) * lw.consumers
        barriers, count = {}, 0
        for owner, n in self._barrier_owners():
            barriers[id(owner)], count = count, count + n
        return MemoryPlan(tiles, scratch_offset, need, scratch, regions, barriers, offset, offset + 8 * count)

    def _barrier_owners(self) -> list:
        """(owner, mbarriers): the schedule's pipeline, then the tile ops', in program order."""
        lw = self.lw
        owners = [(lw.ws, lw.ws.mbarrier_count())] if lw.ws else []
        owners += [(n, unit(n).mbarriers(lw, n)) for n in walk(lw.kernel.body)]
        return [(o, n) for o, n in owners if n]

    def _place(self, buffers: list, offset: int, tiles: list) -> int:
        """Lay ``buffers`` out from byte ``offset`` into ``tiles`` (MemoryPlan.tiles); the offset past them."""
        lw = self.lw
        for b in buffers:
            elems = math.prod(b.shape)
            stages = lw.stages.get(b, 1)
            lay = SharedLayout(b.shape[0], b.shape[1], dtype_bits(b.dtype)) if len(b.shape) == 2 else None
            size = align(elems * stages * dtype_bits(b.dtype) // 8, self.alignment)
            copies = 1 if b in lw.stages else lw.consumers  # stages are shared by the warpgroups
            tiles.append((b, offset, elems, stages, lay, size if copies > 1 else 0))
            offset += size * copies
        return offset

    def _epilogue_overlay(self, shared: list) -> tuple:
        """(epilogue, dead): the shared tiles that only the code after the main loop touches, and those it
        does not touch, over which the epilogue's are laid where every CTA runs one tile
        (WarpSpecialized.one_tile_per_cta), so that a 128x256 tile holds 4 stages beside its 64 KiB output
        tile, as cuBLAS's does, rather than 3.  Safe: once the loop ends no load is in flight (its last
        stages were waited for, the peers' multicast slices included), and ``body``'s barrier before the
        epilogue's first shared access comes after every warp's last wgmma retired."""
        lw = self.lw
        if not (lw.ws and lw.ws.one_tile_per_cta()):
            return [], []
        body = list(lw.kernel.body)
        at = body.index(lw.ws.loop)
        before = {id(b) for node in body[:at + 1] for b in accessed(node, lw.buffers)}
        after = {id(b) for node in body[at + 1:] for b in accessed(node, lw.buffers)}
        epilogue = [b for b in shared if id(b) in after and id(b) not in before]
        return (epilogue, [b for b in shared if id(b) not in after]) if epilogue else ([], [])

    def copy_offset(self, offset: int, copy_bytes: int):
        """Byte offset of this consumer warpgroup's copy of a buffer (pingpong), else ``offset``."""
        lw = self.lw
        return offset + lw.consumer * copy_bytes if lw.consumers > 1 and copy_bytes else offset

    def declare(self) -> int:
        """Allocate the fragments and local arrays, bind the shared views; the arena's bytes."""
        lw = self.lw
        lw.shared, lw.frags, lw.locals = {}, {}, {}
        for b in lw.kernel.allocs:
            if b.scope == "fragment":
                lay = lw.infer.layouts[b]
                lw.frags[b] = T.alloc_local([lay.local_size], b.dtype)
                IRBuilder.name(b.name, lw.frags[b])
            elif b.scope != "shared":
                lw.locals[b] = T.alloc_local(list(b.shape), b.dtype)
                IRBuilder.name(b.name, lw.locals[b])
        plan = self.plan()
        self.barrier_base = plan.barriers
        if plan.total:
            arena = T.alloc_buffer((plan.total,), "uint8", scope="shared.dyn")
            IRBuilder.name("smem", arena)
            for b, off, elems, stages, lay, copy_bytes in plan.tiles:
                view = T.decl_buffer((elems * stages,), b.dtype, data=arena.data, scope="shared.dyn",
                                     elem_offset=self.copy_offset(off, copy_bytes) * 8 // dtype_bits(b.dtype))
                IRBuilder.name(b.name, view)
                lw.shared[b] = SharedTile(b, view, lay, stages, elems)
            scratch_offset = self.copy_offset(plan.scratch_offset, plan.scratch_bytes)
            lw.scratch = T.decl_buffer((max(1, plan.scratch_need // 4),), "float32", data=arena.data,
                                       scope="shared.dyn", elem_offset=scratch_offset // 4)
            IRBuilder.name("reduce_scratch", lw.scratch)
            lw.regions = {}  # (id(node), name) -> its float32 slots
            for node, name, off, slots, copy_bytes in plan.regions:
                view = T.decl_buffer((slots,), "float32", data=arena.data, scope="shared.dyn",
                                     elem_offset=self.copy_offset(off, copy_bytes) // 4)
                IRBuilder.name(name, view)
                lw.regions[(id(node), name)] = view
            if plan.total > plan.barrier_offset:
                self.mbarriers = T.decl_buffer(((plan.total - plan.barrier_offset) // 8,), "uint64", data=arena.data,
                                               scope="shared.dyn", elem_offset=plan.barrier_offset // 8)
                IRBuilder.name("mbarriers", self.mbarriers)
        limit = lw.target.smem_limit
        if plan.total > limit:
            err = error(lw.kernel.loc, f"the kernel needs {plan.total} bytes of shared memory; the limit on "
                                       f"{lw.target.arch} is {limit} (reduce block sizes or num_stages)",
                        SharedMemoryError)
            err.needed, err.limit, err.arch = plan.total, limit, lw.target.arch
            raise err
        return plan.total

    def mbarrier(self, owner, i):
        """The address of ``owner``'s mbarrier ``i`` (owner: the schedule, or a tile op's node)."""
        return self.mbarriers.ptr_to([self.barrier_base[id(owner)] + i])

    def init_mbarriers(self):
        """Thread 0 initializes every mbarrier (each owner its own, with its arrival counts); then every thread
        of a cluster's blocks arrives on the cluster barrier (release: the initialized barriers are visible
        to the peers that arrive on them once they have waited on it).  The threads that touch a peer wait
        first: the consumers (warp-specialized), or every thread otherwise."""
        lw = self.lw
        owners = self._barrier_owners()
        if not owners:
            return
        with T.If(lw.tid == 0):
            with T.Then():
                for owner, _ in owners:
                    if owner is lw.ws:
                        lw.ws.init_mbarriers()
                    else:
                        unit(owner).init_mbarriers(lw, owner)
                emit_ptx("fence.mbarrier_init.release.cluster")
        T.evaluate(TS.cuda.cta_sync())
        if lw.cluster > 1:
            emit_ptx("barrier.cluster.arrive.release.aligned")
            if not lw.ws:
                emit_ptx("barrier.cluster.wait.acquire.aligned")
