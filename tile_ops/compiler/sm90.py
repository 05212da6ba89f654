"""The Hopper (sm_90a) lowering the Lowerer delegates to: TMA copies completing on mbarriers,
wgmma reading shared tiles through matrix descriptors (and A from registers when it is a fragment),
and ``T.Pipelined`` as a warp-specialized producer/consumer pipeline.

Warp specialization: the kernel gets one extra warpgroup (the producer) after the program's
``threads`` (the consumers; two copies of them with pingpong, taking the tiles in turns).  One
producer thread walks the pipelined loop issuing the loop's global->shared copies as TMA loads into
stage ``k % S``, each stage guarded by two mbarriers: ``full[s]`` (TMA bytes landed) and
``empty[s]`` (every consumer thread is done reading).  The
consumers run the rest of the program; their barriers are a named barrier that excludes the
producer.  ``setmaxnreg`` moves registers from the producer to the consumers' accumulators.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property, reduce

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from . import SMS, wave_ctas
from ..jit.kernel import FLAG_SLOTS
from ..lang.ir import Copy, For, Gemm, RowSoftmaxStore, error
from .exprs import collect_loads, uses
from .infer import dtype_bits, in_swizzled_panels, walk
from .layout import MmaAccumLayout, SharedLayout
from .stream_k import Registers, StreamK, accumulators, flag_signal, flag_wait, plan, unit

PRODUCER_THREADS = 128
SM_SHARED_BYTES = 228 * 1024  # per SM, of which each resident CTA reserves 1 KiB
REGISTERS = 65536  # per SM
# Two resident CTAs of 256 threads cap ptxas at 128 registers per thread everywhere (setmaxnreg moves
# physical registers, it does not lift the compile-time cap): only programs whose fragments fit co-reside.
CORESIDENT_FRAGMENT_WORDS = 128
PRODUCER_REGISTERS = 40  # per producer thread after setmaxnreg.dec: it only issues TMA and waits
CONSUMER_BARRIER = 1  # named barrier id for consumer-only syncs (0 is __syncthreads); 2: pingpong's second
MAINLOOP_ORDER = 3  # pingpong: warpgroup w's main loop waits on named barrier 3 + w for the other's to end
_SWIZZLE_ENUM = {32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle
_DESC_MODE = {128: 1, 64: 2, 32: 3}  # wgmma matrix-descriptor layout type
_L2_PROMOTION = {128: 2, 256: 3}  # CUtensorMapL2promotion: 128B, 256B


def l2_promotion(row_bytes: int) -> int:
    """The L2 fill granularity a tensor map asks for: 256 bytes where the global rows are 128-byte aligned,
    128 where they are not (rows of 2000 bytes: each box row straddles two lines, and 256-byte fills cost
    the 1000^3 default 4-9 %, NOTES v16; aligned large shapes keep 256, which sustained runs preferred)."""
    aligned = not isinstance(row_bytes, int) or row_bytes % 128 == 0  # symbolic: no claim, the default
    return _L2_PROMOTION[256 if aligned else 128]


@dataclass
class TensorMap:
    var: object  # tirx Var of type tensormap (a __grid_constant__ CUtensorMap kernel parameter)
    spec: dict  # what the launcher needs to encode it (KernelMeta.tensormaps)


@dataclass
class WarpSpecialization:
    loop: For  # the program's one T.Pipelined loop
    outer: list  # the serial loops around it, outermost first (the producer walks the same nest)
    loads: list  # its global->shared copies, issued by the producer as TMA loads
    stores: list  # shared->global tile copies outside the loop (the epilogue), issued as TMA stores
    stages: int
    deferred_wait: bool  # the loop only issues gemms: keep one wgmma group in flight across iterations
    multicast: list  # (load, cluster axes): loads alike along those axes, each block loads 1/n of the rows for all n


class Hopper:
    def __init__(self, lw):
        self.lw = lw
        self.wgmma_warpgroup = None  # a cooperative kernel's consumer warpgroup, bound warp-uniform
        self.peer_empty = None  # (this lane's writer's empty[0], writers): bound before a multicast main loop
        self.tensormaps: dict = {}  # (global buffer, box) -> TensorMap
        self.persistent = None  # (tiles, program grid) once persistent_grid chose a tile loop
        self.ws = self._plan()
        self.steps_per_tile = self._constant_steps("pingpong=True") if lw.kernel.pingpong and self.ws else None
        self.stream_k = None  # the K split of the last wave's tiles (stream_k.py)
        self.unit = None  # the stream-K unit being walked: its fields (stream_k.unit) and rank
        if lw.kernel.stream_k and self.ws:
            self.stream_k = StreamK(lw, accumulators(lw.kernel, self.ws.loop), lw.kernel.stream_k)
            self.steps_per_tile = self._constant_steps(f"stream_k={lw.kernel.stream_k}")
        self.row_softmax = next((n for n in walk(lw.kernel.body) if isinstance(n, RowSoftmaxStore)), None)
        if self.row_softmax is not None:
            self._check_row_softmax()

    # ------------------------------------------------------------------ planning

    def _plan(self) -> WarpSpecialization | None:
        k = self.lw.kernel
        found = list(_pipelined_loops(k.body, []))
        block = k.threads * (2 if k.pingpong else 1) + PRODUCER_THREADS
        if k.threads % 128 or len(found) != 1 or block > 1024:  # CUDA's block limit, with the producer
            return None
        loop, outer = found[0]
        if not all(o.kind in ("serial", "unroll") and _pure(o.extent) for o in outer) or not _pure(loop.extent):
            return None
        loads = [s for s in loop.body if isinstance(s, Copy) and s.src.buffer.scope == "global"
                 and s.dst.buffer.scope == "shared"]
        if not loads or not all(self._tma_ok(c) for c in loads):
            return None
        written = {id(b) for node in k.body for b in self.lw._global_writes(node)}
        if any(id(c.src.buffer) in written for c in loads):  # the producer joins no consumer barrier: its TMA
            return None  # loads would not wait for the block's own writes of what they read
        compute = [s for s in loop.body if s not in loads]
        # gemms only: step k - 1's stage is released in step k, after step k's data came, which needs a second stage
        deferred = bool(compute) and loop.num_stages >= 2 and all(isinstance(s, Gemm) and self.is_wgmma(s)
                                                                  for s in compute)
        stores = [c for c in walk(k.body) if isinstance(c, Copy) and not _contains(loop, c)
                  and c.src.buffer.scope == "shared" and c.dst.buffer.scope == "global" and self._tma_ok(c)]
        multicast = [(c, axes) for c in loads for axes in [self._multicast_axes(c, outer + [loop])] if axes]
        return WarpSpecialization(loop, outer, loads, stores, max(loop.num_stages, 1), deferred, multicast)

    def _constant_steps(self, what: str) -> int:
        """Pipeline steps of one tile, the same for every tile: a pingpong warpgroup skips the other's, and
        stream-K splits them into parts."""
        k, loop = self.lw.kernel, self.ws.loop
        if self.ws.outer:
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
        t = c.dst.buffer
        lay = SharedLayout(t.shape[0], t.shape[1], dtype_bits(t.dtype))
        slice_bytes = lay.rows // n * lay.panel * lay.dtype_bits // 8
        return axes if axes and lay.rows % n == 0 and slice_bytes % 128 == 0 else ()

    def _tma_ok(self, c: Copy) -> bool:
        """A tile copy between global and shared memory TMA can do: same dtype, a swizzled 2-D tile
        whose panels are full boxes, a window over the global tensor's last two dims, 16-byte aligned
        strides, and start indices that do not read memory (the producer computes them on its own)."""
        g, t, starts = _global_side(c)
        if g.dtype != t.dtype or dtype_bits(g.dtype) % 8 or not in_swizzled_panels(t) or t.shape[0] > 256:
            return False
        if len(g.shape) > 5:  # a tensor map has at most 5 dims
            return False
        if self.lw._copy_extents(c) != list(t.shape):  # the whole tile, from the global's last two dims
            return False
        eb = dtype_bits(g.dtype) // 8
        stride = eb
        for d in reversed(g.shape[1:]):
            stride *= d
            if stride % 16:
                return False
        return all(_pure(s) for s in starts)

    def is_wgmma(self, g: Gemm) -> bool:
        lay = self.lw.infer.layouts.get(g.C)
        return isinstance(lay, MmaAccumLayout) and lay.wgmma

    # ------------------------------------------------------------------ host side: tensor maps

    def declare_tensormaps(self):
        """Encode one tensor map per (tensor, box) on the host; TVM passes each to the kernel as a
        ``const __grid_constant__ CUtensorMap`` parameter, which our launcher encodes at launch."""
        for c in self.ws.loads + self.ws.stores:
            self._tensormap(c, self._slices(c))

    def _tensormap(self, c: Copy, slices: int = 1) -> TensorMap:
        """The tensor map of a copy's global side with a box of one swizzle panel by the tile's rows (or
        by 1/``slices`` of them: a multicast load's share)."""
        g, t, _ = _global_side(c)
        lay = SharedLayout(t.shape[0], t.shape[1], dtype_bits(t.dtype))
        rank = len(g.shape)
        box = [lay.panel, lay.rows // slices] + [1] * (rank - 2)
        key = (g, tuple(box))
        if key in self.tensormaps:
            return self.tensormaps[key]
        eb = dtype_bits(g.dtype) // 8
        dims = list(reversed(g.shape))
        strides, s = [], eb
        for d in dims[:-1]:
            s *= d
            strides.append(s)
        name = f"{g.name}_tmap{len([k for k in self.tensormaps if k[0] is g]) or ''}"
        var = T.Var(name, ty=T.handle("tensormap").ty)
        T.Bind(T.tvm_stack_alloca("tensormap", 1), var=var)
        T.evaluate(T.tensormap_encode_tiled(
            var, self.lw.globals[g].data, *dims, *strides, *box, *([1] * rank), descriptor_dtype=g.dtype,
            rank=rank, swizzle=_SWIZZLE_ENUM[lay.swizzle_bytes], l2_promotion=l2_promotion(strides[0])))
        spec = dict(tensor=g.name, dtype=g.dtype, dims=dims, strides=strides, box=box, element_strides=[1] * rank,
                    swizzle=_SWIZZLE_ENUM[lay.swizzle_bytes], l2_promotion=l2_promotion(strides[0]), oob_fill=0)
        self.tensormaps[key] = TensorMap(var, spec)
        return self.tensormaps[key]

    # ------------------------------------------------------------------ device side: warp specialization

    @cached_property
    def ctas_per_sm(self) -> int:
        """Two co-resident CTAs per SM for a one-consumer-warpgroup pipeline whose shared memory fits
        twice: while one CTA stores its tile (or waits on TMA), the other's wgmmas keep the tensor
        cores busy, which is what ping-pong consumer warpgroups achieve inside one CTA."""
        if not self.ws or self.lw.threads != 128 or self._fragment_words() > CORESIDENT_FRAGMENT_WORDS:
            return 1
        if self.lw.cluster > 1 or self.lw.consumers > 1:  # clusters are scheduled whole; pingpong is the
            return 1  # two-consumer alternative
        if math.prod(self.lw.kernel.grid) <= SMS:  # every CTA has an SM of its own anyway
            return 1
        return 2 if 2 * (self.lw.memory_plan().total + 1024) <= SM_SHARED_BYTES else 1

    def _fragment_words(self) -> int:
        """32-bit registers per consumer thread that the program's fragments hold."""
        lw = self.lw
        return sum(-(-lw.infer.layouts[b].local_size * dtype_bits(b.dtype) // 32)
                   for b in lw.kernel.allocs if b.scope == "fragment")

    def resident_ctas(self) -> int:
        """CTAs that run at once on an H200: one per SM (or two); for clustered kernels an estimate (GPCs hold
        whole clusters; pairs fit the SM pairs), which the launcher replaces with the driver's count."""
        n = self.lw.cluster
        if n > 1:  # a multiple of n: the blocks of a cluster must walk the same tiles in lockstep
            return wave_ctas(n)
        return SMS * self.ctas_per_sm

    def one_tile_per_cta(self) -> bool:
        """Whether every CTA runs one tile, its main loop at the program's top level: not a persistent grid
        (``persistent=False``, or a grid within one wave), no pingpong, stream-K or row-softmax walk, no
        cluster exchange.  Decided without the memory plan, which depends on it (Lowerer.memory_plan)."""
        lw = self.lw
        if not self.ws or self.ws.outer or lw.consumers > 1 or self.stream_k or self.row_softmax is not None:
            return False
        one_wave = math.prod(lw.kernel.grid) <= wave_ctas(lw.cluster)
        return not lw.cluster_reduces and (not lw.kernel.persistent or one_wave)

    def consumer_registers(self) -> int | None:
        """setmaxnreg target of the consumer warps, or None when the launch-bound budget already suffices:
        what the producer warpgroup gives up, shared among the consumer warpgroups."""
        n_wg, per_sm = self.lw.threads * self.lw.consumers // 128, self.ctas_per_sm
        if n_wg == 1 and per_sm == 1:
            return None
        block = 128 * n_wg + PRODUCER_THREADS  # ptxas gives each thread the launch bound's share, in 8s: the CTA's
        pool = REGISTERS // (block * per_sm) // 8 * 8 * block  # pool (640 threads: 96 each, not 65536 / 640)
        return min(240, (pool - PRODUCER_REGISTERS * PRODUCER_THREADS) // (128 * n_wg) // 8 * 8)

    def warpgroup_index(self, tid, threads=None, name="warpgroup"):
        """tid // threads (the program's threads unless given) bound once from lane 0's value
        (``__shfl_sync``, all threads converged), so nvcc knows it is warp-uniform: the pipeline counts that
        start from it, and the wgmma descriptors computed from those, stay in uniform registers (what
        CUTLASS's canonical_warp_group_idx does)."""
        var = T.Var(name, "int32")
        T.Bind(_call("tile_ops_warp_uniform", tirx.floordiv(tid, threads or self.lw.threads), return_type="int32"),
               var=var)
        return var

    def _pipeline_barriers(self) -> int:
        return 2 * self.ws.stages if self.ws else 0

    def _exchange_barriers(self) -> int:
        return 2 * len(self.lw.cluster_reduces) * self.lw.consumers

    def barrier_bytes(self) -> int:
        """The pipeline's full/empty mbarriers, then two per T.cluster_allreduce (one per tile parity) and
        consumer warpgroup; with T.row_softmax_store, two "published" and two "factors ready" (by tile
        parity)."""
        rows = 4 if self.row_softmax is not None else 0
        return 8 * (self._pipeline_barriers() + self._exchange_barriers() + rows)

    def published(self, slot):
        """The consumers have stored the row statistics of their tile of this parity."""
        return self.bars.ptr_to([self._pipeline_barriers() + self._exchange_barriers() + slot])

    def factors_ready(self, slot):
        """The row-statistics warp has written the row factors of the tile of this parity."""
        return self.bars.ptr_to([self._pipeline_barriers() + self._exchange_barriers() + 2 + slot])

    def bind_barriers(self, arena, offset: int):
        if self.barrier_bytes():
            self.bars = T.decl_buffer((self.barrier_bytes() // 8,), "uint64", data=arena.data, scope="shared.dyn",
                                      elem_offset=offset // 8)
            IRBuilder.name("mbarriers", self.bars)

    def exchanged(self, i: int, parity, consumer=None):
        """The mbarrier on which T.cluster_allreduce ``i``'s values of tiles of ``parity`` complete (for
        ``consumer``, by default the running warpgroup's)."""
        consumer = self.lw.consumer if consumer is None else consumer
        exchange = consumer * len(self.lw.cluster_reduces) + i
        return self.bars.ptr_to([self._pipeline_barriers() + 2 * exchange + parity])

    def _axes(self, c: Copy) -> tuple:
        return next((axes for m, axes in self.ws.multicast if m is c), ())

    def _slices(self, c: Copy) -> int:
        return math.prod(self.lw.cluster_dims[a] for a in self._axes(c))

    def _cluster_position(self):
        """(rank, x, y) of this block in its cluster: rank = x + y * cx (y is 0 in a 1-D cluster)."""
        cx, cy = self.lw.cluster_dims
        rank = tirx.Cast("int32", _call("tile_ops_cluster_rank", return_type="uint32"))
        return (rank, rank, 0) if cy == 1 else (rank, tirx.floormod(rank, cx), tirx.floordiv(rank, cx))

    def _multicast_group(self, axes: tuple):
        """(this block's slice index, ctaMask) of a load multicast along ``axes``: its cluster row (axis 0),
        column (axis 1) or the whole cluster."""
        (cx, cy), n = self.lw.cluster_dims, self.lw.cluster
        rank, rx, ry = self._cluster_position()
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
        axes = {a for _, ax in self.ws.multicast for a in ax}
        if not axes:
            return []
        if any(ax == (0, 1) for _, ax in self.ws.multicast) or cy == 1:
            return list(range(n))
        _, rx, ry = self._cluster_position()
        if axes == {1}:  # the column
            return [rx + j * cx for j in range(cy)]
        row = [ry * cx + i for i in range(cx)]
        return row if axes == {0} else row + [rx + tirx.floormod(ry + j, cy) * cx for j in range(1, cy)]

    def _release_count(self) -> int:
        """Arrivals that free a stage: one per consumer warp of every block that writes into it (with
        multicast loads, the peers' producers write into this block's stages too)."""
        return self.lw.threads // 32 * max(1, len(self._stage_writers()))

    def init_barriers(self):
        """Thread 0 initializes the pipeline's and the cluster exchanges' mbarriers; then every thread of a
        cluster's blocks arrives on the cluster barrier (release: the initialized barriers are visible
        to the peers that arrive on them once they have waited on it).  The threads that touch a peer
        wait first: the consumers (``warp_specialized``), or every thread without warp specialization."""
        lw = self.lw
        if not self.barrier_bytes():
            return
        with T.If(lw.tid == 0):
            with T.Then():
                for s in range(self.ws.stages if self.ws else 0):
                    emit_ptx("mbarrier.init.shared::cta.b64", self.full(s), 1)
                    emit_ptx("mbarrier.init.shared::cta.b64", self.empty(s), self._release_count())  # see release
                for i in range(len(lw.cluster_reduces)):  # one local arrival (expect_tx); the peers' bytes
                    for consumer in range(lw.consumers):
                        for parity in (0, 1):
                            emit_ptx("mbarrier.init.shared::cta.b64", self.exchanged(i, parity, consumer), 1)
                if self.row_softmax is not None:
                    for slot in (0, 1):  # every consumer thread; every lane of the statistics warp
                        emit_ptx("mbarrier.init.shared::cta.b64", self.published(slot), lw.threads)
                        emit_ptx("mbarrier.init.shared::cta.b64", self.factors_ready(slot), 32)
                emit_ptx("fence.mbarrier_init.release.cluster")
        T.evaluate(TS.cuda.cta_sync())
        if lw.cluster > 1:
            emit_ptx("barrier.cluster.arrive.release.aligned")
            if not self.ws:
                emit_ptx("barrier.cluster.wait.acquire.aligned")

    def full(self, s):
        return self.bars.ptr_to([s])

    def empty(self, s):
        return self.bars.ptr_to([self.ws.stages + s])

    def persistent_grid(self, grid: list):
        """Launch one CTA per SM when there is more than one wave of tiles (always with pingpong, whose
        warpgroups take a CTA's tiles in turns, and with stream-K, whose CTAs walk units); each CTA then
        walks tiles cta, cta + gridDim.x, ...  The producer runs ahead into the next tile while the
        consumers store this one's results, which hides the epilogue and the pipeline fill.  The grid
        returned is the H200's; the launcher sizes it to the device it runs on (Kernel.grid_on)."""
        total = math.prod(grid)
        # always walk tiles (units); a row's tiles must all be resident (T.row_softmax_store)
        walks = self.lw.consumers > 1 or self.stream_k or self.row_softmax is not None
        if not self.ws or not self.lw.kernel.persistent or (total <= self.resident_ctas() and not walks):
            self.persistent = None
            return grid
        self.persistent = (total, grid)
        return [min(self.resident_ctas(), self.work_units()), 1, 1]

    def work_units(self) -> int:
        """The most units of work a persistent grid walks (tiles; with stream-K, tiles' K parts at most):
        the launcher launches no more CTAs than that."""
        return math.prod(self.persistent[1]) * (self.stream_k.most if self.stream_k else 1)

    @contextmanager
    def tiles(self, cta, consumer=None):
        """The CTA's tiles cta, cta + gridDim.x, ...; a pingpong ``consumer`` warpgroup takes every other
        one of them, starting with its ``consumer``-th (the producer, None, loads them all in order)."""
        lw = self.lw
        if self.persistent is None:
            yield
            return
        total, (gx, gy, _) = self.persistent
        ctas = _call("tile_ops_grid_x", return_type="int32")  # the launcher sizes the grid to the device
        if self.stream_k:
            yield from self._units(cta, ctas, total, gx, gy)
            return
        self.cta_tiles = tirx.truncdiv(total - cta + (ctas - 1), ctas)  # all terms >= 0
        if consumer is None:
            mine, every, first = self.cta_tiles, 1, 0
        else:
            every, first = lw.consumers, consumer
            mine = tirx.truncdiv(self.cta_tiles - first + (every - 1), every)
        with T.serial(0, mine) as it:
            IRBuilder.name("tile_iter", it)
            self.tile_ordinal = it * every + first if every > 1 else it  # among the CTA's tiles
            self._enter_tile(cta + self.tile_ordinal * ctas, gx, gy)
            yield

    def _enter_tile(self, t, gx, gy):
        """The program's block indices of tile t (in grid order, then rasterized)."""
        lw = self.lw
        (cx, cy), n = lw.cluster_dims, lw.cluster
        # cluster c = t // n of the grid of clusters, rank r = t % n at (r % cx, r // cx) in it
        c, r, ccx, ccy = tirx.floordiv(t, n), tirx.floormod(t, n), gx // cx, gy // cy
        ids = [tirx.floormod(c, ccx) * cx + tirx.floormod(r, cx),
               tirx.floormod(tirx.floordiv(c, ccx), ccy) * cy + tirx.floordiv(r, cx), tirx.floordiv(c, ccx * ccy)]
        lw.block_vars = dict(zip(lw.kernel.block_vars, lw._rasterize(ids[: len(lw.kernel.grid)])))

    def _units(self, cta, ctas, total, gx, gy):
        """The stream-K walk (stream_k.py): group (cluster) g of the grid's takes units g, g + groups, ...;
        a unit's tile of every block of the cluster is the tile of rank r in its cluster's tile."""
        n = self.lw.cluster
        groups, g, rank = tirx.floordiv(ctas, n), tirx.floordiv(cta, n), tirx.floormod(cta, n)
        regs = Registers()
        p = plan(g, total // n, groups, self.steps_per_tile, self.stream_k.most, regs)
        with T.serial(0, tirx.floordiv(p["units"] - g + groups - 1, groups)) as it:
            IRBuilder.name("unit_iter", it)
            self.tile_ordinal = it
            self.unit = {**unit(g, it, groups, self.steps_per_tile, p, regs), "rank": rank}
            self._enter_tile(self.unit["tile"] * n + rank, gx, gy)
            yield
        self.unit = None

    def stream_k_fixup(self, rest):
        """After the main loop of a stream-K unit: the partials' exchange; the rest of the tile body is
        lowered inside ``rest`` (an ExitStack) under the condition that this unit is not a writer."""
        lw = self.lw
        cond = self.stream_k.fixup(self.unit, lw.workspace, lambda: emit_ptx("bar.sync", CONSUMER_BARRIER, lw.threads))
        rest.enter_context(T.If(cond))
        rest.enter_context(T.Then())

    def warp_specialized(self, body, cta):
        lw, ws = self.lw, self.ws
        consumers = lw.threads * lw.consumers
        self.init_barriers()
        regs = self.consumer_registers()
        with T.If(lw.tid >= consumers):
            with T.Then():
                if regs:
                    emit_ptx("setmaxnreg.dec.sync.aligned.u32", PRODUCER_REGISTERS)
                with T.If(lw.tid == consumers):
                    with T.Then():
                        for tm in self.tensormaps.values():  # descriptor fetch off the first load's path
                            emit_ptx("prefetch.tensormap", T.address_of(tm.var))
                        if ws.multicast:  # peers' shared memory exists and their barriers are initialized
                            emit_ptx("barrier.cluster.wait.acquire")
                        cnt = self.step_counter()
                        with self.tiles(cta):
                            self.producer_nest(self.ws.outer, {}, cnt)
                        if ws.multicast:
                            self.producer_tail(cnt)
                if self.row_softmax is not None:  # the producer warpgroup's second warp
                    with T.If(tirx.floordiv(lw.tid, 32) == consumers // 32 + 1):
                        with T.Then():
                            self.row_statistics_warp(cta)
            with T.Else():
                if regs:
                    emit_ptx("setmaxnreg.inc.sync.aligned.u32", regs)
                if lw.cluster > 1:  # every block of the cluster has started (its shared memory exists)
                    emit_ptx("barrier.cluster.wait.acquire.aligned")
                self.consumer_steps = self.step_counter()
                self.count_exchanges()
                # a tile's first shared access is unguarded by its barriers, so the previous tile's readers
                # need one at the end of the tile: unless that access is a main loop that only issues
                # wgmmas on its stages, which the mbarriers guard
                first = next((n for n in body if lw._touches_shared(n)), None)
                guard_tile_start = first is not None and not (first is ws.loop and ws.deferred_wait)
                if lw.consumers > 1:  # the program sees its own warpgroup's thread index
                    lw.tid = tirx.floormod(lw.tid, lw.threads)
                    T.buffer_store(self.consumer_steps, lw.consumer * self.steps_per_tile, [0])
                if lw.threads > 128:  # A's wgmma descriptors then stay in uniform registers (NOTES v19)
                    self.wgmma_warpgroup = self.warpgroup_index(lw.tid, 128, "wgmma_warpgroup")
                if self.row_softmax is not None:
                    self.pending = T.alloc_local([3], "int32")  # a staged tile to store, and its block (x, y)
                    IRBuilder.name("pending_tile", self.pending)
                    T.buffer_store(self.pending, 0, [0])
                with self.tiles(cta, lw.consumer if lw.consumers > 1 else None):
                    lw.body(body)
                    if self.persistent and guard_tile_start:
                        lw.sync()
                    if lw.consumers > 1:  # the other warpgroup's tile takes the next steps
                        cnt = self.consumer_steps
                        T.buffer_store(cnt, cnt[0] + (lw.consumers - 1) * self.steps_per_tile, [0])
                if self.row_softmax is not None:  # the block's last tile
                    self.store_pending(self.cta_tiles - 1)
                if ws.stores:  # the block's shared memory must outlive TMA's reads of the last tile
                    self.wait_stores_read()

    def step_counter(self):
        """Pipeline steps taken so far (across the outer loops): stage = step % S, phase = step / S % 2."""
        cnt = T.alloc_local([1], "int32")
        IRBuilder.name("pipeline_step", cnt)
        T.buffer_store(cnt, 0, [0])
        return cnt

    def producer_nest(self, outer, vm, cnt):
        lw, ws = self.lw, self.ws
        if outer:
            with T.serial(0, lw.expr(outer[0].extent, vm)) as v:
                IRBuilder.name(outer[0].var.name, v)
                self.producer_nest(outer[1:], {**vm, outer[0].var: v}, cnt)
            return
        node = ws.loop
        stage_bytes = sum(_tile_bytes(c.dst.buffer) for c in ws.loads)
        steps, k0 = (self.unit["k_steps"], self.unit["k_begin"]) if self.unit else (lw.expr(node.extent, vm), 0)
        with T.serial(0, steps) as k:
            IRBuilder.name(node.var.name, k)
            s = self._wait_free_stage(cnt)
            emit_ptx("mbarrier.arrive.expect_tx.shared::cta.b64", self.full(s), stage_bytes)
            for c in ws.loads:
                self.tma_load(c, {**vm, node.var: k0 + k}, s)
            T.buffer_store(cnt, cnt[0] + 1, [0])

    def producer_tail(self, cnt):
        """Before the producer exits, wait until every stage is released once more: the peers' consumers
        arrive on this block's empty barriers, so the block must outlive their last arrivals."""
        for _ in range(self.ws.stages):
            self._wait_free_stage(cnt)
            T.buffer_store(cnt, cnt[0] + 1, [0])

    def _wait_free_stage(self, cnt):
        """Wait until the stage of step cnt[0] is released (a fresh barrier passes parity 1); the stage
        (an expression of cnt[0]: count the step only after its last use)."""
        S = self.ws.stages
        s = tirx.floormod(cnt[0], S)
        T.evaluate(TS.cuda.mbarrier_wait(self.empty(s), 1 - tirx.floormod(tirx.floordiv(cnt[0], S), 2)))
        return s

    def tma_load(self, c: Copy, vm, stage):
        """One box per swizzle panel; a multicast load's box is this block's 1/n of the rows, written
        into the same place of every block of the cluster (each block's full barrier counts them)."""
        lw = self.lw
        t = lw.shared[c.dst.buffer]
        n = self._slices(c)
        tm = self._tensormap(c, n)
        starts = [lw.expr(x, vm) for x in c.src.starts]
        coords = list(reversed(starts))
        rank = len(coords)
        kind = f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes"
        hint, policy = l2_cache_hint(c.eviction)
        if n > 1:
            me, mask = self._multicast_group(self._axes(c))
            rows = t.layout.rows // n
        for p in range(t.layout.cols // t.layout.panel):
            dst = lw.stage_base(t, stage) + p * t.layout.panel_elems
            cs = [coords[0] + p * t.layout.panel] + coords[1:]
            if n == 1:
                emit_ptx(kind + hint, t.view.ptr_to([dst]), T.address_of(tm.var), *[_i32(x) for x in cs],
                         self.full(stage), *policy)
                continue
            cs[1] = cs[1] + me * rows
            emit_ptx(kind + ".multicast::cluster" + hint, t.view.ptr_to([dst + me * rows * t.layout.panel]),
                     T.address_of(tm.var), *[_i32(x) for x in cs], self.full(stage), mask, *policy)

    def tma_store(self, c: Copy, vm):
        """The epilogue's shared->global tile copy through TMA.  The body's barrier before it already
        fenced the consumers' shared writes for the async proxy; one thread issues a box per panel and
        goes on: it waits until TMA has read the tile only at the next consumer barrier
        (``wait_stores_read``), so the next tile's main loop runs while TMA reads this one."""
        lw = self.lw
        t = lw.shared[c.src.buffer]
        tm = self._tensormap(c)
        coords = list(reversed([lw.expr(x, vm) for x in c.dst.starts]))
        with T.If(lw.tid == 0):
            with T.Then():
                for p in range(t.layout.cols // t.layout.panel):
                    src = t.view.ptr_to([lw.stage_base(t, lw.stage(c.src.buffer)) + p * t.layout.panel_elems])
                    cs = [coords[0] + p * t.layout.panel] + coords[1:]
                    emit_ptx(f"cp.async.bulk.tensor.{len(cs)}d.global.shared::cta.bulk_group",
                             T.address_of(tm.var), *[_i32(x) for x in cs], src)
                emit_ptx("cp.async.bulk.commit_group")

    def wait_stores_read(self):
        """Before a consumer barrier: the TMA stores' issuer waits until they have read their staged
        tiles, so whatever follows the barrier may rewrite them (a no-op with none in flight)."""
        with T.If(self.lw.tid == 0):
            with T.Then():
                emit_ptx("cp.async.bulk.wait_group.read", 0)

    def wait_stores_written(self):
        """Before the consumers read global memory that this block's TMA stores wrote: the issuer waits
        until the stores are complete (not only read from shared memory), a consumer barrier, and each
        reader orders the async proxy's writes before its own reads."""
        with T.If(self.lw.tid == 0):
            with T.Then():
                emit_ptx("cp.async.bulk.wait_group", 0)
        self.lw.sync()
        emit_ptx("fence.proxy.async.global")
        self.lw.tma_written = frozenset()

    def consumer_loop(self, node: For, vm, n):
        """The main loop; pingpong warpgroups take it in turns, tile by tile: a warpgroup waits on the
        stages' parities only once the other has waited on every earlier step (the barriers are then at
        most one phase behind the step it waits for), and its main loop runs while the other's epilogue
        does."""
        if self.unit:  # a stream-K unit's K range
            return self._consumer_steps(node, vm, self.unit["k_steps"], self.unit["k_begin"])
        if self.lw.consumers == 1:
            return self._consumer_steps(node, vm, n)
        assert self.lw.consumers == 2 and self.persistent, "pingpong: two warpgroups over a persistent tile loop"
        me = tirx.Cast("uint32", self.lw.consumer)
        both = self.lw.threads * self.lw.consumers
        with T.If(self.tile_ordinal > 0):
            with T.Then():
                emit_ptx("bar.sync", MAINLOOP_ORDER + me, both)
        self._consumer_steps(node, vm, n)
        with T.If(self.tile_ordinal + 1 < self.cta_tiles):  # the CTA's next tile is the other's
            with T.Then():
                emit_ptx("bar.arrive", MAINLOOP_ORDER + (1 - me), both)

    def _consumer_steps(self, node: For, vm, n, k0=0):
        """Wait for stage k, compute on it, release it.  With ``deferred_wait`` the gemms of step k stay
        in flight while step k + 1 waits for its data; step k - 1's stage is released once its
        wgmma group retires."""
        lw, ws = self.lw, self.ws
        S, cnt = ws.stages, self.consumer_steps
        compute = [s for s in node.body if s not in ws.loads]
        if ws.deferred_wait:  # the loop writes no register A operand: its wgmma.fences cover the writes before it
            self.fence_operands(compute, accumulators=False)
        self.bind_peer_empty()
        # not unrolled: after a twice-unrolled loop ptxas (CUDA 13.0) moved the epilogue's reads of the
        # accumulators above the final wgmma.wait_group, losing the last k-step (NOTES v28)
        with T.serial(0, n, unroll=1) as k:
            IRBuilder.name(node.var.name, k)
            s = tirx.floormod(cnt[0], S)
            T.evaluate(TS.cuda.mbarrier_wait(self.full(s), tirx.floormod(tirx.floordiv(cnt[0], S), 2)))
            lw.stage_of_iter = s
            if ws.deferred_wait:
                emit_ptx("wgmma.fence.sync.aligned")
                for g in compute:
                    self.issue_wgmma(g)
                emit_ptx("wgmma.commit_group.sync.aligned")
                emit_ptx("wgmma.wait_group.sync.aligned", 1)
                with T.If(k > 0):  # step k - 1's group retired: its stage can be refilled
                    with T.Then():
                        self.release(tirx.floormod(cnt[0] + (S - 1), S))
            else:
                lw.body(compute, {**vm, node.var: k0 + k})
                T.evaluate(TS.cuda.warp_sync())  # every lane of the warp is done reading the stage
                self.release(s)
            lw.stage_of_iter = None
            T.buffer_store(cnt, cnt[0] + 1, [0])
        if ws.deferred_wait:
            emit_ptx("wgmma.wait_group.sync.aligned", 0)
            self.fence_operands(compute)
            with T.If(n > 0):  # release the last step's stage (an enclosing loop refills it)
                with T.Then():
                    self.release(tirx.floormod(cnt[0] + (S - 1), S))

    def bind_peer_empty(self):
        """With multicast loads, lane i of each consumer warp maps empty[0] into the i-th writer of this
        block's stages (``mapa``) once, before the main loop: a release is then one arrive, predicated on
        the first lanes, that reaches every writer at once (as CUTLASS spreads a warpgroup's arrivals over
        its threads), instead of one arrive per writer in turn from lane 0 with the peer's address
        recomputed each step: at 5 writers (2x4 clusters) that loop held the swapped gemm at 0.90 of cuBLAS,
        against 1.12 with one arrive (H100, NOTES v27)."""
        self.peer_empty = None  # a binding of an earlier loop's scope is not this one's
        writers = self._stage_writers() if self.ws.multicast else []
        if not writers:
            return
        lane, peer = tirx.floormod(self.lw.tid, 32), tirx.const(0, "int32")
        for i, w in reversed(list(enumerate(writers))):
            peer = tirx.Select(lane == i, tirx.const(w, "int32") if isinstance(w, int) else w, peer)
        var = T.Var("peer_empty", "uint32")
        T.Bind(_call("tile_ops_peer_address", self.empty(0), tirx.Cast("uint32", peer), return_type="uint32"),
               var=var)
        self.peer_empty = (var, len(writers))

    def release(self, s):
        """One arrive on empty[s] per consumer warp (and writer) once the warp is done with stage s (after a
        warp-wide wgmma wait or __syncwarp): 1/32 of the shared-memory atomics of a per-thread arrive."""
        lane = tirx.floormod(self.lw.tid, 32)
        if self.ws.multicast:  # every writer's copy of stage s, lane i arriving on writer i's (bind_peer_empty)
            bar, writers = self.peer_empty
            T.evaluate(_call("tile_ops_cluster_arrive_if", bar + tirx.Cast("uint32", s * 8),
                             tirx.Cast("int32", lane < writers)))
            return
        with T.If(lane == 0):
            with T.Then():
                emit_ptx("mbarrier.arrive.shared::cta.b64", self.empty(s))

    # ------------------------------------------------------------------ thread-block clusters

    def cluster_allreduce(self, node):
        """One owner thread per element sends its value(s) into slot ``rank`` of every block's exchange
        buffer with ``st.async`` (to the ``mapa`` address of the same offset in the peer), which counts
        the bytes on that block's exchange mbarrier (complete_tx): no fence, no remote arrive.  One
        consumer thread arrives on its own barrier expecting the bytes of all n blocks; every consumer
        waits on it and reduces the slots of its elements.  Only the consumers take part, so a
        persistent producer runs ahead freely.  Buffer and barrier alternate with the tile's parity: a
        peer can be at most one exchange ahead (it needs this block's values of the next tile, sent
        after a consumer barrier that follows this block's reads of this one's), so it never
        overwrites unread values or completes bytes onto a phase this block has not waited on.
        The parity is of the uses of this exchange this warpgroup has made (``exchanges[i]``: a stream-K
        writer's tile makes none), the same count in every block of the cluster, which walk the same tiles.
        One exchange per tile: the frontend refuses an exchange inside a loop."""
        lw = self.lw
        n, vals = lw.cluster, len(node.buffers)
        lay = lw.infer.layouts[node.buffers[0]]
        if any(lw.infer.layouts[b] != lay for b in node.buffers[1:]):
            raise error(node.loc, "T.cluster_softmax_merge: row_max and row_sum must have the same layout "
                                  "(reduce both from the same tile)")
        i = next(j for j, c in enumerate(lw.cluster_reduces) if c is node)
        count = self.exchanges[i]
        parity = tirx.floormod(count, 2)
        frags, ex, bar = [lw.frags[b] for b in node.buffers], lw.exchange[id(node)], self.exchanged(i, parity)
        elems = math.prod(node.buffers[0].shape)
        base = parity * (n * elems * vals)  # slots [parity][rank][element][value]
        flat = [_flat_index(lay.coords(lw.tid, r), node.buffers[0].shape) for r in range(lay.local_size)]
        rank = self._cluster_position()[0]
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
                        T.evaluate(_call("tile_ops_cluster_put", slot, bar, tirx.const(peer, "uint32"), *values))
        phase = tirx.Cast("uint32", tirx.floormod(tirx.floordiv(count, 2), 2))
        T.evaluate(_call("tile_ops_cluster_wait", bar, phase))
        for r in range(lay.local_size):
            mine = [[ex[base + (peer * elems + flat[r]) * vals + v] for v in range(vals)] for peer in range(n)]
            if node.kind == "softmax":
                top = reduce(tirx.max, [m for m, _ in mine])
                ninf = tirx.const(float("-inf"), "float32")  # a block without values adds nothing (not NaN)
                terms = [tirx.Select(m == ninf, tirx.const(0.0, "float32"), l * exp2_approx(m - top)) for m, l in mine]
                total = reduce(lambda a, b: a + b, terms)
                T.buffer_store(frags[0], top, [r])
                T.buffer_store(frags[1], total, [r])
            else:
                op = tirx.max if node.kind == "max" else (lambda a, b: a + b)
                T.buffer_store(frags[0], reduce(op, [v for v, in mine]), [r])
        T.buffer_store(self.exchanges, count + 1, [i])  # after the last use of `count` (a lazy load)

    def count_exchanges(self):
        """The consumer's count of the uses of each T.cluster_allreduce (its buffers' and barriers' parity
        and phase), from 0."""
        uses = max(1, len(self.lw.cluster_reduces))
        self.exchanges = T.alloc_local([uses], "int32")
        IRBuilder.name("exchanges", self.exchanges)
        for i in range(uses):
            T.buffer_store(self.exchanges, 0, [i])

    # ------------------------------------------------------------------ T.row_softmax_store

    def _check_row_softmax(self):
        node, k = self.row_softmax, self.lw.kernel
        if not self.ws:
            raise error(node.loc, "T.row_softmax_store needs the warp-specialized sm_90a path: one T.Pipelined "
                                  "main loop of TMA loads and wgmma gemms")
        if node.store not in self.ws.stores:
            raise error(node.loc, "T.row_softmax_store: its destination must be a tile of a global tensor that "
                                  "TMA can store (16-byte aligned rows)")
        lay = self.lw.infer.layouts[node.row_max]
        if self.lw.infer.layouts[node.row_sum] != lay or not hasattr(lay, "owner"):
            raise error(node.loc, "T.row_softmax_store: row_max and row_sum must be row reductions of the tile")
        if 2 * k.grid[1] > FLAG_SLOTS:
            raise error(node.loc, f"T.row_softmax_store: {k.grid[1]} row blocks; at most {FLAG_SLOTS // 2}")
        if self.ws.outer:  # the previous tile is stored after the one main loop of a tile
            raise error(node.loc, "T.row_softmax_store needs the T.Pipelined loop at the kernel's top level")

    def row_stats_floats(self) -> int:
        """The row statistics in the workspace (after its flags): (max, sum) of every row of every tile."""
        if self.row_softmax is None:
            return 0
        gx, gy = self.lw.kernel.grid[:2]
        return gx * gy * self.row_softmax.tile.shape[0] * 2

    def _stats_index(self, bx, by, row):
        gx, bM = self.lw.kernel.grid[0], self.row_softmax.tile.shape[0]
        return FLAG_SLOTS + ((by * gx + bx) * bM + row) * 2

    def store_pending(self, ordinal):
        """Store the block's staged tile, its tile ``ordinal``, if there is one: right after the next
        tile's main loop (its factors were computed during that loop, and TMA reads it while the
        consumers compute the new tile's softmax), and after the block's last tile."""
        with T.If(self.pending[0] == 1):
            with T.Then():
                self._store_pending(self.row_softmax, ordinal)

    def row_softmax_store(self, node, vm):
        """Tile t of the block: publish its rows' (max, sum) to the workspace (the statistics warp signals
        them, off the consumers' path) and stage the tile in place of the previous one, which
        ``store_pending`` stored after the main loop."""
        lw = self.lw
        bx, by = (lw.expr(v) for v in lw.kernel.block_vars[:2])
        lay, m, l = lw.infer.layouts[node.row_max], lw.frags[node.row_max], lw.frags[node.row_sum]
        owner = lay.owner(lw.tid)
        with T.If(owner if owner is not None else tirx.const(True, "bool")):
            with T.Then():
                for r in range(lay.local_size):
                    at = self._stats_index(bx, by, lay.coords(lw.tid, r)[0])
                    T.buffer_store(lw.workspace, m[r], [at])
                    T.buffer_store(lw.workspace, l[r], [at + 1])
        emit_ptx("mbarrier.arrive.shared::cta.b64", self.published(tirx.floormod(self.tile_ordinal, 2)))
        lw.sync()  # TMA has read the staged tile (wait_stores_read): it can be rewritten
        lw.copy(node.stage, vm)
        for i, v in enumerate((1, bx, by)):
            T.buffer_store(self.pending, v, [i])

    def _store_pending(self, node, ordinal):
        """The staged tile of the block's tile ``ordinal`` times its row factors, stored by TMA."""
        lw = self.lw
        slot = tirx.floormod(ordinal, 2)
        # the tile was staged in the accumulator's thread mapping, before a main loop that has no consumer
        # barrier; the rescale reads it row-major (compute-sanitizer racecheck found this one missing)
        lw.sync()
        T.evaluate(TS.cuda.mbarrier_wait(self.factors_ready(slot), tirx.floormod(tirx.floordiv(ordinal, 2), 2)))
        lw.parallel(node.rescale, {node.slot: slot})
        lw.sync()  # the rescaled tile, complete and fenced for TMA
        bx, by = lw.kernel.block_vars[:2]
        lw.copy(node.store, {bx: self.pending[1], by: self.pending[2]})
        T.buffer_store(self.pending, 0, [0])

    def row_statistics_warp(self, cta):
        """Per tile of the block, once its consumers have published the tile's row statistics: make them
        visible at GPU scope and count them on the row block's flag; wait until every tile of the row
        block has; compute each row's factor 2^(own max - max) / sum into the staged tile's slot; count
        this reader, the last of the row block's resetting the flag for the next launch."""
        lw, node = self.lw, self.row_softmax
        gx, gy = lw.kernel.grid[:2]
        bM = node.tile.shape[0]
        lane = tirx.floormod(lw.tid, 32)
        flags = T.address_of(lw.workspace[0])
        with self.tiles(cta):
            bx, by = (lw.expr(v) for v in lw.kernel.block_vars[:2])
            o = self.tile_ordinal
            slot = tirx.floormod(o, 2)
            T.evaluate(TS.cuda.mbarrier_wait(self.published(slot), tirx.floormod(tirx.floordiv(o, 2), 2)))
            with T.If(lane == 0):
                with T.Then():
                    T.evaluate(flag_signal(flags, by))
            T.evaluate(flag_wait(flags, by, gx, reset=False))  # every lane: the row block's last reader resets
            for q in range(bM // 32):  # (wgmma tiles: bM is a multiple of 64)
                row = lane + 32 * q
                factor = _call("tile_ops_row_factor", flags, self._stats_index(0, by, row), bM * 2, gx, bx,
                               return_type="float32")
                lw.store(node.factors, [slot, row], factor)
            # every lane releases its own factors (racecheck does not follow a warp sync into one arrive)
            emit_ptx("mbarrier.arrive.shared::cta.b64", self.factors_ready(slot))
            T.evaluate(TS.cuda.warp_sync())  # every lane is past its spin on the flag before it may be reset
            with T.If(lane == 0):
                with T.Then():
                    T.evaluate(_call("tile_ops_row_stats_read", flags, by, gy + by, gx))

    # ------------------------------------------------------------------ wgmma

    def gemm(self, g: Gemm):
        """A synchronous wgmma gemm (outside a deferred warp-specialized loop)."""
        lw = self.lw
        if g.clear_accum:
            with T.unroll(0, lw.infer.layouts[g.C].local_size) as r:
                T.buffer_store(lw.frags[g.C], tirx.const(0.0, "float32"), [r])
        self.fence_operands([g], accumulators=False)
        emit_ptx("wgmma.fence.sync.aligned")
        self.issue_wgmma(g)
        emit_ptx("wgmma.commit_group.sync.aligned")
        emit_ptx("wgmma.wait_group.sync.aligned", 0)
        self.fence_operands([g])

    def fence_operands(self, gemms, accumulators=True):
        """Keep nvcc from moving register accesses across a wgmma fence or wait (the asm only names
        the registers): wgmma reads a register A operand asynchronously until its group retires, so
        its writes must stay above the fence and its next writes below the wait, as must the
        accumulator reads."""
        lw = self.lw
        for g in gemms:
            regs = []
            if accumulators:
                regs += [lw.frags[g.C][r] for r in range(lw.infer.layouts[g.C].local_size)]
            if g.A.scope == "fragment":
                words = lw.frags[g.A].view("uint32")
                regs += [words[w] for w in range(lw.infer.layouts[g.A].local_size // 2)]
            for x in regs:
                T.evaluate(TS.cuda.func_call("tile_ops_fence_register", x, source_code=_FENCE_REGISTER))

    def issue_wgmma(self, g: Gemm):
        """One m64nNk16 wgmma per 64-row slice of this warpgroup and 16-wide k step.  A comes from shared
        memory through a descriptor, or from registers (the "rs" form: four 32-bit words per thread, and
        no transpose-A operand)."""
        lw = self.lw
        lay: MmaAccumLayout = lw.infer.layouts[g.C]
        K = g.A.shape[0] if g.transpose_A else g.A.shape[1]
        wg = self.wgmma_warpgroup if self.wgmma_warpgroup is not None else tirx.floordiv(lw.tid, 128)
        wr, wc = lay.warp_rc(wg * 128)  # this warpgroup's first warp
        N, n0 = lay.w.WN, wc * lay.w.WN  # the warpgroup's columns
        el = {"float16": "f16", "bfloat16": "bf16"}[g.A.dtype]
        acc, tb = lw.frags[g.C], lw.shared[g.B]
        a_words = lw.frags[g.A].view("uint32") if g.A.scope == "fragment" else None
        for kk in range(K // 16):
            for mi in range(lay.mi):
                if a_words is not None:  # A's layout is C's with K columns: its slice mi has the same rows
                    a = [a_words[w] for w in lw.infer.layouts[g.A].a_operand_words(mi, kk)]
                    trans_a = []
                else:
                    a = [self.descriptor(lw.shared[g.A], g.A, lay.row0(wr, mi), kk * 16, mn_major=g.transpose_A)]
                    trans_a = [int(g.transpose_A)]
                b_desc = self.descriptor(tb, g.B, n0, kk * 16, mn_major=not g.transpose_B)
                d = [acc[mi * lay.ni * 4 + r] for r in range(lay.ni * 4)]
                scale_d = tirx.const(True, "bool") if not g.clear_accum or kk else tirx.const(False, "bool")
                emit_ptx(f"wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{el}.{el}", *d, *a, b_desc, scale_d,
                         1, 1, *trans_a, int(not g.transpose_B))

    def descriptor(self, t, buf, mn0, k0, mn_major: bool):
        """The 64-bit wgmma matrix descriptor of a shared tile at (mn0, k0) of the stage being read.

        K-major tiles (rows = M/N, cols = K): 8-row groups ``8 * row bytes`` apart (SBO).
        MN-major tiles (rows = K, cols = M/N): 8-k groups ``8 * row bytes`` apart (SBO), panels of
        the M/N dim ``panel bytes`` apart (LBO)."""
        lay: SharedLayout = t.layout
        eb = dtype_bits(buf.dtype) // 8
        row_bytes = lay.panel * eb
        i, j = (k0, mn0) if mn_major else (mn0, k0)
        elem = j // lay.panel * lay.panel_elems + i * lay.panel + j % lay.panel  # unswizzled: the panel origin
        elem = self.lw.stage_base(t, self.lw.stage(buf)) + elem
        addr = tirx.Cast("uint64", TS.cuda.cvta_generic_to_shared(t.view.ptr_to([elem])))
        lbo = lay.panel_elems * eb if mn_major else 16
        const = ((lbo >> 4) << 16) | (((8 * row_bytes) >> 4) << 32) | (_DESC_MODE[lay.swizzle_bytes] << 62)
        return tirx.bitwise_or(tirx.shift_right(tirx.bitwise_and(addr, tirx.const(0x3FFFF, "uint64")),
                                                tirx.const(4, "uint64")), tirx.const(const, "uint64"))


_FENCE_REGISTER = """
__forceinline__ __device__ void tile_ops_fence_register(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__forceinline__ __device__ void tile_ops_fence_register(unsigned& r) { asm volatile("" : "+r"(r) :: "memory"); }
"""


# the address of a shared-memory location in a peer block of the cluster (the same offset there): its own
# helper (a stage release's barrier) and part of st.async's, guarded so that a kernel using both defines it once
_PEER_ADDRESS = """
#ifndef TILE_OPS_PEER_ADDRESS
#define TILE_OPS_PEER_ADDRESS
__forceinline__ __device__ unsigned tile_ops_peer_address(const void* p, unsigned peer) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(peer));
  return r;
}
#endif
"""


_HELPERS = {  # CUDA functions for what TIRx has no intrinsic for
    "tile_ops_grid_x": """
__forceinline__ __device__ int tile_ops_grid_x() { return gridDim.x; }
""",
    "tile_ops_warp_uniform": """
__forceinline__ __device__ int tile_ops_warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
""",
    "tile_ops_exp2": """
__forceinline__ __device__ float tile_ops_exp2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
""",
    "tile_ops_cluster_rank": """
__forceinline__ __device__ unsigned tile_ops_cluster_rank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
""",
    # st.async: a store (one value or a pair) into a peer's shared memory, at the mapa address of the same
    # offset there, that completes its bytes on the peer's mbarrier
    "tile_ops_cluster_put": _PEER_ADDRESS + """
__forceinline__ __device__ void tile_ops_cluster_put(float* p, uint64_t* bar, unsigned peer, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(tile_ops_peer_address(p, peer)), "f"(v), "r"(tile_ops_peer_address(bar, peer)) : "memory");
}
__forceinline__ __device__ void tile_ops_cluster_put(float* p, uint64_t* bar, unsigned peer, float v0, float v1) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               :: "r"(tile_ops_peer_address(p, peer)), "f"(v0), "f"(v1), "r"(tile_ops_peer_address(bar, peer))
               : "memory");
}
""",
    # one row's factor 2^(m_own - max) / sum over the n tiles' (max, sum) pairs, `stride` floats apart, in
    # one pass (online max and sum); a tile without values (-inf) adds nothing
    "tile_ops_row_factor": """
__forceinline__ __device__ float tile_ops_row_factor(float* ws, int at, int stride, int n, int own) {
  float top = -INFINITY, own_max = -INFINITY, sum = 0.0f;
  #pragma unroll 8
  for (int j = 0; j < n; ++j) {  // L2 loads (.cg: no stale L1 line), after the flag's acquire
    float2 s = __ldcg(reinterpret_cast<const float2*>(ws + at + j * stride));
    float next = fmaxf(top, s.x);
    sum = (next == -INFINITY ? 0.0f : sum * exp2f(top - next)) + (s.x == -INFINITY ? 0.0f : s.y * exp2f(s.x - next));
    top = next;
    own_max = j == own ? s.x : own_max;
  }
  return own_max == -INFINITY ? 0.0f : exp2f(own_max - top) / sum;
}
""",
    # this reader is done with the row block's statistics; the last of its `count` readers resets the
    # flag and the count for the next launch (kernel boundaries order those stores before its reads)
    "tile_ops_row_stats_read": """
__forceinline__ __device__ void tile_ops_row_stats_read(float* flags, int flag, int done, int count) {
  int* f = reinterpret_cast<int*>(flags);
  int before;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(f + done) : "memory");
  if (before == count - 1) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" :: "l"(f + flag) : "memory");
    asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" :: "l"(f + done) : "memory");
  }
}
""",
    "tile_ops_peer_address": _PEER_ADDRESS,
    # an arrive on a (peer's) barrier where pred holds, predicated, not branched around: a stage's release
    # orders only this warp's reads of it (done: the wgmma wait), so the arrive is relaxed to CTA scope (a
    # cluster-scope release costs a fence each)
    "tile_ops_cluster_arrive_if": """
__forceinline__ __device__ void tile_ops_cluster_arrive_if(unsigned bar, int pred) {
  asm volatile("{\\n .reg .pred p;\\n setp.ne.b32 p, %1, 0;\\n @p mbarrier.arrive.shared::cluster.b64 _, [%0];\\n}"
               :: "r"(bar), "r"(pred) : "memory");
}
""",
    "tile_ops_cluster_wait": """
__forceinline__ __device__ void tile_ops_cluster_wait(uint64_t* bar, unsigned parity) {
  unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile("{\\n .reg .pred done;\\n TILE_OPS_CLUSTER_WAIT_%=:\\n"
               " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\\n"
               " @!done bra TILE_OPS_CLUSTER_WAIT_%=;\\n}" :: "r"(a), "r"(parity) : "memory");
}
""",
}


def _call(name, *args, return_type="void"):
    return TS.cuda.func_call(name, *args, source_code=_HELPERS[name], return_type=return_type)


def exp2_approx(x):
    """2^x in float32 as one MUFU.EX2 (ex2.approx.ftz: 2 ulp, results under 2^-126 flushed to 0); exp2f
    keeps subnormal results with a compare and two multiplies around it, 3 of a softmax's ~9
    instructions per score."""
    return _call("tile_ops_exp2", x, return_type="float32")


def _flat_index(idx, shape):
    flat = idx[0]
    for i, d in zip(idx[1:], shape[1:]):
        flat = flat * d + i
    return flat


def _contains(node, target) -> bool:
    return node is target or isinstance(node, For) and any(_contains(n, target) for n in node.body)


def _global_side(c: Copy):
    """(global buffer, shared tile, global start indices) of a copy between the two."""
    if c.src.buffer.scope == "global":
        return c.src.buffer, c.dst.buffer, c.src.starts
    return c.dst.buffer, c.src.buffer, c.dst.starts


def _pipelined_loops(body, outer):
    """(loop, enclosing loops) for every T.Pipelined loop."""
    for n in body:
        if isinstance(n, For):
            if n.kind == "pipelined":
                yield n, list(outer)
            yield from _pipelined_loops(n.body, outer + [n])


def _pure(e) -> bool:
    """An index expression that reads no buffer, so the producer can evaluate it on its own."""
    return isinstance(e, (int, float)) or not collect_loads(e)


def _tile_bytes(buf) -> int:
    n = dtype_bits(buf.dtype) // 8
    for s in buf.shape:
        n *= s
    return n


def _i32(x):
    return x if isinstance(x, int) else (x if str(x.ty) == "int32" else tirx.Cast("int32", x))


def emit_ptx(name, *args):
    """One PTX instruction from TVM's table-driven ``T.ptx`` dialect, as a statement."""
    T.evaluate(TS.ptx[name](*args))


def l2_cache_hint(eviction: str | None) -> tuple[str, list]:
    """(modifier, operands) that give a TMA or cp.async load T.copy's ``eviction_policy``: ``.L2::cache_hint``
    and a 64-bit policy, made here by createpolicy, giving every line the load brings in that priority;
    nothing for the normal priority (``None``)."""
    if eviction is None:
        return "", []
    policy = T.alloc_local([1], "uint64")
    IRBuilder.name(f"l2_{eviction}", policy)
    emit_ptx(f"createpolicy.fractional.L2::{eviction}.b64", policy[0])
    return ".L2::cache_hint", [policy[0]]
