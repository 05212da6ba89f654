"""The Hopper instructions (sm_90a): TMA tile loads and stores through tensor maps the launcher encodes,
wgmma reading shared tiles through matrix descriptors (and A from registers when it is a fragment), and
the cluster's shared-memory exchange (``mapa``, ``st.async``, cluster-scope mbarrier waits)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as TS
from tvm.tirx.script import builder as T

from ...lang.ir import AtomicAdd
from ..cuda import emit_ptx, helper, l2_cache_hint
from ..exprs import as_int32, dtype_bits, strides_of, to_python
from ..layout import MmaAccumLayout, SharedLayout, shared_layout
from . import MMA_TYPES

_SWIZZLE_ENUM = {32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle
_DESC_MODE = {128: 1, 64: 2, 32: 3}  # wgmma matrix-descriptor layout type
_L2_PROMOTION = {128: 2, 256: 3}  # CUtensorMapL2promotion: 128B, 256B


def l2_promotion(row_bytes: int) -> int:
    """The L2 fill granularity a tensor map asks for: 256 bytes where the global rows are 128-byte aligned,
    128 where they are not (each box row then straddles two lines, and 256-byte fills fetch bytes no box
    needs)."""
    aligned = not isinstance(row_bytes, int) or row_bytes % 128 == 0  # symbolic: no claim, the default
    return _L2_PROMOTION[256 if aligned else 128]


def global_side(c):
    """(global buffer, shared tile, global start indices) of a copy between the two."""
    if c.src.buffer.scope == "global":
        return c.src.buffer, c.dst.buffer, c.src.starts
    return c.dst.buffer, c.src.buffer, c.dst.starts


# ---------------------------------------------------------------------- TMA


@dataclass
class TensorMap:
    var: object  # tirx Var of type tensormap (a __grid_constant__ CUtensorMap kernel parameter)
    spec: dict  # what the launcher needs to encode it (KernelMeta.tensormaps)


class TensorMaps:
    """The kernel's tensor maps, one per (global tensor, box): declared on the host side of the function,
    TVM passes each to the kernel as a ``const __grid_constant__ CUtensorMap`` parameter, which the
    launcher encodes at launch from ``spec``."""

    def __init__(self, lw):
        self.lw = lw
        self.maps: dict = {}  # (global buffer, box) -> TensorMap

    def of(self, c, slices: int = 1) -> TensorMap:
        """The tensor map of a copy's global side with a box of one swizzle panel by the tile's rows (or
        by 1/``slices`` of them: a multicast load's share)."""
        g, t, _ = global_side(c)
        lay = shared_layout(t)
        rank = len(g.shape)
        box = [lay.panel, lay.rows // slices] + [1] * (rank - 2)
        key = (g, tuple(box))
        if key in self.maps:
            return self.maps[key]
        eb = dtype_bits(g.dtype) // 8
        dims = list(reversed(g.shape))
        strides = [s * eb for s in reversed(strides_of(g)[:-1])]  # bytes, from the second-innermost dim out
        name = f"{g.name}_tmap{len([k for k in self.maps if k[0] is g]) or ''}"
        var = T.Var(name, ty=T.handle("tensormap").ty)
        T.Bind(T.tvm_stack_alloca("tensormap", 1), var=var)
        T.evaluate(T.tensormap_encode_tiled(
            var, self.lw.globals[g].data, *dims, *strides, *box, *([1] * rank), descriptor_dtype=g.dtype,
            rank=rank, swizzle=_SWIZZLE_ENUM[lay.swizzle_bytes], l2_promotion=l2_promotion(strides[0])))
        spec = dict(tensor=g.name, dtype=g.dtype, dims=[to_python(d) for d in dims],
                    strides=[to_python(s) for s in strides], box=box, element_strides=[1] * rank,
                    swizzle=_SWIZZLE_ENUM[lay.swizzle_bytes], l2_promotion=l2_promotion(strides[0]), oob_fill=0)
        self.maps[key] = TensorMap(var, spec)
        return self.maps[key]

    def specs(self) -> dict:
        return {tm.var.name: tm.spec for tm in self.maps.values()}

    def prefetch(self):
        """Fetch the descriptors off the first load's path."""
        for tm in self.maps.values():
            emit_ptx("prefetch.tensormap", T.address_of(tm.var))


def tma_load(lw, c, vm, stage, tm: TensorMap, full, slices: int = 1, group=None):
    """One box per swizzle panel into ``stage`` of the tile, completing on the mbarrier ``full``; a multicast
    load (``slices`` > 1, ``group``: this block's slice index and the ctaMask) loads this block's 1/n of
    the rows into the same place of every block of the cluster."""
    t = lw.shared[c.dst.buffer]
    starts = [lw.expr(x, vm) for x in c.src.starts]
    coords = list(reversed(starts))
    rank = len(coords)
    kind = f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes"
    hint, policy = l2_cache_hint(c.eviction)
    if slices > 1:
        me, mask = group
        rows = t.layout.rows // slices
    for p in range(t.layout.cols // t.layout.panel):
        dst = lw.stage_base(t, stage) + p * t.layout.panel_elems
        cs = [coords[0] + p * t.layout.panel] + coords[1:]
        if slices == 1:
            emit_ptx(kind + hint, t.view.ptr_to([dst]), T.address_of(tm.var), *[as_int32(x) for x in cs],
                     full, *policy)
            continue
        cs[1] = cs[1] + me * rows
        emit_ptx(kind + ".multicast::cluster" + hint, t.view.ptr_to([dst + me * rows * t.layout.panel]),
                 T.address_of(tm.var), *[as_int32(x) for x in cs], full, mask, *policy)


def tma_store(lw, c, vm, tm: TensorMap):
    """A shared tile to global memory, or added into it (``T.atomic_add``: TMA's reduce-add, done in L2 a line at
    a time): thread 0 issues a box per panel and commits them as a bulk group."""
    t = lw.shared[c.src.buffer]
    coords = list(reversed([lw.expr(x, vm) for x in c.dst.starts]))
    kind = "cp.reduce.async.bulk.tensor.{}d.global.shared::cta.add.bulk_group" if isinstance(c, AtomicAdd) else \
        "cp.async.bulk.tensor.{}d.global.shared::cta.bulk_group"
    with T.If(lw.tid == 0):
        with T.Then():
            for p in range(t.layout.cols // t.layout.panel):
                src = t.view.ptr_to([lw.stage_base(t, lw.stage(c.src.buffer)) + p * t.layout.panel_elems])
                cs = [coords[0] + p * t.layout.panel] + coords[1:]
                emit_ptx(kind.format(len(cs)), T.address_of(tm.var), *[as_int32(x) for x in cs], src)
            emit_ptx("cp.async.bulk.commit_group")


def wait_stores(lw, read_only: bool):
    """The TMA stores' issuer waits until they have read their tiles (``read_only``) or are complete."""
    with T.If(lw.tid == 0):
        with T.Then():
            emit_ptx("cp.async.bulk.wait_group.read" if read_only else "cp.async.bulk.wait_group", 0)


# ---------------------------------------------------------------------- wgmma


def wgmma_gemm(lw, g):
    """A gemm's wgmmas, issued and committed as one group that runs on while the warpgroup goes on; the wait
    comes where a later statement needs the group done (``WgmmaGroups``)."""
    if g.clear_accum:
        with T.unroll(0, lw.infer.layouts[g.C].local_size) as r:
            T.buffer_store(lw.frags[g.C], tirx.const(0.0, "float32"), [r])
    fence_operands(lw, [g], accumulators=False)
    emit_ptx("wgmma.fence.sync.aligned")
    issue_wgmma(lw, g)
    lw.wgmma_groups.commit(g)


class WgmmaGroups:
    """The wgmma groups a warpgroup has committed and not yet waited for, oldest first.  Before each statement
    the lowering asks ``before``: a statement that reads or writes a pending gemm's accumulator, or writes one
    of its operands, first waits until that group retires (``wgmma.wait_group n``, n the younger groups, which
    run on).  A statement list waits for the groups it committed by its end (``scope``), so no group crosses a
    loop's back edge or a branch, and every wait's count is the same on every path."""

    def __init__(self, lw):
        self.lw = lw
        self.pending = []  # (commit number, Gemm)
        self.commits = 0

    def commit(self, g):
        emit_ptx("wgmma.commit_group.sync.aligned")
        self.pending.append((self.commits, g))
        self.commits += 1

    def before(self, reads: list, writes: list):
        """Wait for what a statement reading ``reads`` and writing ``writes`` needs done."""
        last = max((i for i, (_, g) in enumerate(self.pending) if _needs_done(g, reads, writes)), default=None)
        if last is not None:
            self.wait(len(self.pending) - 1 - last)

    def wait(self, younger: int):
        """Wait until at most ``younger`` groups are pending; the retired gemms' registers are then pinned
        below the wait (``fence_operands``)."""
        retired = self.pending[:len(self.pending) - younger]
        emit_ptx("wgmma.wait_group.sync.aligned", younger)
        self.pending = self.pending[len(self.pending) - younger:]
        fence_operands(self.lw, [g for _, g in retired])

    @contextmanager
    def scope(self):
        """A statement list: on entry the groups pending from outside stay so (its statements wait for them where
        needed); by its end it has waited for its own.  Afterwards the outer groups count as pending still (the
        list may not have run: a loop of no iterations), where a second wait costs nothing."""
        outer, first = list(self.pending), self.commits
        yield
        if any(n >= first for n, _ in self.pending):
            self.wait(0)
        self.pending = outer


def _needs_done(g, reads, writes) -> bool:
    """Whether a statement reading ``reads`` and writing ``writes`` must wait for gemm ``g``'s group: it reads
    or writes the accumulator, or writes an operand the wgmmas still read."""
    return any(b is g.C for b in reads + writes) or any(b is g.A or b is g.B for b in writes)


_FENCE_REGISTER = """
__forceinline__ __device__ void tile_ops_fence_register(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__forceinline__ __device__ void tile_ops_fence_register(unsigned& r) { asm volatile("" : "+r"(r) :: "memory"); }
"""


def fence_operands(lw, gemms, accumulators=True):
    """Keep nvcc from moving register accesses across a wgmma fence or wait (the asm only names
    the registers): wgmma reads a register A operand asynchronously until its group retires, so
    its writes must stay above the fence and its next writes below the wait, as must the
    accumulator reads."""
    for g in gemms:
        regs = []
        if accumulators:
            regs += [lw.frags[g.C][r] for r in range(lw.infer.layouts[g.C].local_size)]
        if g.A.scope == "fragment":
            words = lw.frags[g.A].view("uint32")
            regs += [words[w] for w in range(lw.infer.layouts[g.A].local_size // 2)]
        for x in regs:
            T.evaluate(TS.cuda.func_call("tile_ops_fence_register", x, source_code=_FENCE_REGISTER))


def issue_wgmma(lw, g):
    """One m64nNk16 wgmma per 64-row slice of this warpgroup and 16-wide k step.  A comes from shared
    memory through a descriptor, or from registers (the "rs" form: four 32-bit words per thread, and
    no transpose-A operand)."""
    lay: MmaAccumLayout = lw.infer.layouts[g.C]
    K = g.A.shape[0] if g.transpose_A else g.A.shape[1]
    wg = lw.wgmma_warpgroup if lw.wgmma_warpgroup is not None else tirx.floordiv(lw.tid, 128)
    wr, wc = lay.warp_rc(wg * 128)  # this warpgroup's first warp
    N, n0 = lay.w.WN, wc * lay.w.WN  # the warpgroup's columns
    el = MMA_TYPES[g.A.dtype]
    acc, tb = lw.frags[g.C], lw.shared[g.B]
    a_words = lw.frags[g.A].view("uint32") if g.A.scope == "fragment" else None
    for kk in range(K // 16):
        for mi in range(lay.mi):
            if a_words is not None:  # A's layout is C's with K columns: its slice mi has the same rows
                a = [a_words[w] for w in lw.infer.layouts[g.A].a_operand_words(mi, kk)]
                trans_a = []
            else:
                a = [descriptor(lw, lw.shared[g.A], g.A, lay.row0(wr, mi), kk * 16, mn_major=g.transpose_A)]
                trans_a = [int(g.transpose_A)]
            b_desc = descriptor(lw, tb, g.B, n0, kk * 16, mn_major=not g.transpose_B)
            d = [acc[mi * lay.ni * 4 + r] for r in range(lay.ni * 4)]
            scale_d = tirx.const(True, "bool") if not g.clear_accum or kk else tirx.const(False, "bool")
            emit_ptx(f"wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{el}.{el}", *d, *a, b_desc, scale_d,
                     1, 1, *trans_a, int(not g.transpose_B))


def descriptor(lw, t, buf, mn0, k0, mn_major: bool):
    """The 64-bit wgmma matrix descriptor of a shared tile at (mn0, k0) of the stage being read.

    K-major tiles (rows = M/N, cols = K): 8-row groups ``8 * row bytes`` apart (SBO).
    MN-major tiles (rows = K, cols = M/N): 8-k groups ``8 * row bytes`` apart (SBO), panels of
    the M/N dim ``panel bytes`` apart (LBO)."""
    lay: SharedLayout = t.layout
    eb = dtype_bits(buf.dtype) // 8
    row_bytes = lay.panel * eb
    i, j = (k0, mn0) if mn_major else (mn0, k0)
    elem = j // lay.panel * lay.panel_elems + i * lay.panel + j % lay.panel  # unswizzled: the panel origin
    elem = lw.stage_base(t, lw.stage(buf)) + elem
    addr = tirx.Cast("uint64", TS.cuda.cvta_generic_to_shared(t.view.ptr_to([elem])))
    lbo = lay.panel_elems * eb if mn_major else 16
    const = ((lbo >> 4) << 16) | (((8 * row_bytes) >> 4) << 32) | (_DESC_MODE[lay.swizzle_bytes] << 62)
    return tirx.bitwise_or(tirx.shift_right(tirx.bitwise_and(addr, tirx.const(0x3FFFF, "uint64")),
                                            tirx.const(4, "uint64")), tirx.const(const, "uint64"))


# ---------------------------------------------------------------------- clusters

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
_CLUSTER_RANK = """
__forceinline__ __device__ unsigned tile_ops_cluster_rank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
"""
# st.async: a store (one value or a pair) into a peer's shared memory, at the mapa address of the same
# offset there, that completes its bytes on the peer's mbarrier
_CLUSTER_PUT = _PEER_ADDRESS + """
__forceinline__ __device__ void tile_ops_cluster_put(float* p, uint64_t* bar, unsigned peer, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(tile_ops_peer_address(p, peer)), "f"(v), "r"(tile_ops_peer_address(bar, peer)) : "memory");
}
__forceinline__ __device__ void tile_ops_cluster_put(float* p, uint64_t* bar, unsigned peer, float v0, float v1) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               :: "r"(tile_ops_peer_address(p, peer)), "f"(v0), "f"(v1), "r"(tile_ops_peer_address(bar, peer))
               : "memory");
}
"""
# an arrive on a (peer's) barrier where pred holds, predicated, not branched around: a stage's release
# orders only this warp's reads of it (done: the wgmma wait), so the arrive is relaxed to CTA scope (a
# cluster-scope release costs a fence each)
_CLUSTER_ARRIVE_IF = """
__forceinline__ __device__ void tile_ops_cluster_arrive_if(unsigned bar, int pred) {
  asm volatile("{\\n .reg .pred p;\\n setp.ne.b32 p, %1, 0;\\n @p mbarrier.arrive.shared::cluster.b64 _, [%0];\\n}"
               :: "r"(bar), "r"(pred) : "memory");
}
"""
_CLUSTER_WAIT = """
__forceinline__ __device__ void tile_ops_cluster_wait(uint64_t* bar, unsigned parity) {
  unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile("{\\n .reg .pred done;\\n TILE_OPS_CLUSTER_WAIT_%=:\\n"
               " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\\n"
               " @!done bra TILE_OPS_CLUSTER_WAIT_%=;\\n}" :: "r"(a), "r"(parity) : "memory");
}
"""


def cluster_position(lw):
    """(rank, x, y) of this block in its cluster: rank = x + y * cx (y is 0 in a 1-D cluster)."""
    cx, cy = lw.cluster_dims
    rank = tirx.Cast("int32", helper("tile_ops_cluster_rank", _CLUSTER_RANK, return_type="uint32"))
    return (rank, rank, 0) if cy == 1 else (rank, tirx.floormod(rank, cx), tirx.floordiv(rank, cx))


def peer_address(ptr, peer):
    """``ptr``'s offset in the shared memory of cluster block ``peer`` (uint32)."""
    return helper("tile_ops_peer_address", _PEER_ADDRESS, ptr, peer, return_type="uint32")


def cluster_put(slot, bar, peer, *values):
    """st.async of one or two floats into ``slot`` of block ``peer``, completing on its ``bar``."""
    T.evaluate(helper("tile_ops_cluster_put", _CLUSTER_PUT, slot, bar, peer, *values))


def cluster_arrive_if(bar, pred):
    T.evaluate(helper("tile_ops_cluster_arrive_if", _CLUSTER_ARRIVE_IF, bar, pred))


def cluster_wait(bar, parity):
    """Wait, with cluster-scope acquire, until ``bar`` completes the phase of ``parity``."""
    T.evaluate(helper("tile_ops_cluster_wait", _CLUSTER_WAIT, bar, parity))
