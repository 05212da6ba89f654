"""Lower a traced tile program to a TIRx PrimFunc for CUDA.  The Ampere-class path (every
target): cp.async pipelines, swizzled shared tiles, ldmatrix and mma.sync.  On sm_90a the
Hopper pieces in sm90.py take over where a program allows: TMA, wgmma and warp-specialized
pipelines.  TVM's CUDA code generator then turns the PrimFunc into CUDA source (codegen.py)."""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import tvm.ir.prim.expr as px
from tvm import tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.sym.analyzer import Analyzer
from tvm.tirx import op as top
from tvm.tirx.script import builder as T

from ..jit.build import smem_limit
from ..jit.kernel import FLAG_SLOTS, WORKSPACE
from ..lang import ir
from ..lang.errors import SharedMemoryError
from ..lang.ir import (ClusterReduce, Copy, Fill, For, Gemm, Parallel, Reduce, RowSoftmaxStore, Store, TileLangError,
                      error)
from .exprs import collect_loads, rewrite, uses
from .infer import MMA_DTYPES, LayoutInference, _is_vars, dtype_bits, walk
from .layout import MmaAccumLayout, MmaRowLayout, SharedLayout
from .sm90 import CONSUMER_BARRIER, PRODUCER_THREADS, Hopper, emit_ptx, exp2_approx, l2_cache_hint

ALIGN = 128  # bytes; every shared buffer starts on a 128-byte line
ALIGN_SM90 = 1024  # TMA and wgmma read 128-byte swizzle atoms of 8 rows from 1024-byte boundaries


@dataclass
class LoweredKernel:
    func: tirx.PrimFunc
    name: str
    grid: tuple
    block: tuple
    smem_bytes: int
    params: list  # [(name, shape, dtype)]
    layouts: dict  # buffer name -> description
    tensormaps: dict  # CUDA parameter name -> tensor-map spec for the launcher
    ctas_per_sm: int = 1  # CTAs meant to be resident per SM (__launch_bounds__'s minimum blocks)
    cluster: int = 1  # blocks per thread-block cluster
    cluster_dims: tuple = (1, 1, 1)  # __cluster_dims__: (cx, cy, 1), or (blocks, 1, 1) over a persistent 1-D grid
    persistent_tiles: int = 0  # > 0: CTAs loop over at most this many units (tiles) with a stride of gridDim.x
    workspace_floats: int = 0  # > 0 (stream-K): per-CTA fp32 partials of the launcher's workspace (stream_k.py)
    workspace_fixed_floats: int = 0  # > 0 (T.row_softmax_store): the row statistics, after the flags
    waits_at_entry: bool = False  # griddepcontrol.wait first: it can be launched programmatically


class MemoryPlan(NamedTuple):
    """Byte offsets in the shared arena.  With ``pingpong`` each consumer warpgroup has its own copy of
    what is not a pipeline stage (epilogue tiles, scratch, exchange slots), ``copy_bytes`` apart."""
    tiles: list  # [(buffer, byte offset, elems per stage, stages, layout, copy_bytes)]
    scratch_offset: int  # cross-warp reduction scratch
    scratch_copy_bytes: int
    exchanges: list  # [(T.cluster_allreduce node, byte offset, float32 slots, copy_bytes)]
    barrier_offset: int  # mbarriers
    total: int  # bytes


@dataclass
class SharedTile:
    buf: ir.TileBuffer
    view: object  # 1-D tirx buffer over the arena
    layout: SharedLayout | None  # None for 1-D tiles
    stages: int
    stage_elems: int


class Lowerer:
    def __init__(self, prog: ir.Program, arch: str):
        self.prog, self.kernel, self.arch = prog, prog.kernel, arch
        self.sm90 = arch == "sm_90a"  # wgmma, TMA and setmaxnreg need the arch-specific sm_90a target
        self.threads = self.kernel.threads
        self.buffers = prog.buffers
        self.cluster_dims = self.kernel.cluster  # (cx, cy): rank = x % cx + y % cy * cx
        self.cluster = math.prod(self.cluster_dims)
        if self.cluster > 1 and not self.sm90:
            raise error(self.kernel.loc, f"cluster={self.cluster_dims}: thread-block clusters need the sm_90a (Hopper) "
                                         f"target, this kernel is compiled for {arch}")
        self.infer = LayoutInference(self.kernel, self.buffers, wgmma=self.sm90).run()
        self.ana = Analyzer()
        self.stages = self._stage_counts()
        self._check_staged_uses(self.kernel.body)
        for loop in (n for node in self.kernel.body for n in _walk_pipelined(node)):
            self._check_pipelined_loads(loop)
        self.hopper = Hopper(self) if self.sm90 else None
        self.ws = self.hopper.ws if self.hopper else None
        # consumer warpgroups that each run the program on alternate tiles: two with T.Kernel(pingpong=True)
        # on the warp-specialized sm_90a path (a schedule; elsewhere the program runs as written)
        self.consumers = 2 if self.kernel.pingpong and self.ws else 1
        self.uses_wgmma = self.hopper is not None and any(
            isinstance(n, Gemm) and self.hopper.is_wgmma(n) for n in walk(self.kernel.body))

    # ------------------------------------------------------------------ entry

    def lower(self) -> LoweredKernel:
        k = self.kernel
        with IRBuilder() as ib:
            with T.prim_func():
                T.func_name(self.prog.name)
                self.globals = {}
                for p in self.prog.params:
                    self.globals[p] = T.arg(p.name, T.Buffer(p.shape, p.dtype))
                sk = self.hopper.stream_k if self.hopper else None
                fixed = self.hopper.row_stats_floats() if self.hopper else 0
                if sk:  # nominal extent (the launcher sizes it to the device's grid): flags, then slots
                    self.workspace = T.arg(WORKSPACE, T.Buffer(
                        (FLAG_SLOTS + self.hopper.resident_ctas() * sk.floats_per_cta(),), "float32"))
                elif fixed:  # flags, then the row statistics of every tile
                    self.workspace = T.arg(WORKSPACE, T.Buffer((FLAG_SLOTS + fixed,), "float32"))
                if self.ws:
                    self.hopper.declare_tensormaps()
                T.device_entry()
                grid = list(k.grid) + [1] * (3 - len(k.grid))
                if self.ws:
                    grid = self.hopper.persistent_grid(grid)
                if self.ws and self.hopper.persistent:
                    ids = [T.cta_id([grid[0]])]  # the tile loop sets the block vars
                else:
                    ids = T.cta_id(grid[: len(k.grid)]) if len(k.grid) > 1 else [T.cta_id([grid[0]])]
                    self.block_vars = dict(zip([v for v in k.block_vars], self._rasterize(list(ids))))
                block = self.threads * self.consumers + (PRODUCER_THREADS if self.ws else 0)
                self.tid = T.thread_id([block])
                if self.sm90:  # a programmatic launch (Kernel.dependent) may start while the stream's previous
                    # kernel runs, so every thread first waits for that kernel's completion (and its memory);
                    # then the next kernel may launch, to wait likewise (a no-op in a plain launch)
                    emit_ptx("griddepcontrol.wait")
                    emit_ptx("griddepcontrol.launch_dependents")
                # the consumer warpgroup's copy of per-warpgroup buffers (pingpong); the producer's value (2)
                # points past them: it touches pipeline stages only
                self.consumer = self.hopper.warpgroup_index(self.tid) if self.consumers > 1 else 0
                self.smem_bytes = self._declare_memory()
                if self.ws:
                    self.hopper.warp_specialized(k.body, ids[0])
                else:
                    if self.hopper:
                        self.hopper.count_exchanges()
                        self.hopper.init_barriers()
                    self.body(k.body)
            func = ib.get()
        tensormaps = {tm.var.name: tm.spec for tm in self.hopper.tensormaps.values()} if self.hopper else {}
        return LoweredKernel(
            func, self.prog.name, tuple(grid), (block, 1, 1), self.smem_bytes,
            [(p.name, p.shape, p.dtype) for p in self.prog.params],
            {b.name: self._describe(b) for b in k.allocs}, tensormaps,
            self.hopper.ctas_per_sm if self.hopper else 1, self.cluster,
            (self.cluster, 1, 1) if self.hopper and self.hopper.persistent else (*self.cluster_dims, 1),
            self.hopper.work_units() if self.hopper and self.hopper.persistent else 0,
            sk.floats_per_cta() if sk else 0, fixed, self.sm90,
        )

    def _describe(self, b) -> str:
        if b.scope == "fragment":
            lay = self.infer.layouts[b]
            return f"fragment {lay.kind}, {lay.local_size} regs/thread"
        if b.scope == "shared":
            t = self.shared[b]
            return f"shared {t.layout.describe() if t.layout else '1-D'} x{t.stages} stages"
        return b.scope

    def _rasterize(self, ids):
        """T.use_swizzle: walk the grid in panels of `panel` columns so consecutive blocks share tiles in L2.
        A cluster's blocks move as one: the panels are of clusters."""
        panel = self.kernel.swizzle_panel
        if not panel:
            return ids
        cx, cy = self.cluster_dims
        gx, gy = self.kernel.grid[0] // cx, self.kernel.grid[1] // cy
        bx, by = tirx.floordiv(ids[0], cx), tirx.floordiv(ids[1], cy) if cy > 1 else ids[1]
        linear = by * gx + bx
        per_panel = panel * gy
        pidx = tirx.floordiv(linear, per_panel)
        within = tirx.floormod(linear, per_panel)
        width = tirx.min(panel, gx - pidx * panel)
        x, y = pidx * panel + tirx.floormod(within, width), tirx.floordiv(within, width)
        return [x * cx + tirx.floormod(ids[0], cx) if cx > 1 else x,
                y * cy + tirx.floormod(ids[1], cy) if cy > 1 else y] + ids[2:]

    # ------------------------------------------------------------------ memory

    def _stage_counts(self) -> dict:
        """Shared tiles filled by global->shared copies inside T.Pipelined get one buffer per stage."""
        stages = {}
        for node in self.kernel.body:
            for sub in _walk_pipelined(node):
                for st in sub.body:
                    if isinstance(st, Copy) and st.src.buffer.scope == "global" and st.dst.buffer.scope == "shared":
                        stages[st.dst.buffer] = max(stages.get(st.dst.buffer, 1), sub.num_stages)
        return stages

    def _check_staged_uses(self, body) -> None:
        """A tile a T.Pipelined loop fills holds one buffer per stage; outside the loop none of them is "the"
        tile (the last iteration's stage depends on the trip count), so it is used only inside."""
        for node in body:
            if isinstance(node, For) and node.kind == "pipelined":
                continue
            if isinstance(node, For):
                self._check_staged_uses(node.body)
                continue
            used = [b for b in _node_buffers(node, self.buffers) if self.stages.get(b, 1) > 1]
            if used:
                raise error(node.loc, f"{used[0].name} is filled by a T.Pipelined loop ({self.stages[used[0]]} "
                                      f"stages, one buffer each) and used outside it; accepted: use it inside the "
                                      f"loop, or copy what is needed after it into a tile the loop does not fill")

    def _check_pipelined_loads(self, loop: For) -> None:
        """A T.Pipelined loop issues its global->shared loads stages ahead, one buffer of each tile a step:
        so a tile takes one load an iteration, before anything in the iteration uses it (a second load, or
        one after a read, would land in the buffer the iteration reads, unordered with it)."""
        seen = set()
        for node in loop.body:
            if isinstance(node, Copy) and node.src.buffer.scope == "global" and node.dst.buffer.scope == "shared":
                tile = node.dst.buffer
                if id(tile) in seen:
                    raise error(node.loc, f"{tile.name} is loaded here after an earlier load or use of it in the same "
                                          f"T.Pipelined iteration; the loop loads each tile once per iteration, ahead, "
                                          f"before its uses: use another tile for a second operand")
                seen.add(id(tile))
            else:
                seen |= {id(b) for b in _node_buffers(node, self.buffers) if b.scope == "shared"}

    def _align(self, n: int) -> int:
        return _align(n, ALIGN_SM90 if self.sm90 else ALIGN)

    def memory_plan(self) -> MemoryPlan:
        """Shared arena layout: tiles, reduction scratch, cluster exchange slots, mbarriers.  Pure, so the
        Hopper planner can size CTAs before emitting."""
        tiles, exchanges = [], []
        shared = [b for b in self.kernel.allocs if b.scope == "shared"]
        epilogue, dead = self._epilogue_overlay(shared)
        if epilogue:  # the dead tiles first, the epilogue's laid over them from 0, then the rest
            dead_end = self._place(dead, 0, tiles)
            placed = {id(b) for b in dead + epilogue}
            offset = self._place([b for b in shared if id(b) not in placed],
                                 max(dead_end, self._place(epilogue, 0, tiles)), tiles)
        else:
            offset = self._place(shared, 0, tiles)
        scratch_offset, scratch_size = offset, _align(self._scratch_bytes())
        offset += scratch_size * self.consumers
        for node in self.cluster_reduces:  # two sets of slots: consecutive tiles alternate (see cluster_allreduce)
            slots = 2 * self.cluster * math.prod(node.buffers[0].shape) * len(node.buffers)
            exchanges.append((node, offset, slots, _align(slots * 4)))
            offset += _align(slots * 4) * self.consumers
        total = offset + (self.hopper.barrier_bytes() if self.hopper else 0)
        return MemoryPlan(tiles, scratch_offset, scratch_size, exchanges, offset, total)

    def _place(self, buffers: list, offset: int, tiles: list) -> int:
        """Lay ``buffers`` out from byte ``offset`` into ``tiles`` (MemoryPlan.tiles); the offset past them."""
        for b in buffers:
            elems = math.prod(b.shape)
            stages = self.stages.get(b, 1)
            lay = SharedLayout(b.shape[0], b.shape[1], dtype_bits(b.dtype)) if len(b.shape) == 2 else None
            size = self._align(elems * stages * dtype_bits(b.dtype) // 8)
            copies = 1 if b in self.stages else self.consumers  # stages are shared by the warpgroups
            tiles.append((b, offset, elems, stages, lay, size if copies > 1 else 0))
            offset += size * copies
        return offset

    def _epilogue_overlay(self, shared: list) -> tuple:
        """(epilogue, dead): the shared tiles that only the code after the main loop touches, and those it
        does not touch, over which the epilogue's are laid where every CTA runs one tile
        (Hopper.one_tile_per_cta), so that a 128x256 tile holds 4 stages beside its 64 KiB output tile,
        as cuBLAS's does, rather than 3.  Safe: once the loop ends no load is in flight (its last stages
        were waited for, the peers' multicast slices included), and ``body``'s barrier before the
        epilogue's first shared access comes after every warp's last wgmma retired."""
        if not (self.ws and self.hopper.one_tile_per_cta()):
            return [], []
        body = list(self.kernel.body)
        at = body.index(self.ws.loop)
        before = {id(b) for node in body[:at + 1] for b in _node_buffers(node, self.buffers)}
        after = {id(b) for node in body[at + 1:] for b in _node_buffers(node, self.buffers)}
        epilogue = [b for b in shared if id(b) in after and id(b) not in before]
        return (epilogue, [b for b in shared if id(b) not in after]) if epilogue else ([], [])

    def _declare_memory(self) -> int:
        self.shared, self.frags, self.locals = {}, {}, {}
        for b in self.kernel.allocs:
            if b.scope == "fragment":
                lay = self.infer.layouts[b]
                self.frags[b] = T.alloc_local([lay.local_size], b.dtype)
                IRBuilder.name(b.name, self.frags[b])
            elif b.scope != "shared":
                self.locals[b] = T.alloc_local(list(b.shape), b.dtype)
                IRBuilder.name(b.name, self.locals[b])
        plan = self.memory_plan()
        self.scratch_offset, total = plan.scratch_offset, plan.total
        if total:
            arena = T.alloc_buffer((total,), "uint8", scope="shared.dyn")
            IRBuilder.name("smem", arena)
            for b, off, elems, stages, lay, copy_bytes in plan.tiles:
                view = T.decl_buffer((elems * stages,), b.dtype, data=arena.data, scope="shared.dyn",
                                     elem_offset=self._copy_offset(off, copy_bytes) * 8 // dtype_bits(b.dtype))
                IRBuilder.name(b.name, view)
                self.shared[b] = SharedTile(b, view, lay, stages, elems)
            scratch_offset = self._copy_offset(self.scratch_offset, plan.scratch_copy_bytes)
            self.scratch = T.decl_buffer((max(1, self._scratch_bytes() // 4),), "float32", data=arena.data,
                                         scope="shared.dyn", elem_offset=scratch_offset // 4)
            IRBuilder.name("reduce_scratch", self.scratch)
            self.exchange = {}  # id(T.cluster_allreduce node) -> its slots, by rank
            for node, off, slots, copy_bytes in plan.exchanges:
                self.exchange[id(node)] = T.decl_buffer((slots,), "float32", data=arena.data, scope="shared.dyn",
                                                        elem_offset=self._copy_offset(off, copy_bytes) // 4)
                IRBuilder.name(f"{node.buffers[0].name}_cluster", self.exchange[id(node)])
            if self.hopper:
                self.hopper.bind_barriers(arena, plan.barrier_offset)
        limit = smem_limit(self.arch)
        if total > limit:
            err = error(self.kernel.loc, f"the kernel needs {total} bytes of shared memory; the limit on {self.arch} "
                                         f"is {limit} (reduce block sizes or num_stages)", SharedMemoryError)
            err.needed, err.limit, err.arch = total, limit, self.arch
            raise err
        return total

    def _copy_offset(self, offset: int, copy_bytes: int):
        """Byte offset of this consumer warpgroup's copy of a buffer (pingpong), else ``offset``."""
        return offset + self.consumer * copy_bytes if self.consumers > 1 and copy_bytes else offset

    def _scratch_bytes(self) -> int:
        need = 0
        for node in walk(self.kernel.body):
            if isinstance(node, Reduce):
                lay = self.infer.layouts.get(node.src)
                if isinstance(lay, MmaAccumLayout) and lay.w.wn > 1:
                    need = max(need, lay.w.M * lay.w.wn * 4)
        return need

    @cached_property
    def cluster_reduces(self) -> list:
        return [n for n in walk(self.kernel.body) if isinstance(n, ClusterReduce)]

    @staticmethod
    def stage_base(t: SharedTile, stage):
        """Element offset of pipeline stage ``stage`` of a (possibly multi-buffered) shared tile."""
        return stage * t.stage_elems if t.stages > 1 else 0

    def shared_offset(self, t: SharedTile, idx, stage=None):
        base = self.stage_base(t, self.stage(t.buf) if stage is None else stage)
        if t.layout is None:
            return base + idx[0]
        return base + t.layout.offset(idx[0], idx[1])

    # ------------------------------------------------------------------ expressions

    def expr(self, e, var_map=None, frag_index=None, guard=False):
        """Lower a user expression: substitute loop/block vars and map logical buffer loads to storage.
        ``frag_index(buf, idx)`` resolves fragment loads inside T.Parallel."""
        vm = dict(self.block_vars)
        vm.update(var_map or {})

        def on_load(buf_var, idx):
            buf = self.buffers.get(buf_var)
            if buf is None:
                return None
            return self._guarded_load(buf, idx, frag_index) if guard else self.load(buf, idx, frag_index)

        return rewrite(e, vm, on_load, _fast_exp2) if not isinstance(e, (int, float)) else e

    def _storage(self, buf, idx, frag_index, stage, vec):
        """(tirx buffer, indices) of ``buf[idx]``, or of ``vec`` elements from it along the last dim
        (the caller has checked they are contiguous); ``stage`` defaults to the one being computed on."""
        if buf.scope == "shared":
            t = self.shared[buf]
            return t.view, [_ramp(self.shared_offset(t, idx, stage), vec)]
        if buf.scope == "fragment":
            if frag_index is None:
                raise TileLangError(f"fragment {buf.name} can only be accessed elementwise inside T.Parallel "
                                    f"(or by tile ops)")
            return self.frags[buf], [frag_index(buf, idx)]
        storage = self.globals[buf] if buf.scope == "global" else self.locals[buf]
        return storage, list(idx[:-1]) + [_ramp(idx[-1], vec)]

    def load(self, buf, idx, frag_index=None, stage=None, vec=1):
        return tirx.BufferLoad(*self._storage(buf, idx, frag_index, stage, vec))

    def store(self, buf, idx, value, frag_index=None, stage=None, vec=1):
        storage, at = self._storage(buf, idx, frag_index, stage, vec)
        T.buffer_store(storage, _broadcast(_cast(value, buf.dtype), vec), at)

    def _guarded_load(self, buf, idx, frag_index=None, vec=1):
        """A load that reads 0 outside a global tensor (whole vectors are in or out: see _vector_ok)."""
        value = self.load(buf, idx, frag_index, vec=vec)
        pred = self._in_bounds(buf, [0] * len(idx), idx)
        return value if pred is None else tirx.if_then_else(pred, value, _broadcast(tirx.const(0, buf.dtype), vec))

    def _guarded_store(self, buf, idx, value, frag_index=None, stage=None, vec=1):
        pred = self._in_bounds(buf, [0] * len(idx), idx)
        if pred is None:
            return self.store(buf, idx, value, frag_index, stage, vec)
        with T.If(pred):
            with T.Then():
                self.store(buf, idx, value, frag_index, stage, vec)

    # ------------------------------------------------------------------ statements

    def body(self, nodes, var_map=None):
        """Lower a statement list; a block barrier separates any two tile ops that touch shared
        memory (their thread mappings differ, so one's writes are another's reads)."""
        shared_before = False
        with ExitStack() as rest:  # stream-K: what follows the main loop, for the units that run it
            for node in nodes:
                if self._reads_block_writes(node):  # global memory this block wrote, read back
                    self.sync_global_writes()
                    shared_before = False  # that ends with a consumer barrier
                touches = self._touches_shared(node)
                # T.row_softmax_store syncs before its own first shared access (its publish needs none)
                if shared_before and touches and not isinstance(node, RowSoftmaxStore):
                    self.sync()
                shared_before = shared_before or touches
                try:
                    self.stmt(node, var_map or {})
                    self.written |= set(self._global_writes(node))
                except TileLangError as e:
                    if getattr(e, "located", False):
                        raise
                    raise error(node.loc, str(e)) from None
                if self.ws and node is self.ws.loop and self.hopper.unit:
                    self.hopper.stream_k_fixup(rest)
                if self.ws and node is self.ws.loop and self.hopper.row_softmax is not None:
                    self.hopper.store_pending(self.hopper.tile_ordinal - 1)  # the previous tile

    def sync(self):
        self.written = frozenset()  # bar.sync orders the threads' generic global writes before what follows
        if self.uses_wgmma or self.ws and self.ws.stores:  # generic-proxy shared writes made visible to the
            emit_ptx("fence.proxy.async.shared::cta")  # async proxy: wgmma's reads, TMA stores' reads
        if self.ws and self.ws.stores:  # what follows the barrier may rewrite a tile TMA is still storing
            self.hopper.wait_stores_read()
        if self.ws:  # the producer warpgroup is not at consumer barriers; each pingpong warpgroup has its own
            emit_ptx("bar.sync", tirx.Cast("uint32", CONSUMER_BARRIER + self.consumer) if self.consumers > 1
                     else CONSUMER_BARRIER, self.threads)
        else:
            T.evaluate(TS.cuda.cta_sync())

    def _touches_shared(self, node) -> bool:
        if isinstance(node, Copy):
            return "shared" in (node.src.buffer.scope, node.dst.buffer.scope)
        if isinstance(node, (Gemm, RowSoftmaxStore)):
            return True
        if isinstance(node, Reduce):
            lay = self.infer.layouts.get(node.src)
            return isinstance(lay, MmaAccumLayout) and lay.w.wn > 1
        if isinstance(node, (For, Parallel)):
            return any(self._touches_shared(n) for n in walk(node.body)) or any(
                b.scope == "shared" for b in _buffers_in(node, self.buffers))
        if isinstance(node, Store):
            return any(b.scope == "shared" for b in _buffers_in(node, self.buffers))
        if isinstance(node, Fill):
            return node.buffer.scope == "shared"
        return False

    # global tensors the block wrote since its last barrier (generic stores), and since the last wait for
    # its TMA stores' writes: another thread re-reading them needs the barrier (and the wait) first
    written = frozenset()
    tma_written = frozenset()
    ws = None  # the warp specialization, once the Hopper planner made it (it asks _global_writes before)

    def _is_tma_store(self, node) -> bool:
        return bool(self.ws) and any(node is c for c in self.ws.stores)

    def _global_writes(self, node) -> list:
        """Global tensors ``node`` writes with generic stores (TMA stores are tracked by ``copy``)."""
        nodes = list(walk([node]))
        out = [n.dst.buffer for n in nodes if isinstance(n, Copy) and not self._is_tma_store(n)]
        out += [n.buffer for n in nodes if isinstance(n, Store)]
        return [b for b in out if b.scope == "global"]

    def _reads_block_writes(self, node) -> bool:
        """Whether ``node`` reads a global tensor this block wrote since the last barrier: every thread
        reads back what it wrote itself only when the two accesses share a thread mapping, which the
        compiler does not assume (a tile op's own read-modify-write of an element is one thread's)."""
        pending = self.written | self.tma_written
        if not pending:
            return False
        nodes = list(walk([node]))
        reads = [n.src.buffer for n in nodes if isinstance(n, Copy)]
        reads += [self.buffers.get(v) for n in nodes if isinstance(n, Store) for v, _ in collect_loads(n.value)]
        return any(r is b for r in reads for b in pending)

    def sync_global_writes(self):
        """A consumer barrier after which the block's global writes are visible to all its threads; with
        TMA stores pending, their issuer first waits for their writes (not only their shared reads)."""
        if self.tma_written:
            self.hopper.wait_stores_written()
        else:
            self.sync()

    def stmt(self, node, vm):
        if isinstance(node, For):
            self.loop(node, vm)
        elif isinstance(node, Parallel):
            self.parallel(node, vm)
        elif isinstance(node, Copy):
            self.copy(node, vm)
        elif isinstance(node, Gemm):
            self.gemm(node)
        elif isinstance(node, Fill):
            self.fill(node, vm)
        elif isinstance(node, Reduce):
            self.reduce(node)
        elif isinstance(node, ClusterReduce):
            self.hopper.cluster_allreduce(node)
        elif isinstance(node, RowSoftmaxStore):
            if not self.ws:  # (on sm_90a, Hopper refuses it while planning)
                raise error(node.loc, "T.row_softmax_store needs the warp-specialized sm_90a path (TMA loads, "
                                      "wgmma, a producer warpgroup); this kernel is compiled without it")
            self.hopper.row_softmax_store(node, vm)
        elif isinstance(node, Store):
            if node.buffer.scope == "fragment":
                raise error(node.loc, f"fragment {node.buffer.name} can only be written inside T.Parallel or by tile ops")
            # predicated as in T.Parallel: global indices past the end read 0 and write nothing
            self._guarded_store(node.buffer, [self.expr(i, vm) for i in node.indices],
                                self.expr(node.value, vm, guard=True))
        else:
            raise error(node.loc, f"cannot lower {type(node).__name__}")

    def loop(self, node: For, vm):
        extent = self.expr(node.extent, vm)
        if self.ws and node is self.ws.loop:
            return self.hopper.consumer_loop(node, vm, extent)
        if node.kind == "pipelined" and node.num_stages > 1 and any(
                self._is_async_copy(s) for s in node.body):
            return self.pipelined(node, vm, extent)
        # an iteration's reads come after the previous one's writes
        self.written |= set(self._global_writes(node))
        self.tma_written |= {n.dst.buffer for n in walk(node.body) if self._is_tma_store(n)}
        frame = T.unroll(0, extent) if node.kind == "unroll" else T.serial(0, extent)
        with frame as v:
            IRBuilder.name(node.var.name, v)
            inner = dict(vm)
            inner[node.var] = v
            self.body(node.body, inner)
            if self._races_next_iteration(node):
                self.sync()

    def _races_next_iteration(self, node: For) -> bool:
        """Whether an iteration's shared accesses can race the next one's, so the loop needs a barrier at
        its back edge: a (cp.async-less) pipelined loop touching shared memory, or a serial loop with two
        or more tile ops on shared memory, unless its first is a warp-specialized main loop whose
        mbarriers already order it after the previous iteration's readers."""
        touching = [s for s in node.body if self._touches_shared(s)]
        if node.kind == "pipelined":
            return bool(touching)
        if len(touching) < 2:
            return False
        return not (self.ws and touching[0] is self.ws.loop and self.ws.deferred_wait)

    # ------------------------------------------------------------------ pipelining

    def _is_async_copy(self, node) -> bool:
        return (isinstance(node, Copy) and node.src.buffer.scope == "global" and node.dst.buffer.scope == "shared"
                and self.shared[node.dst.buffer].stages > 1)

    def pipelined(self, node: For, vm, n):
        """cp.async software pipeline: copies for iteration k + S - 1 are in flight while k computes.

            prologue: issue stages 0 .. S-2 (one commit group each)
            for k:    wait until stage k landed; barrier; issue k + S - 1; compute k
        """
        S = node.num_stages
        loads = [s for s in node.body if self._is_async_copy(s)]
        compute = [s for s in node.body if not self._is_async_copy(s)]
        for s in range(S - 1):
            with T.If(s < n):
                with T.Then():
                    for c in loads:
                        self.copy(c, {**vm, node.var: tirx.const(s, "int32")}, stage=s, asynchronous=True)
            emit_ptx("cp.async.commit_group")
        with T.serial(0, n) as k:
            IRBuilder.name(node.var.name, k)
            emit_ptx("cp.async.wait_group", S - 2)
            self.sync()
            nxt = k + (S - 1)
            with T.If(nxt < n):
                with T.Then():
                    for c in loads:
                        self.copy(c, {**vm, node.var: nxt}, stage=tirx.floormod(nxt, S), asynchronous=True)
            emit_ptx("cp.async.commit_group")
            self.stage_of_iter = tirx.floormod(k, S)
            self.body(compute, {**vm, node.var: k})
            self.stage_of_iter = None
        emit_ptx("cp.async.wait_group", 0)
        self.sync()

    stage_of_iter = None

    def stage(self, buf):
        t = self.shared.get(buf)
        if t is not None and t.stages > 1 and self.stage_of_iter is not None:
            return self.stage_of_iter
        return 0

    # ------------------------------------------------------------------ copies

    def copy(self, node: Copy, vm, stage=None, asynchronous=False):
        if self._is_tma_store(node):
            self.tma_written |= {node.dst.buffer}
            return self.hopper.tma_store(node, vm)
        src, dst = node.src, node.dst
        s_scope, d_scope = src.buffer.scope, dst.buffer.scope
        if "local" in (s_scope, d_scope):  # each thread would move only its share of the window, in its own array
            local = src.buffer if s_scope == "local" else dst.buffer
            raise error(node.loc, f"T.copy: {local.name} is a local (per-thread) buffer, and a copy is spread over the "
                                  f"block's threads; accepted: global, shared and fragment tiles (a local buffer is "
                                  f"filled by T.fill or element assignments, which every thread runs whole)")
        extents = self._copy_extents(node)
        s_start = [self.expr(x, vm) for x in src.starts]
        d_start = [self.expr(x, vm) for x in dst.starts]
        if "fragment" in (s_scope, d_scope):
            return self.copy_fragment(node, s_start, d_start, extents)
        if s_scope == "global" and d_scope == "shared":
            return self.copy_g2s(node, s_start, d_start, extents,
                                 self.stage(dst.buffer) if stage is None else stage, asynchronous)
        self.sync_copy(node, s_start, d_start, extents)

    def _copy_extents(self, node: Copy):
        se, de = node.src.extents, node.dst.extents
        if None in se and None in de:
            raise error(node.loc, "T.copy: at least one side must be a whole buffer or a sliced region")
        ext = de if None in se else se
        other = se if None in se else de
        ext = _squeeze(ext) or [1]
        if None not in other and _squeeze(other) != _squeeze(ext):
            raise error(node.loc, f"T.copy: region shapes differ: {list(se)} vs {list(de)}")
        point = node.src if None in se else node.dst  # a start point: its window takes the region's shape
        if len(point.starts) < len(ext):
            raise error(node.loc, f"T.copy: {point.buffer.name}{list(point.buffer.shape)} has {len(point.starts)} "
                                  f"dim(s), too few for the {'x'.join(map(str, ext))} region copied with it; accepted: "
                                  f"a buffer of at least {len(ext)} dims, one start index each")
        for side in (node.src, node.dst):
            self._check_inside(node, side, ext)
        return list(ext)

    def _check_inside(self, node: Copy, side, ext):
        """A shared or local window of a copy lies inside its buffer: only global accesses are predicated,
        so one reaching past the end would write (or read) the neighbouring tiles' bytes."""
        buf = side.buffer
        if buf.scope == "global":
            return
        ext = side.extents if None not in side.extents else [1] * (len(side.starts) - len(ext)) + list(ext)
        for s, e, dim in zip(side.starts, ext, buf.shape):
            s = tirx.const(s, "int32") if isinstance(s, int) else s
            if self.ana.can_prove(tirx.Or(s + e > dim, s < 0)):
                window = ", ".join(f"{a}:{a + b}" for a, b in zip(side.starts, ext))
                raise error(node.loc, f"T.copy: the window [{window}] of {buf.name}{list(buf.shape)} reaches past "
                                      f"it (shared and local tiles are not predicated, only global tensors are)")

    def _in_bounds(self, buf, start, idx):
        idx = _pad(idx, start)
        conds = []
        if buf.scope != "global":
            return None
        for s, i, dim in zip(start, idx, buf.shape):
            if not _nonneg(s + i):  # a window or stencil may start before the tensor
                conds.append(s + i >= 0)
            if not self.ana.can_prove(s + i < dim):
                conds.append(s + i < dim)
        if not conds:
            return None
        out = conds[0]
        for c in conds[1:]:
            out = tirx.And(out, c)
        return out

    def sync_copy(self, node, s_start, d_start, extents, d_stage=None):
        """Elementwise copy (any scopes but fragments), ``vec`` consecutive elements per thread and access."""
        sb, db = node.src.buffer, node.dst.buffer
        vec = self._copy_vector_width(node, s_start, d_start, extents)

        def one(idx):
            value = self._guarded_load(sb, [a + b for a, b in zip(s_start, _pad(idx, s_start))], vec=vec)
            self._guarded_store(db, [a + b for a, b in zip(d_start, _pad(idx, d_start))], value, stage=d_stage,
                                vec=vec)

        self.flat_loop(extents, one, vec)

    def _copy_vector_width(self, node, s_start, d_start, extents) -> int:
        sb, db = node.src.buffer, node.dst.buffer
        return _widest(max(dtype_bits(sb.dtype), dtype_bits(db.dtype)), lambda v: extents[-1] % v == 0 and
                       self._vector_ok(sb, s_start[-1], v) and self._vector_ok(db, d_start[-1], v))

    def flat_loop(self, extents, body_fn, vec=1):
        """Distribute a row-major iteration space over the block's threads."""
        total = 1
        for e in extents:
            total *= e
        chunks = total // vec
        iters = -(-chunks // self.threads)
        with T.unroll(0, iters) if iters <= 32 else T.serial(0, iters) as it:
            q = it * self.threads + self.tid
            idx, flat = [], q * vec
            for e in reversed(extents):
                idx.append(tirx.floormod(flat, e))
                flat = tirx.floordiv(flat, e)
            idx.reverse()
            if chunks % self.threads:
                with T.If(q < chunks):
                    with T.Then():
                        body_fn(idx)
            else:
                body_fn(idx)

    def copy_g2s(self, node, s_start, d_start, extents, stage, asynchronous):
        sb, db = node.src.buffer, node.dst.buffer
        t = self.shared[db]
        bits = dtype_bits(sb.dtype)
        if sb.dtype != db.dtype or len(extents) != 2 or t.layout is None:
            return self.sync_copy(node, s_start, d_start, extents, stage)  # into the stage being filled
        vec = self._copy_vector_width(node, s_start, d_start, extents)
        if vec == 1:  # cp.async moves 4, 8 or 16 bytes; narrower rows take the synchronous path
            return self.sync_copy(node, s_start, d_start, extents, stage)
        hint, policy = l2_cache_hint(node.eviction)

        def one(idx):
            g = [a + b for a, b in zip(s_start, _pad(idx, s_start))]
            pred = self._in_bounds(sb, s_start, idx)
            if pred is not None:  # out of bounds: copy 0 bytes (zero-fill) from a safe address
                g = [tirx.if_then_else(pred, x, 0) for x in g]
            d = [a + b for a, b in zip(d_start, _pad(idx, d_start))]
            dst_ptr = t.view.ptr_to([self.shared_offset(t, d, stage)])
            src_ptr = self.globals[sb].ptr_to(g)
            nbytes = vec * bits // 8
            chain = f"cp.async.{'cg' if nbytes == 16 else 'ca'}.shared.global{hint}"
            size = [tirx.Cast("uint32", tirx.if_then_else(pred, nbytes, 0))] if pred is not None else []
            if policy and not size:  # spelt out: the policy is the operand after src-size
                size = [tirx.const(nbytes, "uint32")]
            T.evaluate(TS.ptx[chain](dst_ptr, src_ptr, nbytes, *size, *policy))

        self.flat_loop(extents, one, vec)
        if not asynchronous:
            emit_ptx("cp.async.commit_group")
            emit_ptx("cp.async.wait_group", 0)

    def _divisible(self, e, v) -> bool:
        return v == 1 or self.ana.can_prove(tirx.floormod(e, v) == 0) if not isinstance(e, int) else e % v == 0

    def copy_fragment(self, node: Copy, s_start, d_start, extents):
        sb, db = node.src.buffer, node.dst.buffer
        frag = sb if sb.scope == "fragment" else db
        lay = self.infer.layouts[frag]
        if _squeeze(lay.shape) != _squeeze(extents):
            raise error(node.loc, f"T.copy: fragment {frag.name}{list(frag.shape)} must be copied whole, "
                                  f"got a region of {extents}")
        if sb.scope == "fragment" and db.scope == "fragment":
            with T.unroll(0, lay.local_size) as r:
                T.buffer_store(self.frags[db], _cast(tirx.BufferLoad(self.frags[sb], [r]), db.dtype), [r])
            return
        other, start = (db, d_start) if sb.scope == "fragment" else (sb, s_start)
        vec = self._fragment_vector_width(lay, other, start)
        with T.unroll(0, lay.local_size // vec) as rv:
            r = rv * vec
            idx = list(lay.coords(self.tid, r))
            o_idx = [a + b for a, b in zip(start, _pad(idx, start))]
            if sb.scope == "fragment":
                self._guarded_store(db, o_idx, _vload(self.frags[sb], [r], vec), vec=vec)
            else:
                value = self._guarded_load(sb, o_idx, vec=vec)
                T.buffer_store(self.frags[db], _cast(value, db.dtype), [_ramp(r, vec)])

    def _fragment_vector_width(self, lay, other, start) -> int:
        """Elements a thread moves per access: the layout's run of consecutive columns, if the other
        side allows them as one access."""
        vec = lay.vec
        return vec if vec > 1 and lay.local_size % vec == 0 and self._vector_ok(other, start[-1], vec) else 1

    def _vector_ok(self, buf, start, vec) -> bool:
        """Can elements ``start + k*vec .. + vec - 1`` of ``buf``'s last dim be one aligned access?  They
        must be contiguous (in a shared tile: within one swizzle chunk) and start on a multiple of ``vec``;
        in a global tensor, a last dim divisible by ``vec`` also aligns every row and puts whole
        vectors in or out of bounds, so one predicate (on the first element) guards a vector."""
        if buf.scope not in ("global", "shared") or buf.shape[-1] % vec or not self._divisible(start, vec):
            return False
        lay = self.shared[buf].layout if buf.scope == "shared" else None
        return lay is None or lay.chunk % vec == 0

    # ------------------------------------------------------------------ elementwise

    def fill(self, node: Fill, vm):
        b = node.buffer
        value = self.expr(node.value, vm)
        if b.scope == "fragment":
            with T.unroll(0, self.infer.layouts[b].local_size) as r:
                T.buffer_store(self.frags[b], _cast(value, b.dtype), [r])
        elif b.scope == "local":
            with T.unroll(0, math.prod(b.shape)) as r:
                T.buffer_store(self.locals[b], _cast(value, b.dtype), [r] if len(b.shape) == 1 else _unflat(r, b.shape))
        else:
            bits = dtype_bits(b.dtype)
            vec = _widest(bits, lambda v: self._vector_ok(b, 0, v) and _broadcastable(bits, v))
            self.flat_loop(list(b.shape), lambda idx: self.store(b, idx, value, vec=vec), vec)

    def _check_parallel_inside(self, node: Parallel):
        """Shared and local tiles are not predicated: an index T.Parallel takes past a tile's end (or before
        its start) at some iteration, the first or the last, would write or read a neighbouring tile."""
        ends = [{v: 0 for v in node.vars}, {v: e - 1 for v, e in zip(node.vars, node.extents)}]
        for st in (n for n in walk(node.body) if isinstance(n, Store)):
            accesses = [(st.buffer, st.indices)] + [(self.buffers.get(b), idx) for b, idx in collect_loads(st.value)]
            for buf, idx in accesses:
                if buf is None or buf.scope not in ("shared", "local"):
                    continue
                for d, (i, dim) in enumerate(zip(idx, buf.shape)):
                    if isinstance(i, int):
                        i = tirx.const(i, "int32")
                    first, last = (rewrite(i, at) for at in ends)
                    if self.ana.can_prove(tirx.Or(first < 0, last >= dim)):
                        raise error(st.loc, f"{buf.name}{list(buf.shape)}: T.Parallel{tuple(node.extents)} indexes "
                                            f"dim {d} from {self.ana.simplify(first)} to {self.ana.simplify(last)}, "
                                            f"outside 0..{dim - 1} (shared and local tiles are not predicated, only "
                                            f"global tensors are)")

    def parallel(self, node: Parallel, vm):
        self._check_parallel_inside(node)
        anchor = self.infer.parallel.get(id(node))
        if anchor is None:  # no fragment: spread the iteration space over the threads, vec columns each
            vec = self._parallel_vector_width(node)

            def run(idx):
                inner = {**vm, **dict(zip(node.vars, idx))}
                for st in node.body:
                    self._parallel_store(st, inner, None, node, vec)
            return self.flat_loop(node.extents, run, vec)
        with T.unroll(0, anchor.local_size) as r:
            coords = anchor.coords(self.tid, r)
            inner = {**vm, **dict(zip(node.vars, coords))}

            def frag_index(buf, idx, _r=r):
                lay = self.infer.layouts[buf]
                if lay == anchor:
                    return _r
                if isinstance(lay, MmaRowLayout) and isinstance(anchor, MmaAccumLayout):  # checked in inference
                    return lay.row_of_accum_local(_r, anchor)
                raise TileLangError(f"fragment {buf.name} does not share the loop's layout")

            for st in node.body:
                self._parallel_store(st, inner, frag_index, node)

    def _parallel_store(self, st: Store, vm, frag_index, node, vec=1):
        if frag_index is not None:  # fragment indices must be the loop vars themselves (checked in inference)
            for buf_var, idx in collect_loads(st.value):
                buf = self.buffers.get(buf_var)
                if buf is not None and buf.scope == "fragment" and not (
                        _is_vars(idx, node.vars) or _is_vars(idx, node.vars[:1])):
                    raise error(st.loc, f"fragment {buf.name} must be indexed by the T.Parallel loop variables")
        if vec > 1:
            value = self._lanes(st.value, vm, node.vars[-1], vec)
        else:
            value = self.expr(st.value, vm, frag_index, guard=True)
        self._guarded_store(st.buffer, [self.expr(i, vm) for i in st.indices], value, frag_index, vec=vec)

    def _parallel_vector_width(self, node: Parallel) -> int:
        """The widest vector along the innermost var j such that every statement is a lane-wise
        function of accesses contiguous in j (see _lanes)."""
        j = node.vars[-1]
        widths = [dtype_bits(b.dtype) for b in _buffers_in(node, self.buffers)]
        return _widest(max(widths), lambda v: node.extents[-1] % v == 0 and _broadcastable(min(widths), v) and all(
            self._contiguous(st.buffer, st.indices, j, v) and self._lanes(st.value, {}, j, v) is not None
            for st in node.body))

    def _lanes(self, e, vm, j, vec):
        """``e`` at ``vec`` consecutive values of j, from the one ``vm`` gives: a vector where ``e``
        depends on j, the scalar where not; None where ``e`` is more than arithmetic and casts of
        contiguous loads, or has a value wider than 16 bytes (CUDA has no such vector types): the
        caller then takes a narrower vector or stays scalar."""
        if not uses(e, j):
            return self.expr(e, vm, guard=True)
        if vec * dtype_bits(str(e.ty)) > 128:
            return None
        if isinstance(e, TensorLoad):
            buf = self.buffers.get(e.source)
            if buf is None or not self._contiguous(buf, e.indices, j, vec):
                return None
            return self._guarded_load(buf, [self.expr(i, vm) for i in e.indices], vec=vec)
        if isinstance(e, px.BinaryOpExpr):
            a, b = self._lanes(e.a, vm, j, vec), self._lanes(e.b, vm, j, vec)
            return None if a is None or b is None else type(e)(_broadcast(a, vec), _broadcast(b, vec))
        if isinstance(e, px.Cast):
            v = self._lanes(e.value, vm, j, vec)
            return None if v is None else _cast(v, str(e.ty))
        return None

    def _contiguous(self, buf, idx, j, vec) -> bool:
        """``buf[..., base + j]`` with j nowhere else, and ``vec`` elements from ``base + j`` (j a multiple
        of vec) one aligned access."""
        base = self.ana.simplify(idx[-1] - j)
        if any(uses(i, j) for i in [base, *idx[:-1]]):
            return False
        return self._vector_ok(buf, self.expr(base), vec)

    # ------------------------------------------------------------------ gemm (mma.sync)

    def gemm(self, g: Gemm):  # (its operands were checked by layout inference, on every path)
        A, B, C = g.A, g.B, g.C
        Ka = A.shape[0] if g.transpose_A else A.shape[1]
        if self.hopper and self.hopper.is_wgmma(g):
            return self.hopper.gemm(g)
        lay: MmaAccumLayout = self.infer.layouts[C]
        w = lay.w
        if g.clear_accum:
            with T.unroll(0, lay.local_size) as r:
                T.buffer_store(self.frags[C], tirx.const(0.0, "float32"), [r])
        mi_n, ni_n = w.WM // 16, w.WN // 8
        b_x4 = w.WN % 16 == 0
        a_regs = T.alloc_local([mi_n * 4], "uint32")
        b_regs = T.alloc_local([ni_n * 2], "uint32")
        IRBuilder.name("a_regs", a_regs)
        IRBuilder.name("b_regs", b_regs)
        lane = tirx.floormod(self.tid, 32)
        wr, wc = lay.warp_rc(self.tid)
        m_base, n_base = wr * w.WM, wc * w.WN
        el = MMA_DTYPES[A.dtype]
        with T.unroll(0, Ka // 16) as kk:
            k0 = kk * 16
            if A.scope == "shared":
                ta = self.shared[A]
                for mi in range(mi_n):
                    m0 = m_base + mi * 16
                    if not g.transpose_A:  # (M, K) tile, K contiguous
                        row, col = m0 + tirx.floormod(lane, 16), k0 + tirx.floordiv(lane, 16) * 8
                        trans = ""
                    else:  # (K, M) tile
                        row = k0 + tirx.floordiv(lane, 16) * 8 + tirx.floormod(lane, 8)
                        col = m0 + tirx.floormod(tirx.floordiv(lane, 8), 2) * 8
                        trans = ".trans"
                    ptr = ta.view.ptr_to([self.shared_offset(ta, [row, col], self.stage(A))])
                    T.evaluate(TS.ptx[f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16"](
                        *[a_regs[mi * 4 + q] for q in range(4)], ptr))
            tb = self.shared[B]
            step = 2 if b_x4 else 1
            for nj in range(0, ni_n, step):
                n0 = n_base + nj * 8
                if not g.transpose_B:  # (K, N) tile, N contiguous: transpose while loading
                    row = k0 + tirx.floormod(tirx.floordiv(lane, 8), 2) * 8 + tirx.floormod(lane, 8)
                    col = n0 + (tirx.floordiv(lane, 16) * 8 if b_x4 else 0)
                    trans = ".trans"
                else:  # (N, K) tile, K contiguous
                    row = n0 + (tirx.floordiv(lane, 16) * 8 if b_x4 else 0) + tirx.floormod(lane, 8)
                    col = k0 + tirx.floormod(tirx.floordiv(lane, 8), 2) * 8
                    trans = ""
                ptr = tb.view.ptr_to([self.shared_offset(tb, [row, col], self.stage(B))])
                n_regs = 4 if b_x4 else 2
                T.evaluate(TS.ptx[f"ldmatrix.sync.aligned.m8n8.x{n_regs}{trans}.shared.b16"](
                    *[b_regs[nj * 2 + q] for q in range(n_regs)], ptr))
            a_words = self.frags[A].view("uint32") if A.scope == "fragment" else None
            a_lay = self.infer.layouts.get(A)
            for mi in range(mi_n):
                if a_words is not None:  # A from registers: the accumulator layout of (M, K) is the A layout
                    a_ops = [a_words[x] for x in a_lay.a_operand_words(mi, kk)]
                else:
                    a_ops = [a_regs[mi * 4 + q] for q in range(4)]
                for nj in range(ni_n):
                    c = [self.frags[C][(mi * ni_n + nj) * 4 + e] for e in range(4)]
                    T.evaluate(TS.ptx[f"mma.sync.aligned.m16n8k16.row.col.f32.{el}.{el}.f32"](
                        *c, *a_ops, b_regs[nj * 2], b_regs[nj * 2 + 1], *c))

    # ------------------------------------------------------------------ reductions

    def reduce(self, node: Reduce):
        src_l: MmaAccumLayout = self.infer.layouts[node.src]
        dst_l = self.infer.layouts[node.dst]
        op = tirx.max if node.kind == "max" else (lambda a, b: a + b)
        init = -tirx.infinity("float32") if node.kind == "max" else tirx.const(0.0, "float32")
        src, dst = self.frags[node.src], self.frags[node.dst]
        ni = src_l.ni
        part = T.alloc_local([dst_l.local_size], "float32")
        IRBuilder.name("partial", part)
        for rr in range(dst_l.local_size):
            mi, h = rr // 2, rr % 2
            v = init
            for nj in range(ni):
                for e in (2 * h, 2 * h + 1):
                    v = op(v, _cast(src[(mi * ni + nj) * 4 + e], "float32"))
            T.buffer_store(part, v, [rr])
            for mask in (1, 2):  # the 4 lanes of a quad hold one row
                T.buffer_store(part, op(part[rr], top.tvm_warp_shuffle_xor(0xFFFFFFFF, part[rr], mask, 32, 32)), [rr])
        w = src_l.w
        if w.wn > 1:  # rows spread over warps: combine through shared memory
            lane = tirx.floormod(self.tid, 32)
            wr, wc = src_l.warp_rc(self.tid)
            self.sync()
            with T.If(tirx.floormod(lane, 4) == 0):
                with T.Then():
                    for rr in range(dst_l.local_size):
                        row = dst_l.coords(self.tid, rr)[0]
                        T.buffer_store(self.scratch, part[rr], [row * w.wn + wc])
            self.sync()
            for rr in range(dst_l.local_size):
                row = dst_l.coords(self.tid, rr)[0]
                v = self.scratch[row * w.wn]
                for c in range(1, w.wn):
                    v = op(v, self.scratch[row * w.wn + c])
                T.buffer_store(part, v, [rr])
        for rr in range(dst_l.local_size):
            v = part[rr] if node.clear else op(_cast(dst[rr], "float32"), part[rr])
            T.buffer_store(dst, _cast(v, node.dst.dtype), [rr])


# ---------------------------------------------------------------------- helpers

_EXP2_OP = top.Op.get("tirx.exp2")


def _fast_exp2(call):
    """float32 T.exp2 as one MUFU.EX2 (``exp2_approx``)."""
    if call.op.same_as(_EXP2_OP) and str(call.ty) == "float32":
        return exp2_approx(call.args[0])
    return None


def _cast(v, dtype):
    """``v`` as ``dtype`` (per lane, for a vector)."""
    if isinstance(v, (int, float)):
        return tirx.const(v, dtype)
    dtype = _vtype(dtype, v.ty.dtype.lanes)
    return v if str(v.ty) == dtype else tirx.Cast(dtype, v)


def _broadcast(v, vec):
    return tirx.Broadcast(v, vec) if vec > 1 and v.ty.dtype.lanes == 1 else v


def _widest(bits: int, fits) -> int:
    """Elements per access: the widest of 16, 8 and 4 bytes that ``fits(vec)``, else 1."""
    return next((v for v in (128 // bits, 64 // bits, 32 // bits) if v > 1 and fits(v)), 1)


def _broadcastable(bits: int, vec: int) -> bool:
    """Whether a scalar of ``bits`` can be broadcast to ``vec`` lanes: TVM's CUDA code builds 8 or 16 lanes of
    8-bit values with a make_int2/make_int4 of 8 or 16 arguments, which nvcc refuses."""
    return bits > 8 or vec <= 4


def _ramp(base, vec):
    return tirx.Ramp(base, 1, vec) if vec > 1 else base


def _vtype(dtype: str, vec: int) -> str:
    return f"{dtype}x{vec}" if vec > 1 else dtype


def _vload(buf, idx, vec):
    return tirx.BufferLoad(buf, idx[:-1] + [_ramp(idx[-1], vec)])


def _squeeze(extents) -> list:
    """Extents without leading 1s: a (1, M, K) window of a 3-D tensor matches an (M, K) tile."""
    ext = list(extents)
    while len(ext) > 1 and ext[0] == 1:
        ext.pop(0)
    return ext


_SUMS = (px.Add, px.Mul, px.FloorDiv, px.Div, px.Min, px.BitwiseAnd, px.BitwiseOr, px.RShift, px.LShift)


def _nonneg(e) -> bool:
    """Whether index ``e`` is >= 0 by its form.  Every integer variable of a lowered program is an index
    (thread and block ids, loop counters from 0, counts the compiler binds), so only a subtraction or a
    negative constant makes an index negative (the analyzer knows no variable's range)."""
    if isinstance(e, int):
        return e >= 0
    if isinstance(e, px.IntImm):
        return e.value >= 0
    if isinstance(e, px.Var):
        return True
    if isinstance(e, _SUMS):
        return _nonneg(e.a) and _nonneg(e.b)
    if isinstance(e, px.FloorMod):  # floormod takes the divisor's sign
        return _nonneg(e.b)
    if isinstance(e, px.Max):
        return _nonneg(e.a) or _nonneg(e.b)
    if isinstance(e, px.Cast):
        return _nonneg(e.value)
    if isinstance(e, px.Select):
        return _nonneg(e.true_value) and _nonneg(e.false_value)
    if isinstance(e, Call):
        op = getattr(e.op, "name", "")
        if op.endswith("if_then_else"):
            return _nonneg(e.args[1]) and _nonneg(e.args[2])
        if op == "tirx.cuda.func_call":
            name = e.args[0].value
            return name == "tile_ops_grid_x" or name == "tile_ops_warp_uniform" and _nonneg(e.args[1])
    return False


def _pad(idx, like) -> list:
    """Tile coordinates for a side of higher rank: leading dims at offset 0."""
    return [0] * (len(like) - len(idx)) + list(idx)


def _align(n: int, alignment: int = ALIGN) -> int:
    return -(-n // alignment) * alignment


def _unflat(r, shape):
    idx = []
    for s in reversed(shape):
        idx.append(tirx.floormod(r, s))
        r = tirx.floordiv(r, s)
    return list(reversed(idx))


def _walk_pipelined(node):
    if isinstance(node, For):
        if node.kind == "pipelined":
            yield node
        for n in node.body:
            yield from _walk_pipelined(n)


def _node_buffers(node, buffers) -> list:
    """Every buffer a tile op (or loop nest, whole) reads or writes."""
    if isinstance(node, Copy):
        return [node.src.buffer, node.dst.buffer]
    if isinstance(node, Gemm):
        return [node.A, node.B, node.C]
    if isinstance(node, Fill):
        return [node.buffer]
    if isinstance(node, Reduce):
        return [node.src, node.dst]
    if isinstance(node, (Store, Parallel)):
        return _buffers_in(node, buffers)
    if isinstance(node, (For, RowSoftmaxStore)):
        return [b for n in node.body for b in _node_buffers(n, buffers)]
    return []


def _buffers_in(node, buffers):
    out = []
    stores = [node] if isinstance(node, Store) else [n for n in walk(node.body) if isinstance(n, Store)]
    for st in stores:
        out.append(st.buffer)
        for buf_var, _ in collect_loads(st.value):
            b = buffers.get(buf_var)
            if b is not None:
                out.append(b)
    return out


def lower(prog: ir.Program, arch: str) -> LoweredKernel:
    return Lowerer(prog, arch).lower()
