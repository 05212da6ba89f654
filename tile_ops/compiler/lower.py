"""Lower a traced tile program to a TIRx PrimFunc for CUDA: the driver the tile ops (``ops/``), the
schedules (``schedules/``) and the targets' instructions (``targets/``) are lowered through.

``Lowering`` owns the kernel's function: its parameters, the block and thread indices, the storage of
every buffer (``memory.py``), the expressions that read them, and the order of the tile ops with the
barriers between them.  TVM's CUDA code generator then turns the PrimFunc into CUDA source (codegen.py)."""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from typing import NamedTuple

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.sym.analyzer import Analyzer
from tvm.tirx import op as top
from tvm.tirx.script import builder as T

from ..lang import ir
from ..lang.ir import TileLangError, error, walk
from .cuda import emit_ptx, exp2_approx
from .definite import check_written_before_read
from .exprs import broadcast, cast, conjunction, divides, nonneg, pad, ramp, rewrite, rows_divisible, to_python
from .infer import LayoutInference
from .memory import Memory, check_pipelined_loads, check_staged_uses, pipelined_loads, stage_counts
from .meta import FLAG_SLOTS, WORKSPACE, KernelMeta, span
from .ops import Container, deferred, present, unit
from .ops import setup as setup_ops
from .ops.gemm import is_wgmma
from .schedules.persistent import bind_values, tile_indices
from .schedules.pingpong import CONSUMERS
from .schedules.warp_specialized import WarpSpecialized, bind_warpgroup
from .targets import Target
from .targets.sm90 import WgmmaGroups


class Lowered(NamedTuple):
    func: tirx.PrimFunc
    meta: KernelMeta  # without the CUDA entry's name and parameters, which the source gives


class Lowering:
    def __init__(self, prog: ir.Program, target: Target):
        self.prog, self.kernel, self.target = prog, prog.kernel, target
        self.threads = self.kernel.threads
        self.buffers = prog.buffers
        self.cluster_dims = self.kernel.cluster  # (cx, cy): rank = x % cx + y % cy * cx
        self.cluster = math.prod(self.cluster_dims)
        if self.cluster > 1 and not target.hopper:
            raise error(self.kernel.loc, f"cluster={self.cluster_dims}: thread-block clusters need the sm_90a (Hopper) "
                                         f"target, this kernel is compiled for {target.arch}")
        self.infer = LayoutInference(self.kernel, self.buffers, wgmma=target.hopper).run()
        self.ana = Analyzer()
        self.inside_bounds = False  # bounds_known
        self.stages = stage_counts(self.kernel)
        check_staged_uses(self.kernel.body, self.stages, self.buffers)
        for loop in walk(self.kernel.body):
            if isinstance(loop, ir.For) and loop.kind == "pipelined":
                check_pipelined_loads(loop, self.buffers)
                deferred.check(loop, self.buffers, pipelined_loads(loop))
        self.memory = Memory(self)
        self.ops = present(self.kernel)  # (op, node), in program order
        self.walks_tiles = any(op.walks_tiles for op, _ in self.ops)
        self.ws = None  # (planning asks global_writes, which asks it)
        self.ws = WarpSpecialized.plan(self) if target.hopper else None
        # consumer warpgroups that each run the program on alternate tiles: two with T.Kernel(pingpong=True)
        # on the warp-specialized sm_90a path (a schedule; elsewhere the program runs as written)
        self.consumers = CONSUMERS if self.ws and self.ws.pingpong else 1
        for op, node in self.ops if target.hopper else ():
            op.check_schedule(self, node)
        check_written_before_read(self.kernel, self.buffers)  # last: the checks before say more of what they refuse
        self.uses_wgmma = any(isinstance(n, ir.Gemm) and is_wgmma(self, n) for n in walk(self.kernel.body))
        self.wgmma_groups = WgmmaGroups(self)
        self.wgmma_warpgroup = None  # a kernel's consumer warpgroup, bound warp-uniform where there are several
        self.consumer = 0  # the running consumer warpgroup (pingpong)
        self.stage_of_iter = None  # the pipeline stage being computed on, inside a pipelined loop
        # global tensors the block wrote since its last barrier (generic stores), and since the last wait for
        # its TMA stores' writes: another thread re-reading them needs the barrier (and the wait) first
        self.written = frozenset()
        self.tma_written = frozenset()

    # ------------------------------------------------------------------ entry

    def lower(self) -> "Lowered":
        k, ws = self.kernel, self.ws
        sk = ws.stream_k if ws else None
        fixed = sum(op.workspace_floats(self, node) for op, node in self.ops)
        flags = sum(op.workspace_flags(self, node) for op, node in self.ops)
        with IRBuilder() as ib:
            with T.prim_func():
                T.func_name(self.prog.name)
                self.globals = {}
                for p in self.prog.params:
                    # a strided tensor is its flat storage here, offsets from its strides (global_index)
                    shape = p.shape if p.strides is None else (span(p.shape, p.strides),)
                    self.globals[p] = T.arg(p.name, T.Buffer(shape, p.dtype))
                for d in self.prog.dims + self.prog.scalars:  # an entry parameter each, after the tensors
                    T.arg(d.name, d)
                if sk:  # nominal extent (the launcher sizes it to the device's grid): flags, then slots
                    self.workspace = T.arg(WORKSPACE, T.Buffer(
                        (FLAG_SLOTS + ws.resident_ctas() * sk.floats_per_cta(),), "float32"))
                elif not isinstance(fixed, int) or fixed:  # flags, then what the kernel keeps there
                    self.workspace = T.arg(WORKSPACE, T.Buffer((FLAG_SLOTS + fixed,), "float32"))
                if ws:
                    for c in ws.loads + ws.stores:
                        ws.tensormaps.of(c, ws.slices(c))
                T.device_entry()
                grid = list(k.grid) + [1] * (3 - len(k.grid))
                if ws:
                    grid = ws.grid(grid)
                if ws and ws.walk.persistent:
                    ids = [T.cta_id([grid[0]])]  # the tile walk sets the block vars
                else:
                    ids = T.cta_id(grid[: len(k.grid)]) if len(k.grid) > 1 else [T.cta_id([grid[0]])]
                    self.block_vars = dict(zip(k.block_vars, tile_indices(self, list(ids))))
                    bind_values(self)
                block = ws.block_threads() if ws else self.threads
                self.tid = T.thread_id([block])
                if self.target.hopper:  # a programmatic launch (Kernel.dependent) may start while the stream's
                    # previous kernel runs, so every thread first waits for that kernel's completion (and its
                    # memory); then the next kernel may launch, to wait likewise (a no-op in a plain launch)
                    emit_ptx("griddepcontrol.wait")
                    emit_ptx("griddepcontrol.launch_dependents")
                # the consumer warpgroup's copy of per-warpgroup buffers (pingpong); the producer's value (2)
                # points past them: it touches pipeline stages only
                if self.consumers > 1:
                    self.consumer = bind_warpgroup(self.tid, self.threads, "warpgroup")
                smem_bytes = self.memory.declare()
                if ws:
                    ws.run(k.body, ids[0])
                else:
                    setup_ops(self)
                    self.memory.init_mbarriers()
                    self.body(k.body)
            func = ib.get()
        persistent = ws is not None and ws.walk.persistent is not None
        meta = KernelMeta(
            name=self.prog.name, arch=self.target.arch, grid=tuple(map(to_python, grid)), block=(block, 1, 1),
            smem_bytes=smem_bytes, params=[(p.name, tuple(map(to_python, p.shape)), p.dtype) for p in self.prog.params],
            dims=[(d.name, d.multiple_of) for d in self.prog.dims],
            scalars=[(v.name, str(v.ty)) for v in self.prog.scalars],
            strides={p.name: [to_python(s) for s in p.strides] for p in self.prog.params if p.strides},
            layouts={b.name: self._describe(b) for b in k.allocs},
            tensormaps=ws.tensormaps.specs() if ws else {},
            ctas_per_sm=ws.ctas_per_sm if ws else 1, cluster=self.cluster,
            cluster_dims=(self.cluster, 1, 1) if persistent else (*self.cluster_dims, 1),
            persistent_tiles=to_python(ws.walk.work_units()) if persistent else 0,
            workspace_floats=sk.floats_per_cta() if sk else 0, workspace_fixed_floats=to_python(fixed),
            workspace_flags=to_python(flags),
            waits_at_entry=self.target.hopper)
        return Lowered(func, meta)

    def _describe(self, b) -> str:
        if b.scope == "fragment":
            lay = self.infer.layouts[b]
            return f"fragment {lay.kind}, {lay.local_size} regs/thread"
        if b.scope == "shared":
            t = self.shared[b]
            return f"shared {t.layout.describe() if t.layout else '1-D'} x{t.stages} stages"
        return b.scope

    # ------------------------------------------------------------------ storage

    @staticmethod
    def stage_base(t, stage):
        """Element offset of pipeline stage ``stage`` of a (possibly multi-buffered) shared tile."""
        return stage * t.stage_elems if t.stages > 1 else 0

    def stage(self, buf):
        """The stage of ``buf`` being computed on: inside a pipelined loop, the iteration's."""
        t = self.shared.get(buf)
        if t is not None and t.stages > 1 and self.stage_of_iter is not None:
            return self.stage_of_iter
        return 0

    def shared_offset(self, t, idx, stage=None):
        base = self.stage_base(t, self.stage(t.buf) if stage is None else stage)
        if t.layout is None:
            return base + idx[0]
        return base + t.layout.offset(idx[0], idx[1])

    def _storage(self, buf, idx, frag_index, stage, vec):
        """(tirx buffer, indices) of ``buf[idx]``, or of ``vec`` elements from it along the last dim
        (the caller has checked they are contiguous); ``stage`` defaults to the one being computed on."""
        if buf.scope == "shared":
            t = self.shared[buf]
            return t.view, [ramp(self.shared_offset(t, idx, stage), vec)]
        if buf.scope == "fragment":
            if frag_index is None:
                raise TileLangError(f"fragment {buf.name} can only be accessed elementwise inside T.Parallel "
                                    f"(or by tile ops)")
            return self.frags[buf], [frag_index(buf, idx)]
        if buf.scope == "global":
            return self.globals[buf], self.global_index(buf, idx, vec)
        return self.locals[buf], list(idx[:-1]) + [ramp(idx[-1], vec)]

    def global_index(self, buf, idx, vec=1) -> list:
        """The storage indices of ``vec`` elements of a global tensor from ``idx`` along its last dim."""
        if buf.strides is None:
            return list(idx[:-1]) + [ramp(idx[-1], vec)]
        return [ramp(sum(i * s for i, s in zip(idx[:-1], buf.strides[:-1])) + idx[-1], vec)]

    def global_ptr(self, buf, idx):
        """The address of a global tensor's element ``idx``."""
        return self.globals[buf].ptr_to(self.global_index(buf, idx))

    def load(self, buf, idx, frag_index=None, stage=None, vec=1):
        return tirx.BufferLoad(*self._storage(buf, idx, frag_index, stage, vec))

    def store(self, buf, idx, value, frag_index=None, stage=None, vec=1):
        storage, at = self._storage(buf, idx, frag_index, stage, vec)
        T.buffer_store(storage, broadcast(cast(value, buf.dtype), vec), at)

    def guarded_load(self, buf, idx, frag_index=None, vec=1):
        """A load that reads 0 outside a global tensor (whole vectors are in or out: see vector_ok)."""
        value = self.load(buf, idx, frag_index, vec=vec)
        pred = self.in_bounds(buf, [0] * len(idx), idx)
        return value if pred is None else tirx.if_then_else(pred, value, broadcast(tirx.const(0, buf.dtype), vec))

    def guarded_store(self, buf, idx, value, frag_index=None, stage=None, vec=1, mask=None):
        """buf[idx] = value where ``mask`` (a ``T.when``'s, lowered) holds and, in a global tensor, idx is inside."""
        pred = conjunction([c for c in (mask, self.in_bounds(buf, [0] * len(idx), idx)) if c is not None] or [None])
        if pred is None:
            return self.store(buf, idx, value, frag_index, stage, vec)
        with T.If(pred):
            with T.Then():
                self.store(buf, idx, value, frag_index, stage, vec)

    @contextmanager
    def bounds_known(self):
        """Lowering under a test that every global element it touches is inside its tensor: no predicates."""
        self.inside_bounds = True
        try:
            yield
        finally:
            self.inside_bounds = False

    def in_bounds(self, buf, start, idx):
        """The predicate of ``start + idx`` lying inside a global tensor (None: it does, or not global)."""
        idx = pad(idx, start)
        conds = []
        if buf.scope != "global" or self.inside_bounds:
            return None
        for s, i, dim in zip(start, idx, buf.shape):
            if not nonneg(s + i):  # a window or stencil may start before the tensor
                conds.append(s + i >= 0)
            if not self.ana.can_prove(s + i < dim):
                conds.append(s + i < dim)
        return conjunction(conds) if conds else None

    def vector_ok(self, buf, start, vec) -> bool:
        """Can elements ``start + k*vec .. + vec - 1`` of ``buf``'s last dim be one aligned access?  They
        must be contiguous (in a shared tile: within one swizzle chunk) and start on a multiple of ``vec``;
        in a global tensor, a last dim divisible by ``vec`` also aligns every row and puts whole
        vectors in or out of bounds, so one predicate (on the first element) guards a vector."""
        if buf.scope not in ("global", "shared") or not self._divisible(start, vec):
            return False
        if not (rows_divisible(vec, buf) if buf.scope == "global" else divides(vec, buf.shape[-1])):
            return False
        lay = self.shared[buf].layout if buf.scope == "shared" else None
        return lay is None or lay.chunk % vec == 0

    def _divisible(self, e, v) -> bool:
        return v == 1 or self.ana.can_prove(tirx.floormod(e, v) == 0) if not isinstance(e, int) else e % v == 0

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
            return self.guarded_load(buf, idx, frag_index) if guard else self.load(buf, idx, frag_index)

        return rewrite(e, vm, on_load, _fast_exp2) if not isinstance(e, (int, float)) else e

    def flat_loop(self, extents, body_fn, vec=1):
        """Distribute a row-major iteration space over the block's threads, ``vec`` elements a thread."""
        total = math.prod(extents)
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

    # ------------------------------------------------------------------ statements and barriers

    def body(self, nodes, var_map=None, previous=None):
        """Lower a statement list; a block barrier separates two tile ops that touch shared memory where
        either writes it (their thread mappings differ, so one's writes are another's reads); ops that only
        read it since the last barrier need none.  A statement waits first for the wgmma groups it needs done
        (``wgmma_groups``).  ``previous``: (statements, var map, stage) of the previous pipeline step spliced
        into the list (a T.deferred block run one iteration late)."""
        shared_before = written_before = False
        late, late_vm, late_stage = previous or ((), None, None)
        with self.wgmma_groups.scope(), ExitStack() as rest:  # rest (stream-K): what follows the main loop,
            for node in nodes:  # for the units that run it
                op = unit(node)
                self.wgmma_groups.before(op.reads(node, self.buffers), op.writes(node))
                if self._reads_block_writes(node):  # global memory this block wrote, read back
                    self.sync_global_writes()
                    shared_before = written_before = False  # that ends with a consumer barrier
                touches = op.touches_shared(self, node)
                writes = touches and op.writes_shared(self, node)
                if shared_before and touches and (writes or written_before) and not op.orders_itself:
                    self.sync()
                    shared_before = written_before = False
                shared_before = shared_before or touches
                written_before = written_before or writes
                step = self.stage_of_iter
                is_late = any(node is n for n in late)
                if is_late:
                    self.stage_of_iter = late_stage
                turn = self.ws.turn if self.ws else None
                if turn and node is turn[0]:
                    self.ws.turns.take()
                try:
                    op.lower(self, node, late_vm if is_late else var_map or {})
                    self.written |= set(self.global_writes(node))
                except TileLangError as e:
                    if getattr(e, "located", False):
                        raise
                    raise error(node.loc, str(e)) from None
                finally:
                    self.stage_of_iter = step
                if turn and node is turn[1]:
                    self.ws.turns.give()
                if self.ws and node is self.ws.loop:
                    self.ws.after_main_loop(rest)

    def touches_shared(self, node) -> bool:
        return unit(node).touches_shared(self, node)

    def sync(self):
        """A barrier of the block's (consumer) threads."""
        self.written = frozenset()  # bar.sync orders the threads' generic global writes before what follows
        stores = self.ws and self.ws.stores
        if self.uses_wgmma or stores:  # generic-proxy shared writes made visible to the async proxy: wgmma's
            emit_ptx("fence.proxy.async.shared::cta")  # reads, TMA stores' reads
        if stores:  # what follows the barrier may rewrite a tile TMA is still storing
            self.ws.wait_stores_read()
        if self.ws:
            self.ws.consumer_barrier()
        else:
            T.evaluate(TS.cuda.cta_sync())

    def global_writes(self, node) -> list:
        """Global tensors ``node`` writes with generic stores (TMA stores are tracked by the copy)."""
        return [b for n in walk([node]) if not isinstance(unit(n), Container)
                and not (self.ws and self.ws.is_tma_store(n)) for b in unit(n).writes(n) if b.scope == "global"]

    def _reads_block_writes(self, node) -> bool:
        """Whether ``node`` reads a global tensor this block wrote since the last barrier: every thread
        reads back what it wrote itself only when the two accesses share a thread mapping, which the
        compiler does not assume (a tile op's own read-modify-write of an element is one thread's)."""
        pending = self.written | self.tma_written
        if not pending:
            return False
        reads = unit(node).reads(node, self.buffers)
        return any(r is b for r in reads for b in pending)

    def sync_global_writes(self):
        """A consumer barrier after which the block's global writes are visible to all its threads; with
        TMA stores pending, their issuer first waits for their writes (not only their shared reads)."""
        if self.tma_written:
            self.ws.wait_stores_written()
        else:
            self.sync()


_EXP2_OP = top.Op.get("tirx.exp2")


def _fast_exp2(call):
    """float32 T.exp2 as one MUFU.EX2 (``exp2_approx``)."""
    if call.op.same_as(_EXP2_OP) and str(call.ty) == "float32":
        return exp2_approx(call.args[0])
    return None


def lower(prog: ir.Program, target: Target | str) -> Lowered:
    """``prog`` lowered for ``target`` (a Target, or an arch with the table's SM count)."""
    return Lowering(prog, target if isinstance(target, Target) else Target.of(target)).lower()
