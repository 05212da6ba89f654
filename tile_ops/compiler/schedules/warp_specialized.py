"""The warp-specialized pipeline of ``T.Pipelined`` on sm_90a: the kernel gets one extra warpgroup (the
producer) after the program's ``threads`` (the consumers; two copies of them with pingpong, taking the
tiles in turns).  One producer thread walks the pipelined loop issuing the loop's global->shared copies
as TMA loads into stage ``k % S``, each stage guarded by two mbarriers: ``full[s]`` (TMA bytes landed)
and ``empty[s]`` (every consumer warp is done reading).  The consumers run the rest of the program; their
barriers are a named barrier that excludes the producer.  ``setmaxnreg`` moves registers from the
producer to the consumers' accumulators.  The epilogue's shared -> global tile copies become TMA stores.

A kernel takes this schedule when its one ``T.Pipelined`` loop's loads can all be TMA loads
(``WarpSpecialized.plan``); with ``T.Kernel(cluster=...)`` a load that every block of a cluster row or
column shares is split into slices, each block loading one into all of them (TMA multicast)."""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from functools import cached_property

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ...lang.ir import AtomicAdd, Copy, For, Gemm, error, walk
from ..cuda import emit_ptx, warp_uniform
from ..exprs import at_most, dtype_bits, reads_memory, stride_multiples, uses
from ..layout import in_swizzled_panels, shared_layout
from ..memory import pipelined_loads
from ..ops import deferred, unit
from ..ops import setup as setup_ops
from ..ops.copy import copy_extents
from ..ops.gemm import is_wgmma
from ..targets import REGISTERS_PER_SM, SHARED_PER_SM, sm90
from . import pingpong, turns
from .persistent import TileWalk
from .stream_k import StreamK, accumulators

PRODUCER_THREADS = 128
# Two resident CTAs of 256 threads cap ptxas at 128 registers per thread everywhere (setmaxnreg moves
# physical registers, it does not lift the compile-time cap): only programs whose fragments fit co-reside.
CORESIDENT_FRAGMENT_WORDS = 128
PRODUCER_REGISTERS = 40  # per producer thread after setmaxnreg.dec: it only issues TMA and waits
TMA_ADD_DTYPES = ("float32", "float16", "bfloat16")  # what TMA's reduce-add adds
CONSUMER_BARRIER = 1  # named barrier id for consumer-only syncs (0 is __syncthreads); 2: pingpong's second


class WarpSpecialized:
    def __init__(self, lw, loop: For, outer: list, loads: list, stores: list, deferred_wait: bool):
        self.lw = lw
        self.loop = loop  # the program's one T.Pipelined loop
        self.outer = outer  # the serial loops around it, outermost first (the producer walks the same nest)
        self.loads = loads  # its global->shared copies, issued by the producer as TMA loads
        # shared->global tile copies outside the loop (the epilogue) and T.atomic_adds of shared tiles anywhere,
        # issued as TMA stores and reduce-adds
        self.stores = stores
        self.stages = max(loop.num_stages, 1)
        self.deferred_wait = deferred_wait  # the loop only issues gemms: one wgmma group stays in flight
        # (load, cluster axes): loads alike along those axes, each block loads 1/n of the rows for all n
        self.multicast = [(c, axes) for c in loads for axes in [self._multicast_axes(c, outer + [loop])] if axes]
        self.tensormaps = sm90.TensorMaps(lw)
        self.walk = TileWalk(lw)
        k = lw.kernel
        self.pingpong = pingpong.PingPong(lw, self._constant_steps("pingpong=True")) if k.pingpong else None
        self.stream_k = None
        if k.stream_k:
            steps = self._constant_steps(f"stream_k={k.stream_k}")
            self.stream_k = StreamK(lw, accumulators(k, loop), k.stream_k, steps)
        self.peer_empty = None  # (this lane's writer's empty[0], writers): bound before a multicast main loop
        # several consumer warpgroups issuing each step's leading gemms in turns (T.Pipelined(mma_turns=True))
        self.turns = turns.Turns(lw) if loop.mma_turns and lw.threads >= 2 * turns.WARPGROUP else None
        self.turn = None  # (first, last) gemm of the statements being lowered that make a turn

    @staticmethod
    def plan(lw) -> "WarpSpecialized | None":
        """The schedule of a kernel whose one T.Pipelined loop (inside serial loops at most) loads only what
        TMA can, from tensors the block does not write; None where the kernel cannot take it."""
        k = lw.kernel
        found = [(n, outer) for n, outer in _pipelined_loops(k.body, [])]
        block = k.threads * (2 if k.pingpong else 1) + PRODUCER_THREADS
        if k.threads % 128 or len(found) != 1 or block > 1024:  # CUDA's block limit, with the producer
            return None
        loop, outer = found[0]
        if not all(o.kind in ("serial", "unroll") and not reads_memory(o.extent) for o in outer) \
                or reads_memory(loop.extent):
            return None
        loads = pipelined_loads(loop)
        if not loads or not all(_tma_ok(lw, c) for c in loads):
            return None
        written = {id(b) for node in k.body for b in lw.global_writes(node)}
        if any(id(c.src.buffer) in written for c in loads):  # the producer joins no consumer barrier: its TMA
            return None  # loads would not wait for the block's own writes of what they read
        compute = [s for s in loop.body if s not in loads]
        # gemms only: step k - 1's stage is released in step k, after step k's data came, which needs a second stage
        deferred = bool(compute) and loop.num_stages >= 2 and all(isinstance(s, Gemm) and is_wgmma(lw, s)
                                                                  for s in compute)
        stores = [c for c in walk(k.body) if isinstance(c, Copy) and not _contains(loop, c)
                  and c.src.buffer.scope == "shared" and c.dst.buffer.scope == "global" and _tma_ok(lw, c)]
        stores += [a for a in walk(k.body) if isinstance(a, AtomicAdd) and a.src.buffer.scope == "shared"
                   and a.dst.buffer.dtype in TMA_ADD_DTYPES and _tma_ok(lw, a)]
        return WarpSpecialized(lw, loop, outer, loads, stores, deferred)

    def _constant_steps(self, what: str) -> int:
        """Pipeline steps of one tile, the same for every tile: a pingpong warpgroup skips the other's, and
        stream-K splits them into parts."""
        k, loop = self.lw.kernel, self.loop
        if self.outer:
            raise error(k.loc, f"{what} needs the T.Pipelined loop at the kernel's top level (one main loop per "
                               f"tile), not inside another loop")
        steps = self.lw.ana.simplify(tirx.const(loop.extent, "int32") if isinstance(loop.extent, int) else loop.extent)
        if not isinstance(steps, tirx.IntImm):
            raise error(k.loc, f"{what} needs the same number of pipeline steps in every tile (a loop extent "
                               f"that does not depend on the block): got {steps}")
        return int(steps)

    def _multicast_axes(self, c: Copy, loops: list) -> tuple:
        """The cluster axes (0: grid x, 1: grid y) along which a load's global window does not change, nor
        the pipeline's trip counts (``loops``: the blocks step their stages in lockstep): its n blocks along
        them read the same tile, so it is split into n row slices and each block loads one slice into all
        n blocks (TMA multicast).  () when none, or when the rows do not split into n slices that start
        128-byte aligned (TMA's rule for a shared destination).  A slice need not be whole 8-row swizzle
        atoms (72 rows in 4): TMA swizzles by the shared address, and every panel starts 1024-byte aligned."""
        dims, block_vars = self.lw.cluster_dims, self.lw.kernel.block_vars
        axes = tuple(a for a, n in enumerate(dims) if n > 1 and not any(
            uses(x, block_vars[a]) for x in [*c.src.starts, *(o.extent for o in loops)]))
        n = math.prod(dims[a] for a in axes)
        lay = shared_layout(c.dst.buffer)
        slice_bytes = lay.rows // n * lay.panel * lay.dtype_bits // 8
        return axes if axes and lay.rows % n == 0 and slice_bytes % 128 == 0 else ()

    def is_tma_store(self, node) -> bool:
        return any(node is c for c in self.stores)

    # ------------------------------------------------------------------ resources

    @cached_property
    def ctas_per_sm(self) -> int:
        """Two co-resident CTAs per SM for a one-consumer-warpgroup pipeline whose shared memory fits
        twice: while one CTA stores its tile (or waits on TMA), the other's wgmmas keep the tensor
        cores busy, which is what ping-pong consumer warpgroups achieve inside one CTA."""
        lw = self.lw
        if lw.threads != 128 or self._fragment_words() > CORESIDENT_FRAGMENT_WORDS:
            return 1
        if lw.cluster > 1 or lw.consumers > 1:  # clusters are scheduled whole; pingpong is the
            return 1  # two-consumer alternative
        if at_most(math.prod(lw.kernel.grid), lw.target.sms):  # every CTA has an SM of its own anyway
            return 1
        return 2 if 2 * (lw.memory.plan().total + 1024) <= SHARED_PER_SM else 1

    def _fragment_words(self) -> int:
        """32-bit registers per consumer thread that the program's fragments hold."""
        lw = self.lw
        return sum(-(-lw.infer.layouts[b].local_size * dtype_bits(b.dtype) // 32)
                   for b in lw.kernel.allocs if b.scope == "fragment")

    def resident_ctas(self) -> int:
        """CTAs that run at once on the target: one per SM (or two); for clustered kernels an estimate (GPCs
        hold whole clusters; pairs fit the SM pairs), which the launcher replaces with the driver's count."""
        n = self.lw.cluster
        if n > 1:  # a multiple of n: the blocks of a cluster must walk the same tiles in lockstep
            return self.lw.target.wave_ctas(n)
        return self.lw.target.sms * self.ctas_per_sm

    def one_tile_per_cta(self) -> bool:
        """Whether every CTA runs one tile, its main loop at the program's top level: not a persistent grid
        (``persistent=False``, or a grid within one wave), no pingpong, stream-K or row-softmax walk, no
        cluster exchange.  Decided without the memory plan, which depends on it."""
        lw = self.lw
        if self.outer or lw.consumers > 1 or self.stream_k or lw.walks_tiles:
            return False
        one_wave = at_most(math.prod(lw.kernel.grid), lw.target.wave_ctas(lw.cluster))
        exchanges = any(unit(n).regions(lw, n) for n in walk(lw.kernel.body))  # shared memory the peers write
        return not exchanges and (not lw.kernel.persistent or one_wave)

    def consumer_registers(self) -> int | None:
        """setmaxnreg target of the consumer warps, or None when the launch-bound budget already suffices:
        what the producer warpgroup gives up, shared among the consumer warpgroups."""
        n_wg, per_sm = self.lw.threads * self.lw.consumers // 128, self.ctas_per_sm
        if n_wg == 1 and per_sm == 1:
            return None
        block = 128 * n_wg + PRODUCER_THREADS  # ptxas gives each thread the launch bound's share, in 8s: the CTA's
        pool = REGISTERS_PER_SM // (block * per_sm) // 8 * 8 * block  # pool (640 threads: 96 each, not 65536 / 640)
        return min(240, (pool - PRODUCER_REGISTERS * PRODUCER_THREADS) // (128 * n_wg) // 8 * 8)

    def block_threads(self) -> int:
        return self.lw.threads * self.lw.consumers + PRODUCER_THREADS

    # ------------------------------------------------------------------ mbarriers

    def mbarrier_count(self) -> int:
        return 2 * self.stages

    def full(self, s):
        return self.lw.memory.mbarrier(self, s)

    def empty(self, s):
        return self.lw.memory.mbarrier(self, self.stages + s)

    def init_mbarriers(self):
        for s in range(self.stages):
            emit_ptx("mbarrier.init.shared::cta.b64", self.full(s), 1)
            emit_ptx("mbarrier.init.shared::cta.b64", self.empty(s), self._release_count())  # see release

    def _release_count(self) -> int:
        """Arrivals that free a stage: one per consumer warp of every block that writes into it (with
        multicast loads, the peers' producers write into this block's stages too)."""
        return self.lw.threads // 32 * max(1, len(self._stage_writers()))

    # ------------------------------------------------------------------ multicast

    def _axes(self, c: Copy) -> tuple:
        return next((axes for m, axes in self.multicast if m is c), ())

    def slices(self, c: Copy) -> int:
        return math.prod(self.lw.cluster_dims[a] for a in self._axes(c))

    def _multicast_group(self, axes: tuple):
        """(this block's slice index, ctaMask) of a load multicast along ``axes``: its cluster row (axis 0),
        column (axis 1) or the whole cluster."""
        (cx, cy), n = self.lw.cluster_dims, self.lw.cluster
        rank, rx, ry = sm90.cluster_position(self.lw)
        if axes == (0, 1):
            return rank, tirx.const((1 << n) - 1, "uint16")
        if axes == (0,):
            mask = (1 << cx) - 1
            return rx, (tirx.const(mask, "uint16") if cy == 1
                        else tirx.Cast("uint16", tirx.const(mask, "int32") << (ry * cx)))
        column = sum(1 << (j * cx) for j in range(cy))
        return ry, tirx.Cast("uint16", tirx.const(column, "int32") << rx)

    def _stage_writers(self) -> list:
        """Ranks of the blocks whose producers write into this block's stages, itself included (the union
        of its multicast groups): its consumers release a stage on each of them."""
        (cx, cy), n = self.lw.cluster_dims, self.lw.cluster
        axes = {a for _, ax in self.multicast for a in ax}
        if not axes:
            return []
        if any(ax == (0, 1) for _, ax in self.multicast) or cy == 1:
            return list(range(n))
        _, rx, ry = sm90.cluster_position(self.lw)
        if axes == {1}:  # the column
            return [rx + j * cx for j in range(cy)]
        row = [ry * cx + i for i in range(cx)]
        return row if axes == {0} else row + [rx + tirx.floormod(ry + j, cy) * cx for j in range(1, cy)]

    def _bind_peer_empty(self):
        """With multicast loads, lane i of each consumer warp maps empty[0] into the i-th writer of this
        block's stages (``mapa``) once, before the main loop: a release is then one arrive, predicated on
        the first lanes, that reaches every writer at once (as CUTLASS spreads a warpgroup's arrivals over
        its threads), instead of one arrive per writer in turn from lane 0 with the peer's address
        recomputed each step, which held a 2x4 cluster's gemm well below cuBLAS."""
        self.peer_empty = None  # a binding of an earlier loop's scope is not this one's
        writers = self._stage_writers() if self.multicast else []
        if not writers:
            return
        lane, peer = tirx.floormod(self.lw.tid, 32), tirx.const(0, "int32")
        for i, w in reversed(list(enumerate(writers))):
            peer = tirx.Select(lane == i, tirx.const(w, "int32") if isinstance(w, int) else w, peer)
        var = T.Var("peer_empty", "uint32")
        T.Bind(sm90.peer_address(self.empty(0), tirx.Cast("uint32", peer)), var=var)
        self.peer_empty = (var, len(writers))

    def _release(self, s):
        """One arrive on empty[s] per consumer warp (and writer) once the warp is done with stage s (after a
        warp-wide wgmma wait or __syncwarp): 1/32 of the shared-memory atomics of a per-thread arrive."""
        lane = tirx.floormod(self.lw.tid, 32)
        if self.multicast:  # every writer's copy of stage s, lane i arriving on writer i's (_bind_peer_empty)
            bar, writers = self.peer_empty
            sm90.cluster_arrive_if(bar + tirx.Cast("uint32", s * 8), tirx.Cast("int32", lane < writers))
            return
        with T.If(lane == 0):
            with T.Then():
                emit_ptx("mbarrier.arrive.shared::cta.b64", self.empty(s))

    # ------------------------------------------------------------------ the kernel

    def grid(self, grid: list) -> list:
        return self.walk.grid(grid)

    def run(self, body, cta):
        """The kernel's code: the producer warpgroup's, then the consumers'."""
        lw = self.lw
        consumers = lw.threads * lw.consumers
        lw.memory.init_mbarriers()
        regs = self.consumer_registers()
        with T.If(lw.tid >= consumers):
            with T.Then():
                if regs:
                    emit_ptx("setmaxnreg.dec.sync.aligned.u32", PRODUCER_REGISTERS)
                with T.If(lw.tid == consumers):
                    with T.Then():
                        self._producer(cta)
                helpers = [(op, node) for op, node in lw.ops if op.uses_producer_warp]
                for warp, (op, node) in enumerate(helpers, 1):  # the producer warpgroup's spare warps
                    with T.If(tirx.floordiv(lw.tid, 32) == consumers // 32 + warp):
                        with T.Then():
                            op.producer_warp(lw, node, cta)
            with T.Else():
                if regs:
                    emit_ptx("setmaxnreg.inc.sync.aligned.u32", regs)
                self._consumers(body, cta)

    def _producer(self, cta):
        self.tensormaps.prefetch()
        if self.multicast:  # peers' shared memory exists and their barriers are initialized
            emit_ptx("barrier.cluster.wait.acquire")
        cnt = _step_counter()
        with self.walk.tiles(cta):
            self._producer_nest(self.outer, {}, cnt)
        if self.multicast:
            self._producer_tail(cnt)

    def _consumers(self, body, cta):
        lw = self.lw
        if lw.cluster > 1:  # every block of the cluster has started (its shared memory exists)
            emit_ptx("barrier.cluster.wait.acquire.aligned")
        self.consumer_steps = _step_counter()
        setup_ops(lw)
        # a tile's first shared access is unguarded by its barriers, so the previous tile's readers
        # need one at the end of the tile: unless that access is a main loop that only issues
        # wgmmas on its stages, which the mbarriers guard
        first = next((n for n in body if lw.touches_shared(n)), None)
        guard_tile_start = first is not None and not (first is self.loop and self.deferred_wait)
        if self.pingpong:
            self.pingpong.start(self.consumer_steps)
        if lw.threads > 128:  # A's wgmma descriptors then stay in uniform registers
            lw.wgmma_warpgroup = bind_warpgroup(lw.tid, 128, "wgmma_warpgroup")
        if self.turns:
            self.turns.start()
        with self.walk.tiles(cta, lw.consumer if self.pingpong else None):
            lw.body(body)
            if self.walk.persistent and guard_tile_start:
                lw.sync()
            if self.pingpong:
                self.pingpong.next_tile(self.consumer_steps)
        for op, node in self.tile_walkers():  # the block's last tile
            op.finish_tile(lw, node, self.walk.cta_tiles - 1)
        if self.stores:  # the block's shared memory must outlive TMA's reads of the last tile
            self.wait_stores_read()

    def after_main_loop(self, rest: ExitStack):
        """What follows the main loop of a tile in the consumers' body: stream-K's exchange of partials (the
        rest of the tile is lowered inside ``rest``, an ExitStack, for the units that are not writers), and
        what the ops that walk the tiles finish of the previous tile (a T.row_reduce_store's store)."""
        if self.stream_k and self.stream_k.unit:
            cond = self.stream_k.fixup(CONSUMER_BARRIER, self.lw.threads)
            rest.enter_context(T.If(cond))
            rest.enter_context(T.Then())
        for op, node in self.tile_walkers():
            op.finish_tile(self.lw, node, self.walk.tile_ordinal - 1)

    def tile_walkers(self) -> list:
        """(op, node) of the ops that need the persistent tile walk (``TileOp.walks_tiles``)."""
        return [(op, node) for op, node in self.lw.ops if op.walks_tiles]

    def consumer_barrier(self):
        """The consumers' named barrier (each pingpong warpgroup has its own; the producer is at none)."""
        lw = self.lw
        emit_ptx("bar.sync", tirx.Cast("uint32", CONSUMER_BARRIER + lw.consumer) if self.pingpong
                 else CONSUMER_BARRIER, lw.threads)

    # ------------------------------------------------------------------ producer

    def _producer_nest(self, outer, vm, cnt):
        lw = self.lw
        if outer:
            with T.serial(0, lw.expr(outer[0].extent, vm)) as v:
                IRBuilder.name(outer[0].var.name, v)
                self._producer_nest(outer[1:], {**vm, outer[0].var: v}, cnt)
            return
        node = self.loop
        stage_bytes = sum(_tile_bytes(c.dst.buffer) for c in self.loads)
        u = self.stream_k.unit if self.stream_k else None
        steps, k0 = (u["k_steps"], u["k_begin"]) if u else (lw.expr(node.extent, vm), 0)
        with T.serial(0, steps) as k:
            IRBuilder.name(node.var.name, k)
            s = self._wait_free_stage(cnt)
            emit_ptx("mbarrier.arrive.expect_tx.shared::cta.b64", self.full(s), stage_bytes)
            for c in self.loads:
                self._tma_load(c, {**vm, node.var: k0 + k}, s)
            T.buffer_store(cnt, cnt[0] + 1, [0])

    def _tma_load(self, c, vm, stage):
        n = self.slices(c)
        tm = self.tensormaps.of(c, n)
        group = self._multicast_group(self._axes(c)) if n > 1 else None
        sm90.tma_load(self.lw, c, vm, stage, tm, self.full(stage), n, group)

    def _producer_tail(self, cnt):
        """Before the producer exits, wait until every stage is released once more: the peers' consumers
        arrive on this block's empty barriers, so the block must outlive their last arrivals."""
        for _ in range(self.stages):
            self._wait_free_stage(cnt)
            T.buffer_store(cnt, cnt[0] + 1, [0])

    def _wait_free_stage(self, cnt):
        """Wait until the stage of step cnt[0] is released (a fresh barrier passes parity 1); the stage
        (an expression of cnt[0]: count the step only after its last use)."""
        S = self.stages
        s = tirx.floormod(cnt[0], S)
        T.evaluate(TS.cuda.mbarrier_wait(self.empty(s), 1 - tirx.floormod(tirx.floordiv(cnt[0], S), 2)))
        return s

    # ------------------------------------------------------------------ TMA stores

    def tma_store(self, c, vm):
        """The epilogue's shared->global tile copy (or a shared tile's T.atomic_add) through TMA.  The body's
        barrier before it already fenced the consumers' shared writes for the async proxy; one thread issues
        it and goes on: it waits until TMA has read the tile only at the next consumer barrier
        (``wait_stores_read``), so the next tile's main loop runs while TMA reads this one.  A later read of
        the tensor by the block waits for the writes (``lw.tma_written``)."""
        self.lw.tma_written |= {c.dst.buffer}
        sm90.tma_store(self.lw, c, vm, self.tensormaps.of(c))

    def wait_stores_read(self):
        """Before a consumer barrier: the TMA stores' issuer waits until they have read their staged
        tiles, so whatever follows the barrier may rewrite them (a no-op with none in flight)."""
        sm90.wait_stores(self.lw, read_only=True)

    def wait_stores_written(self):
        """Before the consumers read global memory that this block's TMA stores wrote: the issuer waits
        until the stores are complete (not only read from shared memory), a consumer barrier, and each
        reader orders the async proxy's writes before its own reads."""
        sm90.wait_stores(self.lw, read_only=False)
        self.lw.sync()
        emit_ptx("fence.proxy.async.global")
        self.lw.tma_written = frozenset()

    # ------------------------------------------------------------------ consumers' main loop

    def consumer_loop(self, node: For, vm, n):
        """The main loop (a stream-K unit's K range; pingpong warpgroups take it in turns)."""
        u = self.stream_k.unit if self.stream_k else None
        if u:
            return self._consumer_steps(node, vm, u["k_steps"], u["k_begin"])
        if not self.pingpong:
            return self._consumer_steps(node, vm, n)
        self.pingpong.main_loop(lambda: self._consumer_steps(node, vm, n))

    def _consumer_steps(self, node: For, vm, n, k0=0):
        """Wait for stage k, compute on it, release it.  With ``deferred_wait`` the gemms of step k stay
        in flight while step k + 1 waits for its data; step k - 1's stage is released once its
        wgmma group retires.  A loop with a T.deferred block runs it one step late (``_overlapped_steps``)."""
        lw = self.lw
        S, cnt = self.stages, self.consumer_steps
        compute, late = deferred.split([s for s in node.body if s not in self.loads])
        if late:
            return self._overlapped_steps(node, vm, n, k0, compute, late)
        if self.deferred_wait:  # the loop writes no register A operand: its wgmma.fences cover the writes before it
            sm90.fence_operands(lw, compute, accumulators=False)
        self._bind_peer_empty()
        # not unrolled: after a twice-unrolled loop ptxas (CUDA 13.0) moved the epilogue's reads of the
        # accumulators above the final wgmma.wait_group, losing the last k-step
        with T.serial(0, n, unroll=1) as k:
            IRBuilder.name(node.var.name, k)
            s = self._wait_full(cnt)
            lw.stage_of_iter = s
            if self.deferred_wait:
                if self.turns:
                    self.turns.take()
                emit_ptx("wgmma.fence.sync.aligned")
                for g in compute:
                    sm90.issue_wgmma(lw, g)
                emit_ptx("wgmma.commit_group.sync.aligned")
                if self.turns:
                    self.turns.give()
                emit_ptx("wgmma.wait_group.sync.aligned", 1)
                with T.If(k > 0):  # step k - 1's group retired: its stage can be refilled
                    with T.Then():
                        self._release(tirx.floormod(cnt[0] + (S - 1), S))
            else:
                with self._turn(compute):
                    lw.body(compute, {**vm, node.var: k0 + k})
                T.evaluate(TS.cuda.warp_sync())  # every lane of the warp is done reading the stage
                self._release(s)
            lw.stage_of_iter = None
            T.buffer_store(cnt, cnt[0] + 1, [0])
        if self.deferred_wait:
            emit_ptx("wgmma.wait_group.sync.aligned", 0)
            sm90.fence_operands(lw, compute)
            with T.If(n > 0):  # release the last step's stage (an enclosing loop refills it)
                with T.Then():
                    self._release(tirx.floormod(cnt[0] + (S - 1), S))

    def _overlapped_steps(self, node: For, vm, n, k0, body, late):
        """A main loop whose T.deferred statements (``late``, spliced into ``body``) run one step late: step k
        runs its own statements and, at the block's place, step k - 1's on that step's stage, which is then
        released at the end of step k; step 0 runs without them, and the last step's run after the loop.
        The block's wgmmas so run under the statements that follow it (``WgmmaGroups`` waits where needed)."""
        lw = self.lw
        S, cnt = self.stages, self.consumer_steps
        own = [s for s in body if not any(s is x for x in late)]
        self._bind_peer_empty()

        def previous(k):  # step k - 1: its stage (the running step's is cnt[0]'s) and var map
            return tirx.floormod(cnt[0] + (S - 1), S), {**vm, node.var: k0 + k - 1}

        def release_previous():
            T.evaluate(TS.cuda.warp_sync())  # every lane of the warp is done reading the stage
            self._release(tirx.floormod(cnt[0] + (S - 1), S))

        with T.If(n > 0):
            with T.Then():
                lw.stage_of_iter = self._wait_full(cnt)
                with self._turn(own):
                    lw.body(own, {**vm, node.var: k0})
                T.buffer_store(cnt, cnt[0] + 1, [0])
        with T.serial(1, n, unroll=1) as k:
            IRBuilder.name(node.var.name, k)
            late_stage, late_vm = previous(k)
            lw.stage_of_iter = self._wait_full(cnt)
            with self._turn(body):
                lw.body(body, {**vm, node.var: k0 + k}, previous=(late, late_vm, late_stage))
            release_previous()
            T.buffer_store(cnt, cnt[0] + 1, [0])
        with T.If(n > 0):
            with T.Then():
                lw.stage_of_iter, late_vm = previous(n)
                with self._turn(late):
                    lw.body(late, late_vm)
                release_previous()
        lw.stage_of_iter = None

    @contextmanager
    def _turn(self, nodes):
        """Lower ``nodes`` (a step's statements) with the gemms they start with taking a turn."""
        lw = self.lw
        self.turn = turns.leading_gemms(nodes, lambda n: unit(n).reads(n, lw.buffers) + unit(n).writes(n)) \
            if self.turns else None
        try:
            yield
        finally:
            self.turn = None

    def _wait_full(self, cnt):
        """Wait until the stage of step cnt[0] has landed; that stage."""
        S = self.stages
        s = tirx.floormod(cnt[0], S)
        T.evaluate(TS.cuda.mbarrier_wait(self.full(s), tirx.floormod(tirx.floordiv(cnt[0], S), 2)))
        return s


def bind_warpgroup(tid, threads, name):
    """tid // threads bound once from lane 0's value (``__shfl_sync``, all threads converged), so nvcc knows
    it is warp-uniform: the pipeline counts that start from it, and the wgmma descriptors computed from
    those, stay in uniform registers (what CUTLASS's canonical_warp_group_idx does)."""
    var = T.Var(name, "int32")
    T.Bind(warp_uniform(tirx.floordiv(tid, threads)), var=var)
    return var


def _step_counter():
    """Pipeline steps taken so far (across the outer loops): stage = step % S, phase = step / S % 2."""
    cnt = T.alloc_local([1], "int32")
    IRBuilder.name("pipeline_step", cnt)
    T.buffer_store(cnt, 0, [0])
    return cnt


def _tma_ok(lw, c: Copy) -> bool:
    """A tile copy between global and shared memory TMA can do: same dtype, a swizzled 2-D tile
    whose panels are full boxes, a window over the global tensor's last two dims, 16-byte aligned
    strides, and start indices that do not read memory (the producer computes them on its own)."""
    g, t, starts = sm90.global_side(c)
    if g.dtype != t.dtype or dtype_bits(g.dtype) % 8 or not in_swizzled_panels(t) or t.shape[0] > 256:
        return False
    if len(g.shape) > 5:  # a tensor map has at most 5 dims
        return False
    if copy_extents(lw, c) != list(t.shape):  # the whole tile, from the global's last two dims
        return False
    if any(m * dtype_bits(g.dtype) // 8 % 16 for m in stride_multiples(g)[:-1]):  # tensor maps' strides
        return False
    return not any(reads_memory(s) for s in starts)


def _pipelined_loops(body, outer):
    """(loop, enclosing loops) for every T.Pipelined loop."""
    for n in body:
        if isinstance(n, For):
            if n.kind == "pipelined":
                yield n, list(outer)
            yield from _pipelined_loops(n.body, outer + [n])


def _contains(node, target) -> bool:
    return node is target or isinstance(node, For) and any(_contains(n, target) for n in node.body)


def _tile_bytes(buf) -> int:
    return dtype_bits(buf.dtype) // 8 * math.prod(buf.shape)

