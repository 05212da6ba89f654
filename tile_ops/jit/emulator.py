"""A tiny CPU interpreter of lowered tile_ops PrimFuncs: elementwise kernels, fragments, reductions and the
sm_80 tensor-core GEMM path (cp.async, ldmatrix, mma.sync m16n8k16).  Every block's threads run as Python
generators that stop at ``cta_sync`` and at warp-wide instructions (shuffles, ldmatrix, mma.sync); the
scheduler answers a warp instruction once all 32 lanes of the warp are at it and releases the barrier once
every thread is at it, and raises where neither can happen (divergent warps or barriers).

Global tensors, the block's shared arena (bytes) and each thread's registers (local buffers) are numpy
arrays, so vector accesses (Ramp/Broadcast) read and write real memory and indices past a tensor's or
register array's end raise.  The shared arena starts as 0xFF bytes, NaN in every float type, so reading
shared memory that nothing wrote shows in the result.  bfloat16 is stored as its bits (pass bfloat16
tensors as uint16 arrays) and computed as float32, rounded to nearest even where stored or cast.  A gemm in
a loop of no iterations fixes fragment layouts without running.

The sm_90a path: warp-specialized blocks whose threads branch on their index; mbarriers (init, arrive,
arrive.expect_tx, try_wait.parity) kept per block by shared address; TMA tile loads (cp.async.bulk.tensor,
global -> shared, OOB zero-filled, swizzled) that land at the end of the scheduler round that issued them
and complete their bytes on the mbarrier then; wgmma.mma_async (m64nNk16, f16/bf16 -> f32, A and B through
shared-memory matrix descriptors) gathered over the 128 threads of a warpgroup and executed, reading shared
memory and the accumulator registers, only when a wgmma.wait_group retires its group (so a stage released
before its wgmmas retire shows).  The tensor maps come from the kernel's meta (``tensormaps=lk.meta.tensormaps``),
as the launcher encodes them.  setmaxnreg, fences and prefetches are no-ops.

Thread-block clusters (``run(grid, cluster=lk.meta.cluster_dims)``): a cluster's blocks (equal x // cx, y // cy, z;
rank x % cx + (y % cy) cx, as the launcher's __cluster_dims__) run together in one scheduler, each with its
own shared arena, mbarriers and queues; %cluster_ctarank (tile_ops_cluster_rank) is the rank;
barrier.cluster.wait goes on once every thread of the cluster that has not exited has made as many
barrier.cluster.arrives as the waiter; TMA loads with .multicast::cluster land at the same shared offset in
every block of the CTA mask and complete their bytes on each one's mbarrier at that offset; a remote arrive
(tile_ops_cluster_arrive_if on a tile_ops_peer_address address: mbarrier.arrive.shared::cluster on a mapa
address) counts on the peer's mbarrier at the same offset; either one on a block whose threads have all exited raises.  ``stagger=True`` runs rank r only every
(r % 4 + 1)-th scheduler round, so a peer's producer runs ahead (a stage released to it too soon shows).

Across clusters (``run(..., resident=True)``: the whole grid in one scheduler, as a persistent grid is
resident): st.async to a peer (tile_ops_cluster_put, T.cluster_allreduce's exchange) lands at the round's
end and completes its bytes on the peer's mbarrier; named-barrier bar.arrive counts without waiting
(pingpong's hand-off); the workspace's int32 flags in global memory (stream-K's and T.row_reduce_store's
signal, spin-wait, reset) and the row factor helper run as their CUDA does, on sequentially consistent
memory, so a missing wait shows only where the blocks' drift (``stagger``) exposes it, and a flag left
non-zero shows in the workspace."""

from __future__ import annotations

import math
import operator
from collections import Counter

import numpy as np
import tvm.ir.expr as irx
import tvm.ir.prim.expr as px
from tvm.tirx import stmt as ts

_BIN = {px.Add: operator.add, px.Sub: operator.sub, px.Mul: operator.mul, px.Min: np.minimum, px.Max: np.maximum,
        px.FloorDiv: operator.floordiv, px.FloorMod: operator.mod, px.BitwiseXor: operator.xor,
        px.BitwiseAnd: operator.and_, px.BitwiseOr: operator.or_, px.LShift: operator.lshift,
        px.RShift: operator.rshift, px.LT: operator.lt, px.LE: operator.le,
        px.GT: operator.gt, px.GE: operator.ge, px.EQ: operator.eq, px.NE: operator.ne,
        px.And: np.logical_and, px.Or: np.logical_or}

_FLAGS = {"tile_ops_flag_signal", "tile_ops_flag_wait", "tile_ops_row_stats_read"}
_CP_ASYNC = {"tirx.ptx.cp_async_ca", "tirx.ptx.cp_async_cg", "tirx.ptx.cp_async_ca_src_size",
             "tirx.ptx.cp_async_cg_src_size"}
_NO_OPS = {"tirx.ptx.cp_async_commit_group", "tirx.ptx.cp_async_wait_group",  # copies complete at issue here
           "tirx.ptx.griddepcontrol",  # sm_90a: launch ordering between kernels
           "tirx.ptx.fence_proxy",  # generic-to-async proxy fences: one memory here
           "tirx.ptx.fence_mbarrier_init",  # makes mbarrier inits visible (to the cluster): at once here
           "tirx.ptx.prefetch",  # of a tensor map (or a line): a hint
           "tirx.ptx.setmaxnreg"}  # warpgroup register reallocation: registers are unbounded here
_PEER_SHIFT = 24  # a mapa address: the peer's rank above its shared offset
# createpolicy's results: an opaque 64-bit policy per L2 priority, read back by the loads that carry it
_POLICIES = {p: 0x7E57_0000_0000_0000 + i for i, p in enumerate(("evict_first", "evict_last", "evict_normal",
                                                                   "evict_unchanged"))}
_POLICY_NAMES = {v: p for p, v in _POLICIES.items()}
_ATOMIC_ADDS = {"tile_ops_atomic_add", "tile_ops_atomic_add2", "tile_ops_atomic_add4"}
_NO_OP_HELPERS = {"tile_ops_fence_register"}  # an empty asm that pins a register across wgmma fences
_HELD = "held"  # (stagger) a thread released whose block skips the scheduler round
_SHUFFLED = "shuffled"  # env: the answers of the running statement's shuffles


def _key(var):
    return var.__chandle__()  # TVM objects compare by handle; == would build an EQ expression


def _op(e) -> str:
    """The name of the intrinsic ``e`` calls ("" if it is no call)."""
    return getattr(getattr(e, "op", None), "name", "") if isinstance(e, irx.Call) else ""


def _shuffles(e) -> list:
    """The warp shuffles in expression ``e``, innermost first."""
    if isinstance(e, irx.Call):
        inner = [c for a in e.args for c in _shuffles(a)]
        return inner + ([e] if _op(e) == "tirx.tvm_warp_shuffle_xor" else [])
    kids = [getattr(e, f) for f in ("a", "b", "value", "condition", "true_value", "false_value") if hasattr(e, f)]
    return [c for k in kids for c in _shuffles(k)]


def _operands(call):
    """A PTX call's expression operands and its string modifiers."""
    exprs = [a for a in call.args if not isinstance(a, irx.StringImm)]
    return exprs, [a.value for a in call.args if isinstance(a, irx.StringImm)]


# ---------------------------------------------------------------- dtypes


def _is_bf16(dtype) -> bool:
    return str(dtype).split("x")[0] == "bfloat16"


def _storage(dtype):
    """The numpy dtype memory holds ``dtype`` (or its vectors) in: bfloat16 as its bits."""
    return np.dtype(np.uint16) if _is_bf16(dtype) else np.dtype(str(dtype).split("x")[0])


def _values(dtype):
    """The numpy dtype ``dtype``'s values are computed in: bfloat16 as float32."""
    return np.dtype(np.float32) if _is_bf16(dtype) else _storage(dtype)


def _bf16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even; NaN stays a (quiet) NaN."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)


def _bf16_values(bits):
    """bfloat16 bits -> their float32 values."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _elements(h, ab: str):
    """16-bit elements ``h`` (their bits, uint16) as float64."""
    return (_bf16_values(h) if ab == "bf16" else np.asarray(h, np.uint16).view(np.float16)).astype(np.float64)


def _halves(words, ab: str):
    """The 16-bit elements packed in b32 registers ``words`` (lanes x registers), each register's low half
    first, as float64: (lanes, 2 x registers)."""
    h = np.ascontiguousarray(words, np.uint32).view(np.uint16)
    return (_bf16_values(h) if ab == "bf16" else h.view(np.float16)).astype(np.float64)


def _span(mem, offset: int, n: int):
    """``n`` bytes of byte array ``mem`` from ``offset``; raises past either end."""
    if offset < 0 or offset + n > mem.size:
        raise IndexError(f"emulator: bytes [{offset}, {offset + n}) outside a {mem.size}-byte memory")
    return mem[offset:offset + n]


# ---------------------------------------------------------------- warp instructions (all 32 lanes at once)


def _shfl(emu, mask, values):
    """``__shfl_xor_sync``: lane i receives lane (i ^ mask)'s value."""
    return [values[i ^ mask] for i in range(32)]


def _ldmatrix(emu, key, addrs):
    """``ldmatrix.sync.aligned.m8n8.x{count}[.trans].shared.b16``: lanes 8i..8i+7 give the shared addresses
    (16-byte aligned) of the 8 rows of 8 b16 elements of matrix i; lane t receives, for each matrix, the b32
    word of its row t/4, elements 2(t%4) (low half) and 2(t%4)+1; with .trans, of the transposed matrix."""
    count, trans = key
    rows = []
    for a in addrs[:8 * count]:
        if a % 16:
            raise ValueError(f"emulator: ldmatrix row address {a} is not 16-byte aligned")
        rows.append(_span(emu.smem, a, 16).view(np.uint16))
    mats = np.stack(rows).reshape(count, 8, 8)
    if trans:
        mats = mats.transpose(0, 2, 1)
    words = np.ascontiguousarray(mats).view(np.uint32).reshape(count, 32)
    return [words[:, t] for t in range(32)]


def _mma(emu, ab, operands):
    """``mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32`` D = A B + C, A 16x16 (row), B 16x8 (col),
    with g = lane/4, c = 2(lane%4): A's registers a0..a3 hold A[g, c:c+2], A[g+8, c:c+2], A[g, c+8:c+10],
    A[g+8, c+8:c+10]; B's b0, b1 hold B[c:c+2, g], B[c+8:c+10, g]; C's and D's four floats C[g, c:c+2],
    C[g+8, c:c+2].  Products are exact and summed in float64, then rounded to float32."""
    a, b, c = (np.array([op[i] for op in operands]) for i in range(3))
    A = _halves(a, ab).reshape(8, 4, 2, 2, 2).transpose(3, 0, 2, 1, 4).reshape(16, 16)  # [g, t, col, row, h]
    B = _halves(b, ab).reshape(8, 4, 2, 2).transpose(2, 1, 3, 0).reshape(16, 8)  # [g, t, k half, h]
    C = c.astype(np.float64).reshape(8, 4, 2, 2).transpose(2, 0, 1, 3).reshape(16, 8)  # [g, t, row half, h]
    D = (A @ B + C).astype(np.float32)
    return list(D.reshape(2, 8, 4, 2).transpose(1, 2, 0, 3).reshape(32, 4))


def _syncwarp(emu, key, operands):
    return [None] * 32  # __syncwarp(): the warp's lanes all got here


_WARP = {"shfl": _shfl, "ldmatrix": _ldmatrix, "mma": _mma, "syncwarp": _syncwarp}


# ---------------------------------------------------------------- sm_90a: swizzles, descriptors, wgmma, TMA


def _swizzled(addr, span: int):
    """The shared address byte ``addr`` has under a ``span``-byte swizzle (32, 64 or 128; 16: none): the index of
    its 16-byte chunk in its ``span``-byte row (address bits 4..) XORed with the row's index mod span/16 (bits
    7..), i.e. CUTLASS's Swizzle<log2(span/16), 4, 3> on the address, so the pattern repeats every 8 rows
    (1024 bytes for 128B).  TMA writes and wgmma descriptors read shared memory through it."""
    addr = np.asarray(addr)
    return addr ^ (((addr >> 7) & (span // 16 - 1)) << 4)


_DESC_SPAN = {0: 16, 1: 128, 2: 64, 3: 32}  # a matrix descriptor's layout type (bits 62-63) -> swizzle bytes


def _descriptor_addresses(desc: int, rows: int, mn_major: bool):
    """The shared byte addresses of the ``rows`` x 16 (M or N by K) 16-bit elements a wgmma matrix descriptor
    names.  The descriptor (PTX ISA, "Matrix Descriptor Format"): start address >> 4 in bits 0-13, leading
    byte offset (LBO) >> 4 in 16-29, stride byte offset (SBO) >> 4 in 32-45, base offset in 49-51, layout
    type in 62-63 (0 none, 1 128B, 2 64B, 3 32B swizzle).  The canonical layouts ("Canonical Layouts", in
    16-byte units T = 8 elements; S the swizzle bytes), before the address swizzle:
    K-major (imm-trans 0), row mn = r + 8i, k = t + 8c: start + i SBO + r S + 16c + 2t (none: 16r + c LBO);
    MN-major (imm-trans 1), mn = t + 8c + (S/2) i, k = r + 8j: start + i LBO + j SBO + r S + 16c + 2t
    (none: mn = t + 8i, start + i SBO + j LBO + 16r + 2t)."""
    start, lbo, sbo = (((desc >> shift) & 0x3FFF) << 4 for shift in (0, 16, 32))
    base, mode = (desc >> 49) & 7, desc >> 62
    if base or (desc >> 46) & 7 or (desc >> 52) & 0x3FF or (desc >> 14) & 3 or (desc >> 30) & 3:
        raise NotImplementedError(f"emulator: wgmma descriptor {desc:#x}: a base offset or reserved bits")
    span = _DESC_SPAN[mode]
    mn, k = np.arange(rows)[:, None], np.arange(16)[None, :]
    if not mn_major:
        r, i, t, c = mn % 8, mn // 8, k % 8, k // 8
        addr = start + i * sbo + t * 2 + (r * span + c * 16 if mode else r * 16 + c * lbo)
    elif mode:
        r, j, t, c, i = k % 8, k // 8, mn % 8, mn // 8 % (span // 16), mn // (span // 2)
        addr = start + i * lbo + j * sbo + r * span + c * 16 + t * 2
    else:
        r, j, t, i = k % 8, k // 8, mn % 8, mn // 8
        addr = start + i * sbo + j * lbo + r * 16 + t * 2
    return _swizzled(addr, span)


def _wgmma_d(regs, n: int):
    """A warpgroup's m64nN f32 accumulator (PTX ISA, "Matrix Fragments for wgmma.mma_async.m64nNk16", figure
    "D"): thread t = 32w + l holds N/2 registers; d[4j + e] is D[16w + l/4 + 8(e/2), 8j + 2(l%4) + e%2], i.e.
    each warp's 16 rows as mma.sync m16n8 C fragments repeated over the N/8 column blocks.  (128, N/2) ->
    (64, N)."""
    return np.asarray(regs).reshape(4, 8, 4, n // 8, 2, 2).transpose(0, 4, 1, 3, 2, 5).reshape(64, n)


def _wgmma_d_regs(d, n: int):
    """The inverse of _wgmma_d: (64, N) -> each thread's N/2 registers, (128, N/2)."""
    return np.asarray(d).reshape(4, 2, 8, n // 8, 4, 2).transpose(0, 2, 4, 3, 1, 5).reshape(128, n // 2)


def _wgmma_a(words, ab: str):
    """A warpgroup's 64 x 16 A operand from registers (the "rs" form; PTX ISA, "Matrix Fragments for
    wgmma.mma_async.m64nNk16", figure "A in registers"): thread t = 32w + l holds four b32 registers a0..a3
    of two elements each, A[16w + l/4 + 8(i%2), 2(l%4) + 8(i/2) + e]: each warp's 16 rows as an mma.sync
    m16n8k16 A fragment.  (128, 4) words -> (64, 16)."""
    h = _halves(np.asarray(words, np.uint32).reshape(128, 4), ab).reshape(4, 8, 4, 2, 2, 2)  # w, l/4, l%4, i/2, i%2, e
    return h.transpose(0, 4, 1, 3, 2, 5).reshape(64, 16)


def _wgmma(smem, key, regs):
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.{ab}.{ab}`` D = (sa A) (sb B) + (scale_d ? D : 0), A 64 x 16
    and B 16 x N read from shared memory ``smem`` through their descriptors (imm-trans 0: K-major, 1: M/N-
    major), or A from the threads' registers (the "rs" form: ``regs`` then holds (accumulator, A words) per
    thread, as they were at the issue), D the warpgroup's accumulator registers ``regs`` ((f32 register array,
    indices) per thread).  Products are exact and summed in float64, then rounded to float32."""
    words = smem.view(np.uint16)
    if len(key[0]) == 3:  # rs
        (n, ab, _), desc_b, scale_d, scale_a, scale_b, trans_b = key
        A = _wgmma_a([w for _, w in regs], ab)
        regs = [r for r, _ in regs]
        b = _descriptor_addresses(desc_b, n, trans_b)
        addresses = (b,)
    else:
        (n, ab), desc_a, desc_b, scale_d, scale_a, scale_b, trans_a, trans_b = key
        a, b = (_descriptor_addresses(desc, rows, trans) for desc, rows, trans in
                ((desc_a, 64, trans_a), (desc_b, n, trans_b)))
        addresses = (a, b)
    for addr in addresses:
        if addr.min() < 0 or addr.max() + 2 > smem.size or (addr % 2).any():
            raise IndexError(f"emulator: a wgmma operand at shared bytes [{addr.min()}, {addr.max() + 2})")
    if len(addresses) == 2:
        A = _elements(words[a // 2], ab)  # (64, 16)
    B = _elements(words[b // 2], ab)  # (N, 16)
    D = _wgmma_d(np.stack([arr[idx] for arr, idx in regs]), n).astype(np.float64)
    D = scale_a * scale_b * (A @ B.T) + (D if scale_d else 0)
    for (arr, idx), v in zip(regs, _wgmma_d_regs(D.astype(np.float32), n)):
        arr[idx] = v


def _tma_box_offsets(spec: dict, tensor, coords):
    """(byte offsets in ``tensor``, in-bounds mask) of a TMA box's elements, innermost dimension first."""
    dims, box = spec["dims"], spec["box"]
    size = _storage(spec["dtype"]).itemsize
    strides = [size] + list(spec["strides"])
    if any(e != 1 for e in spec["element_strides"]) or any(st % 16 for st in strides[1:]) or spec["oob_fill"]:
        raise NotImplementedError(f"emulator: tensor map {spec}: element strides, strides not 16-byte multiples "
                                  f"or a NaN fill")
    idx = np.indices(box[::-1]).reshape(len(box), -1)[::-1]  # innermost first, box order
    pos = [c + i for c, i in zip(coords, idx)]
    inside = np.logical_and.reduce([(0 <= p) & (p < d) for p, d in zip(pos, dims)])
    offset = sum(p * st for p, st in zip(pos, strides))
    if inside.any() and (offset[inside].min() < 0 or offset[inside].max() + size > tensor.nbytes):
        raise IndexError(f"emulator: tensor map {spec} reaches past its {tensor.nbytes}-byte tensor")
    return np.where(inside, offset, 0), inside


def _tma_box_store(spec: dict, tensor, coords, data, add=False):
    """A TMA store's global side: box elements ``data`` (box order) to ``tensor`` where in bounds (``add``: a
    reduce-add, the sum rounded to the tensor's dtype)."""
    offset, inside = _tma_box_offsets(spec, tensor, coords)
    size = _storage(spec["dtype"]).itemsize
    flat, at = tensor.reshape(-1).view(_storage(spec["dtype"])), offset[inside] // size
    got = data.view(_storage(spec["dtype"]))[inside]
    if not add:
        flat[at] = got
    elif _is_bf16(spec["dtype"]):
        flat[at] = _bf16_bits(_bf16_values(flat[at]) + _bf16_values(got))
    else:
        flat[at] = (flat[at].astype(np.float32) + got.astype(np.float32)).astype(flat.dtype)


def _tma_box(spec: dict, tensor, coords):
    """The bytes of a TMA tile box (tensor map ``spec``, as the launcher encodes it: dims innermost first,
    strides in bytes of dims 1.., box, element strides, oob_fill) at element coordinates ``coords``
    (innermost first, may be negative): box elements outside the tensor read as zero (oob_fill 0; the NaN
    fill is not emulated); the box is packed innermost dimension first.  ``tensor`` is the global array the
    map's address is."""
    offset, inside = _tma_box_offsets(spec, tensor, coords)
    elems = tensor.reshape(-1).view(_storage(spec["dtype"]))[offset // _storage(spec["dtype"]).itemsize]
    return np.where(inside, elems, np.zeros((), elems.dtype)).view(np.uint8)


class _Cta:
    """One block of a cluster: its index, cluster rank, shared arena (allocated by its first thread),
    mbarriers (shared byte address -> state, _mbarrier_init), wgmma queues (warpgroup -> its wgmmas not yet
    committed and its committed groups not yet retired), bulk queues (thread -> its TMA stores not yet
    committed and its bulk groups not yet waited for); done once all its threads have exited."""

    def __init__(self, block, rank, cluster):
        self.block, self.rank, self.cluster, self.smem, self.done = block, rank, cluster, None, False
        cluster.append(self)  # its cluster's blocks, by rank
        self.mbarriers, self.wgmma, self.bulk = {}, {}, {}
        self.bar_arrived = Counter()  # (named barrier id, count) -> threads past it by bar.arrive this phase


class Emulator:
    def __init__(self, func, arrays: dict, tensormaps: dict | None = None):
        """``arrays``: parameter name -> numpy array (written in place; bfloat16 ones as uint16 bits), or its
        value for a T.dynamic size.
        ``tensormaps``: the kernel's TMA descriptors as the launcher encodes them (``lk.meta.tensormaps``, or a
        compiled kernel's ``meta.tensormaps``): kernel parameter name -> {tensor, dtype, dims, strides, box,
        element_strides, swizzle, l2_promotion, oob_fill}."""
        tensors = [p for p in func.params if "BufferType" in str(p.ty)]
        self.func, self.mem = func, {p.name: arrays[p.name] for p in tensors}
        # T.dynamic sizes and T.Scalars: int32 and float32 parameters, given by name like the tensors
        self.scalars = {_key(p): int(arrays[p.name]) for p in func.params if str(p.ty) == "int32"}
        self.scalars.update({_key(p): np.float32(arrays[p.name]) for p in func.params if str(p.ty) == "float32"})
        self.tensormaps = dict(tensormaps or {})
        self.names = {}  # buffer handle -> its data var's name
        self.parsed = {}  # call handle -> what _issue_wgmma reads of it
        self.ran = Counter()  # PTX instructions executed, by lane: "cp.async.cg.16", "ldmatrix.x4.trans", ...
        for p in tensors:
            if _is_bf16(p.dtype) and self.mem[p.name].dtype != np.uint16:
                raise TypeError(f"emulator: pass bfloat16 tensor {p.name} as a uint16 array of its bits")

    def run(self, grid, cluster=1, stagger: bool | tuple = False, resident: bool = False):
        """Runs the kernel over ``grid`` (x, y, z).  ``cluster``: the thread-block cluster's dims (an int: along
        x; or the kernel's ``lk.meta.cluster_dims``), as the launcher's __cluster_dims__: the blocks of a cluster
        are those of equal (x // cx, y // cy, z), of rank x % cx + (y % cy) cx, and run together in one
        scheduler (each with its own shared arena, mbarriers and queues).  ``stagger``: the i-th block scheduled
        together (a cluster's rank i; with ``resident``, the i-th of the grid) runs only every
        periods[i % len(periods)]-th scheduler round (True:
        periods 1, 2, 3, 4), so the blocks drift apart (rank 0's producer runs ahead and writes into its peers'
        stages early: a stage released to it too soon shows).  ``resident``: every block of the grid runs in
        one scheduler, as a persistent grid sized to the device is all resident at once, so blocks that wait on
        each other's flags in global memory (stream-K, T.row_reduce_store) can."""
        dims = (cluster,) if isinstance(cluster, int) else tuple(int(c) for c in cluster)
        dims += (1,) * (3 - len(dims))
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if any(g % c for g, c in zip(grid, dims)) or dims[2] != 1:
            raise ValueError(f"emulator: grid {grid} is not made of clusters {dims}")
        cx, cy, _ = dims
        self.grid, clusters = grid, []
        for z, y, x in np.ndindex(grid[2], grid[1] // cy, grid[0] // cx):
            cluster = []
            clusters.append([_Cta((x * cx + i, y * cy + j, z), i + j * cx, cluster) for j in range(cy)
                             for i in range(cx)])
        for ctas in [sum(clusters, [])] if resident else clusters:
            self.ctas = ctas  # the blocks scheduled together: thread g runs in block g // threads of them
            self.tma = []  # TMA loads issued this scheduler round, landing at its end (_land_tma)
            self.stores = []  # st.async stores to peers issued this round, landing at its end
            self._run_cluster((1, 2, 3, 4) if stagger is True else stagger)

    def _enter(self, cta):
        """Makes ``cta`` the block whose state (shared arena, mbarriers, queues) the running code sees."""
        self.cta, self.block, self.smem = cta, cta.block, cta.smem
        self.mbarriers, self.wgmma, self.bulk = cta.mbarriers, cta.wgmma, cta.bulk

    def _device_entry(self):
        """The kernel body the threads run: the device-entry attribute's body (host statements before it, such
        as tensor-map encodes, are the launcher's business)."""
        body = self.func.body
        while not isinstance(body, ts.AttrStmt):
            body = next(s for s in body.seq if isinstance(s, ts.AttrStmt))
        return body.body

    def _run_cluster(self, stagger=()):
        """Runs a cluster's blocks (one, without clusters) together: thread g is thread g % threads of block
        (rank) g // threads, so warps and warpgroups stay inside their block."""
        body = self._device_entry()
        threads = next(int(getattr(s, "def").extents[0]) for s in body.seq
                       if isinstance(s, ts.ScopeIdDefStmt) and "thread_id" in str(s))
        if len(self.ctas) > 1 and threads % 128:  # thread g's warp and warpgroup must stay in its block
            raise NotImplementedError(f"emulator: blocks of {threads} threads scheduled together (a cluster, a "
                                      f"resident grid): whole warpgroups only")
        self.threads = threads
        self.arrived = Counter()  # thread -> its barrier.cluster.arrives
        gens = {g: self._exec(body, {"tid": g % threads, "g": g, **self.scalars}) for g in range(threads * len(self.ctas))}
        at = dict.fromkeys(gens)  # where each thread waits: "sync", a collective instruction ("kind", key,
        go = dict.fromkeys(gens)  # operand), an mbarrier wait; the threads to resume, with what they receive
        live = Counter(g // threads for g in gens)
        rounds, held = 0, {}  # held: threads released whose block skips this round, with their answers
        while gens:
            rounds += 1
            for g, answer in go.items():
                if stagger and rounds % stagger[g // threads % len(stagger)]:
                    held[g], at[g] = answer, _HELD  # released, not yet run: at no wait
                    continue
                self._enter(self.ctas[g // threads])
                try:
                    at[g] = gens[g].send(answer)
                except StopIteration:
                    del gens[g], at[g]
                    live[g // threads] -= 1
                    self.cta.done = live[g // threads] == 0
            self._land_tma()
            go = self._resumable(at)
            go.update(held)
            held = {}
        for cta in self.ctas:
            self._enter(cta)
            for what, queues in (("wgmmas no wgmma.wait_group retired", self.wgmma),
                                 ("TMA stores no cp.async.bulk.wait_group waited for", self.bulk)):
                pending = sorted(u for u, q in queues.items() if q["open"] or q["groups"])
                if pending:
                    raise RuntimeError(f"emulator: block {self.block} ends with {what}, by {pending}")

    def _resumable(self, at) -> dict:
        """The waiting threads that go on, with their answers: the warps all of whose lanes are at one warp
        instruction (a shuffle, ldmatrix, mma.sync, __syncwarp) get its results, and so do the warpgroups (4
        aligned warps) all of whose 128 threads are at one wgmma instruction; threads waiting on an mbarrier
        phase that has completed go on, and those spinning on a global flag that has reached their count (they
        read it again when they run); those at a barrier.cluster.wait go on once every thread of their cluster
        that has not exited has arrived as often as they; those at a named barrier once the threads there and
        the ones past it by bar.arrive make its count; a block's threads once every one of them is at the
        block barrier (cta_sync)."""
        go, threads = {}, self.threads
        for table, width in ((_WARP, 32), (_WARPGROUP, 128)):
            for u in sorted({t // width for t, y in at.items() if isinstance(y, tuple) and y[0] in table}):
                lanes = [at.get(u * width + i) for i in range(width)]
                self._enter(self.ctas[u * width // threads])
                if all(isinstance(y, tuple) and y[0] in table for y in lanes):
                    instrs = {y[:2] for y in lanes}
                    if len(instrs) > 1:
                        raise NotImplementedError(
                            f"emulator: block {self.block} {'warp' if width == 32 else 'warpgroup'} {u}'s lanes are "
                            f"at different collective instructions (or give different uniform operands): "
                            f"{sorted(map(str, instrs))[:4]}")
                    kind, key = instrs.pop()
                    operands = [y[2] for y in lanes]
                    answers = _WARP[kind](self, key, operands) if width == 32 else \
                        table[kind](self, u % (threads // width), key, operands)
                    go.update(zip(range(u * width, u * width + width), answers))
        for t, y in at.items():
            if isinstance(y, tuple) and y[0] == "mbarrier.wait":
                self._enter(self.ctas[t // threads])
                if self._phase_done(*y[1:]):
                    go[t] = None
            elif isinstance(y, tuple) and y[0] == "flag.wait" and y[1][y[2]] >= y[3]:
                go[t] = None
        for t, y in at.items():  # exited threads count as arrived
            if isinstance(y, tuple) and y[0] == "cluster.wait" and \
                    all(self.arrived[g] >= y[1] for g in at if self.ctas[g // threads].cluster is
                        self.ctas[t // threads].cluster):
                go[t] = None
        bars = {(t // threads, *y[1:]) for t, y in at.items() if isinstance(y, tuple) and y[0] == "bar"}
        bars |= {(i, *bar) for i, cta in enumerate(self.ctas) for bar, n in cta.bar_arrived.items() if n}
        for bar in sorted(bars):  # bar.sync id, count: once count threads (whole warps) have reached barrier
            waiting = [t for t, y in at.items() if t // threads == bar[0] and y == ("bar", *bar[1:])]
            self._enter(self.ctas[bar[0]])  # id, waiting there or passing it with bar.arrive, they go on
            reached = len(waiting) + self.cta.bar_arrived[bar[1:]]
            if bar[2] % 32 or reached > bar[2]:
                raise RuntimeError(f"emulator: block {self.block}: {len(waiting)} threads at bar.sync and "
                                   f"{reached - len(waiting)} past bar.arrive {bar[1:]}")
            if reached == bar[2]:
                go.update(dict.fromkeys(waiting))
                self.cta.bar_arrived[bar[1:]] = 0
        for i in range(len(self.ctas)):
            block = [y for t, y in at.items() if t // threads == i]
            if block and all(y == "sync" for y in block):
                go.update(dict.fromkeys(t for t in at if t // threads == i))
        if go or not at or _HELD in at.values():
            return go
        waits = sorted({y if y == "sync" else y[0] if y[0] not in ("mbarrier.wait", "bar") else str(y[:3]) if
                        y[0] == "bar" else
                        f"mbarrier.wait(byte {y[1]}, parity {y[2]}: {self.ctas[t // threads].mbarriers.get(y[1])})"
                        for t, y in at.items()})
        blocks = sorted({self.ctas[t // threads].block for t in at})
        raise RuntimeError(f"emulator: block{'s' if len(blocks) > 1 else ''} {', '.join(map(str, blocks))} "
                           f"deadlock{'s' if len(blocks) == 1 else ''}: "
                           f"{'its' if len(blocks) == 1 else 'their'} {len(at)} threads wait at {waits} "
                           f"(a collective instruction some lanes skip, a barrier not every thread reaches, or "
                           f"an mbarrier phase that never completes)")

    # ---------------------------------------------------------------- mbarriers and TMA (sm_90a)

    def _mbarrier_init(self, addr: int, count: int):
        """``mbarrier.init.shared::cta.b64 [addr], count``: phase 0 in progress, ``count`` arrivals pending, a
        transaction count of 0."""
        if addr % 8 or not 0 < count < 2 ** 20:
            raise ValueError(f"emulator: mbarrier.init at shared byte {addr} with count {count}")
        self.mbarriers[addr] = {"count": count, "pending": count, "tx": 0, "phase": 0}

    def _mbarrier(self, addr: int, arrivals: int = 0, tx: int = 0):
        """An arrive-on of ``arrivals`` (mbarrier.arrive{.expect_tx}: first the transaction count grows by
        ``tx``) or a complete-tx of ``-tx`` bytes (a TMA load landing); the current phase completes once no
        arrival is pending and the transaction count is 0: the phase bit flips and the arrival count resets."""
        if addr not in self.mbarriers:
            raise RuntimeError(f"emulator: block {self.block}: an mbarrier operation at shared byte {addr}, "
                               f"which no mbarrier.init set up")
        bar = self.mbarriers[addr]
        bar["tx"] += tx
        bar["pending"] -= arrivals
        if bar["pending"] < 0:
            raise RuntimeError(f"emulator: block {self.block}: more arrivals than expected on the mbarrier at "
                               f"shared byte {addr} in phase {bar['phase']}")
        if bar["pending"] == 0 and bar["tx"] == 0:
            bar["phase"], bar["pending"] = bar["phase"] + 1, bar["count"]

    def _phase_done(self, addr: int, parity: int) -> bool:
        """``mbarrier.try_wait.parity``: whether the phase of parity ``parity`` has completed, i.e. the current
        (incomplete) phase's parity is the other one."""
        if addr not in self.mbarriers:
            raise RuntimeError(f"emulator: block {self.block}: a wait on shared byte {addr}, no mbarrier")
        return self.mbarriers[addr]["phase"] % 2 != parity

    def _tma_load(self, call, env):
        """``cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [tmap, {c0..}],
        [mbar]``: the tensor map's box at coordinates c0.. (innermost first; out-of-bounds elements zero),
        written to shared memory from ``dst`` (128-byte aligned) row after row of the box's inner dimension,
        each 16-byte chunk at its swizzled address (the map's swizzle: inner box rows of exactly the swizzle
        bytes); then the box's bytes complete on the mbarrier.  Issued here, landed at the round's end."""
        exprs, mods = _operands(call)
        dim = int(next(m for m in mods if m.endswith("d") and m[:-1].isdigit())[:-1])
        multicast = "multicast::cluster" in mods
        hinted = "L2::cache_hint" in mods
        if any((m.startswith("L2::") and m != "L2::cache_hint") or (m.startswith("multicast") and
                                                                   m != "multicast::cluster") for m in mods) \
                or len(exprs) != 3 + dim + multicast + hinted:
            raise NotImplementedError(f"emulator: cp.{'.'.join(m for m in mods if m)}")
        hint = self._cache_hint(exprs.pop(), env) if hinted else ""
        if multicast:  # .multicast::cluster, ctaMask: the box lands at the same offset in each CTA of the mask
            *exprs, mask = exprs  # and completes its bytes on each one's mbarrier at the same offset
            mask = int(self._eval(mask, env))
            if not 0 < mask < 1 << len(self.cta.cluster):
                raise ValueError(f"emulator: block {self.block}: a multicast TMA load to CTA mask {mask:#x} in a "
                                 f"cluster of {len(self.cta.cluster)}")
            targets = [c for c in self.cta.cluster if mask >> c.rank & 1]
        else:
            targets = [self.cta]
        dst, tmap, *coords, mbar = exprs
        spec = self._tensormap(tmap)
        coords = [int(self._eval(c, env)) for c in coords]
        d, bar = self._shared_offset(dst, env), self._shared_offset(mbar, env)
        data = _tma_box(spec, self.mem[spec["tensor"]], coords)
        span = 16 << spec["swizzle"] if spec["swizzle"] else None
        row = spec["box"][0] * _storage(spec["dtype"]).itemsize
        if d % 128 or (span and row != span) or row % 16 or len(spec["box"]) != dim:
            raise NotImplementedError(f"emulator: a TMA box to shared byte {d} of {row}-byte rows, swizzle {span}")
        self.tma.append((targets, d, data, span or 16, bar))
        self.ran[f"tma.load.{dim}d" + (f".swizzle{span}" if span else "") + ".multicast" * multicast + hint] += 1

    def _land_tma(self):
        """The TMA loads issued this round land, each 16-byte chunk at its swizzled address in each destination
        block (a multicast's every CTA of the mask), and complete their bytes on their mbarriers there."""
        for targets, d, data, span, bar in self.tma:
            for cta in targets:
                self._enter(cta)
                self._alive(cta, "a TMA load lands in")
                addrs = _swizzled(d + np.arange(0, data.size, 16), span)
                if self.smem is None or addrs.max() + 16 > self.smem.size:
                    raise IndexError(f"emulator: a TMA box of {data.size} bytes at shared byte {d} passes block "
                                     f"{self.block}'s arena")
                if any(d <= a < d + data.size for a in self.mbarriers):
                    raise RuntimeError(f"emulator: a TMA box at shared bytes [{d}, {d + data.size}) overwrites an "
                                       f"mbarrier")
                self.smem[addrs[:, None] + np.arange(16)] = data.reshape(-1, 16)
                self._mbarrier(bar, tx=-data.size)
        for cta, d, data, bar in self.stores:
            self._enter(cta)
            self._alive(cta, "an st.async lands in")
            if any(d <= a < d + data.size for a in self.mbarriers):
                raise RuntimeError(f"emulator: an st.async to shared byte {d} overwrites an mbarrier")
            self.smem[d:d + data.size] = data
            self._mbarrier(bar, tx=-data.size)
        self.tma, self.stores = [], []

    def _alive(self, cta, what: str):
        """Raises if block ``cta`` has exited: a peer's TMA load or remote arrive on it is undefined."""
        if cta.done:
            raise RuntimeError(f"emulator: {what} block {cta.block} (cluster rank {cta.rank}) after it exited")

    def _peer_address(self, call, env) -> int:
        """``tile_ops_peer_address(bar, peer)``: mapa.shared::cluster of ``bar``'s shared address in cluster rank
        ``peer``, here the rank above bit 24 of the offset (an offset added to it stays in that block)."""
        addr, peer = self._shared_offset(call.args[1], env), int(self._eval(call.args[2], env))
        if not 0 <= peer < len(self.cta.cluster):
            raise ValueError(f"emulator: block {self.block}: mapa to cluster rank {peer} of {len(self.cta.cluster)}")
        return peer << _PEER_SHIFT | addr

    def _remote_arrive(self, call, env):
        """``tile_ops_cluster_arrive_if(address, pred)``: where ``pred`` holds, mbarrier.arrive.shared::cluster.b64
        on a ``tile_ops_peer_address`` address: one arrival on that block's mbarrier (the peer may be this
        block)."""
        cluster_addr, pred = (int(self._eval(a, env)) for a in call.args[1:3])
        if not pred:
            return
        peer, addr = cluster_addr >> _PEER_SHIFT, cluster_addr & ((1 << _PEER_SHIFT) - 1)
        me = self.cta
        self._enter(me.cluster[peer])
        self._alive(self.cta, f"block {me.block} arrives remotely on")
        self._mbarrier(addr, arrivals=1)
        self._enter(me)
        self.ran["mbarrier.arrive.shared::cluster"] += 1

    def _st_async(self, call, env):
        """``tile_ops_cluster_put(p, bar, peer, v0[, v1])``: st.async.shared::cluster.mbarrier::complete_tx::bytes
        of one or two float32 values to the mapa address of ``p`` in cluster rank ``peer``, completing their bytes
        on the peer's mbarrier at ``bar``'s offset.  Asynchronous: it lands at the scheduler round's end, as a TMA
        load does, so a peer that reads its slots before waiting on the barrier reads the old values."""
        ptr, bar, peer, *values = _operands(call)[0]  # after the helper's name, before its source
        peer = int(self._eval(peer, env))
        if not 0 <= peer < len(self.cta.cluster):
            raise ValueError(f"emulator: block {self.block}: st.async to cluster rank {peer} of {len(self.cta.cluster)}")
        if str(ptr.args[0].source.dtype) != "float32" or len(values) not in (1, 2):
            raise NotImplementedError(f"emulator: st.async of {len(values)} {ptr.args[0].source.dtype} values")
        d = self._shared_offset(ptr, env)
        if d % (4 * len(values)):
            raise ValueError(f"emulator: block {self.block}: st.async of {4 * len(values)} bytes to shared byte {d}")
        data = np.array([self._eval(v, env) for v in values], np.float32).view(np.uint8)
        self.stores.append((self.cta.cluster[peer], d, data, self._shared_offset(bar, env)))
        self.ran[f"st.async.{'v2.' * (len(values) == 2)}f32"] += 1

    def _flag(self, call, env):
        """The grid's flags in the global workspace (int32 counters; global memory is sequentially consistent
        here, so the helpers' fences and acquire/release orders hold trivially):
        ``tile_ops_flag_signal(flags, i)``: red.add 1 to flag i;
        ``tile_ops_flag_wait(flags, i, count, reset)``: spin until flag i reaches count, then zero it if reset;
        ``tile_ops_row_stats_read(flags, i, done, count)``: atom.add 1 to flag done; the count-th adder zeroes
        both flags."""
        name = call.args[0].value
        ptr, *args = _operands(call)[0]
        mem, at = self._address(ptr, env, "global")
        flags = mem[at:].view(np.int32)
        args = [int(self._eval(a, env)) for a in args]
        if name == "tile_ops_flag_signal":
            flags[args[0]] += 1
        elif name == "tile_ops_flag_wait":
            flag, count, reset = args
            while flags[flag] < count:  # read again when the thread runs: a lane released with the others may
                yield ("flag.wait", flags, flag, count)  # find it reset by one that ran ahead of it
            if reset:
                flags[flag] = 0
        else:
            flag, done, count = args
            flags[done] += 1
            if flags[done] == count:
                flags[flag] = flags[done] = 0
        self.ran[name] += 1

    def _atomic_add(self, call, env):
        """``tile_ops_atomic_add{,2,4}(p, v...)``: float32 adds into consecutive global elements (each statement
        runs whole here, so atomically)."""
        ptr, *values = _operands(call)[0]
        mem, at = self._address(ptr, env, "global")
        if at % (4 * len(values)):
            raise ValueError(f"emulator: a {len(values)}-wide float32 atomic add at byte {at}, misaligned")
        target = mem[at:at + 4 * len(values)].view(np.float32)
        target += np.array([self._eval(v, env) for v in values], np.float32)
        self.ran[f"red.add.f32x{len(values)}"] += 1

    def _row_factor(self, call, env):
        """``tile_ops_row_factor(ws, at, stride, n, own)``: one row's softmax factor 2^(m_own - max) / sum over
        the n (max, sum) pairs at ws[at + j stride], in the helper's float32 order (an online max and sum)."""
        ptr, *args = _operands(call)[0]
        mem, base = self._address(ptr, env, "global")
        at, stride, n, own = (int(self._eval(a, env)) for a in args)
        ws, f = mem[base:].view(np.float32), np.float32
        top, own_max, total = f(-np.inf), f(-np.inf), f(0)
        with np.errstate(invalid="ignore", over="ignore"):
            for j in range(n):
                m, s = ws[at + j * stride], ws[at + j * stride + 1]
                nxt = max(top, m)
                total = (f(0) if nxt == -np.inf else total * np.exp2(top - nxt)) + \
                    (f(0) if m == -np.inf else s * np.exp2(m - nxt))
                top, own_max = nxt, m if j == own else own_max
            return f(0) if own_max == -np.inf else np.exp2(own_max - top) / total

    def _tma_store(self, call, env):
        """``cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group [tmap, {c0..}], [src]``: the tensor map's box
        at coordinates c0.., read from shared memory at ``src`` as a TMA load writes it (swizzled), its
        in-bounds elements stored to the tensor (the rest dropped).  Queued in this thread's bulk group: it
        reads shared memory and writes global memory when a cp.async.bulk.wait_group covers it."""
        exprs, mods = _operands(call)
        dim = int(next(m for m in mods if m.endswith("d") and m[:-1].isdigit())[:-1])
        add = "add" in mods  # cp.reduce.async.bulk.tensor...add: the box added into the tensor
        if any(m.startswith("L2::") or m.startswith("tile::") for m in mods) or len(exprs) != 2 + dim or \
                (not add and "reduce" in mods):
            raise NotImplementedError(f"emulator: cp.{'.'.join(m for m in mods if m)}")
        tmap, *coords, src = exprs
        spec = self._tensormap(tmap)
        coords, d = [int(self._eval(c, env)) for c in coords], self._shared_offset(src, env)
        span = 16 << spec["swizzle"] if spec["swizzle"] else 16
        row = spec["box"][0] * _storage(spec["dtype"]).itemsize
        if d % 128 or (span > 16 and row != span) or row % 16 or len(spec["box"]) != dim:
            raise NotImplementedError(f"emulator: a TMA store from shared byte {d} of {row}-byte rows, swizzle {span}")
        self._bulk_queue(env["tid"])["open"].append((spec, coords, d, span, add))
        self.ran[f"tma.{'reduce_add' if add else 'store'}.{dim}d" + (f".swizzle{span}" if span > 16 else "")] += 1

    def _bulk_queue(self, tid):
        return self.bulk.setdefault(tid, {"open": [], "groups": []})

    def _bulk_wait(self, tid, n):
        """``cp.async.bulk.wait_group{.read} n``: until at most ``n`` of this thread's bulk groups are pending:
        the older ones' TMA stores run now, in order."""
        groups = self._bulk_queue(tid)["groups"]
        while len(groups) > n:
            for spec, coords, d, span, add in groups.pop(0):
                size = _storage(spec["dtype"]).itemsize
                n_bytes = int(np.prod(spec["box"])) * size
                addrs = _swizzled(d + np.arange(0, n_bytes, 16), span)
                if addrs.max() + 16 > self.smem.size:
                    raise IndexError(f"emulator: a TMA store box of {n_bytes} bytes at shared byte {d} passes the arena")
                data = self.smem[addrs[:, None] + np.arange(16)].reshape(-1).view(_storage(spec["dtype"]))
                _tma_box_store(spec, self.mem[spec["tensor"]], coords, data, add)

    def _tensormap(self, ptr) -> dict:
        """The tensor map a TMA operand ``reinterpret(address_of(tmap_var))`` names (from ``tensormaps``)."""
        while isinstance(ptr, irx.Call):
            ptr = ptr.args[0]
        name = ptr.name if isinstance(ptr, px.Var) else None
        if name not in self.tensormaps:
            raise KeyError(f"emulator: TMA through {name}: pass the kernel's tensor maps (Emulator(..., "
                           f"tensormaps=lk.meta.tensormaps))")
        return self.tensormaps[name]

    # ---------------------------------------------------------------- wgmma (sm_90a, whole warpgroups)

    def _wgmma_queue(self, wg):
        return self.wgmma.setdefault(wg, {"open": [], "groups": []})

    def _wgmma_fence(self, wg, key, operands):
        """``wgmma.fence.sync.aligned``: orders the warpgroup's register and shared accesses before the
        wgmmas after it; nothing to wait for here."""
        return [None] * 128

    def _wgmma_issue(self, wg, key, operands):
        """``wgmma.mma_async``: queued (see _wgmma), to run when a wait_group retires its group."""
        self._wgmma_queue(wg)["open"].append((key, operands))
        return [None] * 128

    def _wgmma_commit(self, wg, key, operands):
        """``wgmma.commit_group.sync.aligned``: the warpgroup's uncommitted wgmmas become one group."""
        q = self._wgmma_queue(wg)
        q["groups"].append(q.pop("open"))
        q["open"] = []
        return [None] * 128

    def _wgmma_wait(self, wg, n, operands):
        """``wgmma.wait_group.sync.aligned n``: until at most ``n`` of the warpgroup's committed groups are
        pending: the older ones run now, in order, reading shared memory and the accumulators as they are."""
        groups = self._wgmma_queue(wg)["groups"]
        while len(groups) > n:
            for key, regs in groups.pop(0):
                _wgmma(self.smem, key, regs)
        return [None] * 128

    # ---------------------------------------------------------------- statements

    def _exec(self, s, env):
        if isinstance(s, ts.SeqStmt):
            for x in s.seq:
                yield from self._exec(x, env)
        elif isinstance(s, ts.AttrStmt):
            yield from self._exec(s.body, env)
        elif isinstance(s, ts.ScopeIdDefStmt):
            d = getattr(s, "def")
            vals = [env["tid"]] if "thread" in str(s) else self.block
            for v, x in zip(d.def_ids, vals):
                env[_key(v)] = x
        elif isinstance(s, ts.AllocBuffer) and s.buffer.scope() == "local":  # this thread's registers
            env[self._local(s.buffer)] = np.zeros(int(np.prod([int(x) for x in s.buffer.shape])), _storage(s.buffer.dtype))
        elif isinstance(s, ts.AllocBuffer):
            b = s.buffer
            if self.smem is None:  # the block's one shared arena, allocated by its first thread; bytes
                self.smem = self.cta.smem = np.full(int(b.shape[0]) * _storage(b.dtype).itemsize, 0xFF,
                                                    np.uint8)
        elif isinstance(s, ts.DeclBuffer) and ("local", str(s.data)) in env:  # a view of registers (as uint32:
            self.names[_key(s.buffer)] = str(s.data)  # a register A operand) reads and writes those registers
        elif isinstance(s, ts.DeclBuffer):
            pass  # views of shared memory and parameters are resolved at each access (_memory)
        elif isinstance(s, ts.For):
            for i in range(int(self._eval(s.min, env)), int(self._eval(s.min, env) + self._eval(s.extent, env))):
                env[_key(s.loop_var)] = i
                yield from self._exec(s.body, env)
        elif isinstance(s, ts.IfThenElse):
            if self._eval(s.condition, env):
                yield from self._exec(s.then_case, env)
            elif s.else_case is not None:
                yield from self._exec(s.else_case, env)
        elif isinstance(s, ts.BufferStore):
            env[_SHUFFLED] = []  # each shuffle waits for the warp's other lanes (_run_block), in _eval's order
            h = ("shuffles", _key(s))
            if h not in self.parsed:  # found once per statement (walking every store's expression is slow)
                self.parsed[h] = _shuffles(s.value)
            for call in self.parsed[h]:
                value, mask = self._eval(call.args[1], env), int(self._eval(call.args[2], env))
                env[_SHUFFLED].append((yield ("shfl", mask, value)))
            self._store(s.buffer, s.indices, self._eval(s.value, env), env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.cta_sync":
            yield "sync"
        elif isinstance(s, ts.Evaluate) and _op(s.value) in _CP_ASYNC:
            self._cp_async(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.createpolicy_fractional":
            self._createpolicy(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.ldmatrix":
            yield from self._issue_ldmatrix(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.mma":
            yield from self._issue_mma(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) in _NO_OPS:
            pass
        elif isinstance(s, ts.Bind):  # a let: visible to the statements after it
            env[_key(s.var)] = self._eval(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value).startswith("tirx.ptx.mbarrier_"):
            self._issue_mbarrier(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.mbarrier_wait":
            bar, parity = s.value.args  # a try_wait.parity loop: the thread waits until the phase completes
            yield ("mbarrier.wait", self._shared_offset(bar, env), int(self._eval(parity, env)) % 2)
        elif isinstance(s, ts.Evaluate) and _op(s.value) in ("tirx.ptx.cp_async_bulk_tensor_g2s_cluster",
                                                             "tirx.ptx.cp_async_bulk_tensor_g2s_cta"):
            self._tma_load(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) in ("tirx.ptx.cp_async_bulk_tensor_s2g",
                                                             "tirx.ptx.cp_reduce_async_bulk_tensor"):
            self._tma_store(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.cp_async_bulk_commit_group":
            q = self._bulk_queue(env["tid"])  # cp.async.bulk.commit_group: this thread's stores become a group
            q["groups"].append(q["open"])
            q["open"] = []
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.cp_async_bulk_wait_group":
            self._bulk_wait(env["tid"], int(self._eval(s.value.args[0], env)))
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.bar_sync_count":  # bar.sync id, count
            yield ("bar", int(self._eval(s.value.args[0], env)), int(self._eval(s.value.args[1], env)))
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.bar_arrive":  # bar.arrive id, count: counts
            bar = (int(self._eval(s.value.args[0], env)), int(self._eval(s.value.args[1], env)))  # at the barrier,
            self.cta.bar_arrived[bar] += 1  # does not wait
            self.ran["bar.arrive"] += 1
        elif isinstance(s, ts.Evaluate) and _op(s.value).startswith("tirx.ptx.wgmma_"):
            yield from self._issue_wgmma(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value in _NO_OP_HELPERS:
            pass
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.barrier_cluster_arrive":
            self.arrived[env["g"]] += 1  # barrier.cluster.arrive{.release}{.aligned}: does not wait
            self.ran["barrier.cluster.arrive"] += 1
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.barrier_cluster_wait":
            if not self.arrived[env["g"]]:  # barrier.cluster.wait{.acquire}{.aligned}: until every thread of
                raise RuntimeError(f"emulator: block {self.block} thread {env['tid']}: barrier.cluster.wait "
                                   f"without an arrive")  # the cluster has arrived as often as this one
            self.ran["barrier.cluster.wait"] += 1
            yield ("cluster.wait", self.arrived[env["g"]])
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value == "tile_ops_cluster_arrive_if":
            self._remote_arrive(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.warp_sync":
            yield ("syncwarp", None, None)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value in _ATOMIC_ADDS:
            self._atomic_add(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value in _FLAGS:
            yield from self._flag(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value == "tile_ops_cluster_put":
            self._st_async(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.func_call" and \
                s.value.args[0].value == "tile_ops_cluster_wait":  # a try_wait.parity loop at cluster scope
            bar, parity = _operands(s.value)[0]
            yield ("mbarrier.wait", self._shared_offset(bar, env), int(self._eval(parity, env)) % 2)
        else:
            raise NotImplementedError(f"emulator: {type(s).__name__}: {s}")

    def _createpolicy(self, call, env):
        """``createpolicy.fractional.L2::<priority>.b64 policy``: a policy (all of the lines, the default
        fraction 1.0) naming the priority, for the cache-hinted loads that read it (``_cache_hint``)."""
        (dst, *fraction), mods = _operands(call)
        priority = mods[1].removeprefix("L2::")
        if mods[0] != "fractional" or fraction or priority not in _POLICIES or any(mods[2:3]):
            raise NotImplementedError(f"emulator: createpolicy.{'.'.join(m for m in mods if m)}")
        self._store(dst.source, dst.indices, np.uint64(_POLICIES[priority]), env)

    def _cache_hint(self, policy, env) -> str:
        """The L2 priority a ``.L2::cache_hint`` load's policy operand names: one createpolicy made (the
        cache is not modelled: a hint changes no value), as a suffix for ``ran``."""
        value = int(self._eval(policy, env))
        if value not in _POLICY_NAMES:
            raise ValueError(f"emulator: block {self.block}: a .L2::cache_hint load's policy {value:#x} is no "
                             f"createpolicy's")
        return "." + _POLICY_NAMES[value]

    def _cp_async(self, call, env):
        """``cp.async.{ca,cg}.shared.global{.L2::cache_hint} [dst], [src], cp_size[, src_size][, policy]``:
        copies ``cp_size`` bytes (4, 8 or 16; 16 for .cg) from global to shared memory, both addresses aligned
        to it; the bytes from ``src_size`` on are zero-filled (and not read).  Done at issue:
        commit_group/wait_group have nothing to wait for."""
        exprs, mods = _operands(call)
        hint = self._cache_hint(exprs.pop(), env) if "L2::cache_hint" in mods else ""
        dst, src, cp_size, *src_size = exprs
        n = int(self._eval(cp_size, env))
        m = int(self._eval(src_size[0], env)) if src_size else n
        (shared, d), (glob, g) = self._address(dst, env, "shared"), self._address(src, env, "global")
        if n not in (4, 8, 16) or ("cg" in _op(call) and n != 16) or not 0 <= m <= n or d % n or g % n:
            raise ValueError(f"emulator: {_op(call)} of {n} bytes ({m} read) from byte {g} to shared byte {d}")
        _span(shared, d, n)[:] = 0
        _span(shared, d, m)[:] = _span(glob, g, m)
        self.ran[f"cp.async.{'cg' if 'cg' in _op(call) else 'ca'}.{n}" + hint + (" zero-filled" if m < n else "")] += 1

    def _issue_ldmatrix(self, call, env):
        """This lane's part of an ldmatrix (see _ldmatrix): its row address out, its words into the registers."""
        (*regs, ptr), mods = _operands(call)
        if mods[:4] != ["sync", "aligned", "m8n8", f"x{len(regs)}"] or mods[5:7] != ["shared", "b16"]:
            raise NotImplementedError(f"emulator: ldmatrix{'.'.join(mods)}")
        _, addr = self._address(ptr, env, "shared")
        self.ran[f"ldmatrix.x{len(regs)}" + (".trans" if mods[4] == "trans" else "")] += 1
        words = yield ("ldmatrix", (len(regs), mods[4] == "trans"), addr)
        for r, w in zip(regs, words):
            self._store(r.source, r.indices, w, env)

    def _issue_mma(self, call, env):
        """This lane's part of an mma.sync (see _mma): registers D (4 f32), A (4 b32), B (2 b32), C (4 f32)."""
        regs, mods = _operands(call)
        ab = mods[6]
        if mods[:9] != ["sync", "aligned", "m16n8k16", "row", "col", "f32", ab, ab, "f32"] or ab not in ("f16", "bf16"):
            raise NotImplementedError(f"emulator: mma.{'.'.join(mods)}")
        a, b, c = ([self._eval(r, env) for r in regs[i:j]] for i, j in ((4, 8), (8, 10), (10, 14)))
        self.ran[f"mma.{ab}"] += 1
        d = yield ("mma", ab, (a, b, c))
        for r, v in zip(regs[:4], d):
            self._store(r.source, r.indices, v, env)

    def _issue_mbarrier(self, call, env):
        """``mbarrier.init`` / ``mbarrier.arrive{.expect_tx}.shared::cta.b64`` (see _mbarrier_init, _mbarrier)."""
        (ptr, *rest), mods = _operands(call)
        addr, values = self._shared_offset(ptr, env), [int(self._eval(x, env)) for x in rest]
        if "shared::cluster" in mods or any(m.startswith("multicast") for m in mods):
            raise NotImplementedError(f"emulator: mbarrier.{'.'.join(m for m in mods if m)}")
        if mods[0] == "init":
            self._mbarrier_init(addr, *values)
        elif mods[0] == "arrive" and "expect_tx" in mods:
            self._mbarrier(addr, arrivals=1, tx=values[0])
        elif mods[0] == "arrive" and len(values) <= 1:
            self._mbarrier(addr, arrivals=values[0] if values else 1)
        else:
            raise NotImplementedError(f"emulator: mbarrier.{'.'.join(m for m in mods if m)}")
        self.ran["mbarrier." + ".".join(m for m in mods[:2] if m)] += 1

    def _issue_wgmma(self, call, env):
        """This thread's part of a warpgroup-wide wgmma instruction (mma_async, fence, commit_group, wait_group):
        the uniform operands (descriptors, scale-d, immediates; wait_group's N) as the key, its accumulator
        registers as its operand."""
        h = _key(call)
        if h not in self.parsed:  # the operands as Python lists, once per call (TVM containers are slow)
            self.parsed[h] = _operands(call)
        exprs, mods = self.parsed[h]
        wg_kind = "wgmma." + mods[0]
        if mods[0] == "mma_async":
            ab, n = mods[5], int(mods[3].split("n")[1].split("k")[0])
            rs = _op(call) in ("tirx.ptx.wgmma_f16_rs", "tirx.ptx.wgmma_bf16_rs")
            if _op(call) not in ("tirx.ptx.wgmma_f16_ss", "tirx.ptx.wgmma_bf16_ss") and not rs or \
                    mods[4] != "f32" or mods[3] != f"m64n{n}k16" or len(exprs) != n // 2 + (9 if rs else 7):
                raise NotImplementedError(f"emulator: {_op(call)} wgmma.{'.'.join(mods)}")
            if rs:  # A: this thread's four b32 registers, read at the issue; then B's descriptor, scale-d, immediates
                uniform = [int(self._eval(x, env)) for x in exprs[n // 2 + 4:]]
                self.ran[f"wgmma.m64n{n}k16.{ab}.rs" + ".trans-b" * uniform[4]] += 1
                words = [int(self._eval(x, env)) & 0xFFFFFFFF for x in exprs[n // 2:n // 2 + 4]]
                yield (wg_kind, ((n, ab, "rs"), *uniform), (self._registers(h, exprs[:n // 2], env), words))
                return
            uniform = [int(self._eval(x, env)) for x in exprs[n // 2:]]
            key = ((n, ab), *uniform)  # descriptors A, B, scale-d, imm-scale-a, -b, imm-trans-a, -b
            self.ran[f"wgmma.m64n{n}k16.{ab}" + ".trans-a" * uniform[5] + ".trans-b" * uniform[6]] += 1
            yield (wg_kind, key, self._registers(h, exprs[:n // 2], env))
        elif mods[0] in ("fence", "commit_group", "wait_group"):
            yield (wg_kind, int(self._eval(exprs[0], env)) if exprs else None, None)
        else:
            raise NotImplementedError(f"emulator: wgmma.{'.'.join(mods)}")

    def _registers(self, h, loads, env):
        """(float32 view of a register array, indices) of the accumulator registers ``loads`` of call ``h``: one
        float32 local buffer at constant indices."""
        if ("registers", h) not in self.parsed:
            bufs = {self._local(x.source) for x in loads}
            if len(bufs) != 1 or any(str(x.source.dtype) != "float32" for x in loads) or \
                    not all(isinstance(x.indices[0], px.IntImm) for x in loads):
                raise NotImplementedError(f"emulator: wgmma accumulators {loads[0]}..: not one f32 array")
            self.parsed[("registers", h)] = bufs.pop(), np.array([int(x.indices[0].value) for x in loads])
        buf, idx = self.parsed[("registers", h)]
        return env[buf].view(np.float32), idx

    # ---------------------------------------------------------------- memory

    def _name(self, buf) -> str:
        """The name of ``buf``'s data var (a buffer's data var is no stable handle; printing it is slow)."""
        h = _key(buf)
        if h not in self.names:
            self.names[h] = str(buf.data)
        return self.names[h]

    def _local(self, buf):
        """A local buffer's key in its thread's env."""
        return ("local", self._name(buf))

    def _param(self, buf) -> str:
        return self._name(buf).split(".")[0]

    def _memory(self, buf, indices, env):
        """(numpy array, index) of a load/store: flat for registers (a register array viewed as ``buf``'s
        dtype, e.g. a fragment's halves as b32 words) and shared memory, n-d for parameters."""
        idx = [self._eval(i, env) for i in indices]
        if self._local(buf) in env:
            return env[self._local(buf)].view(_storage(buf.dtype)), np.asarray(idx[0])
        if self._param(buf) in self.mem:
            return self.mem[self._param(buf)], tuple(np.asarray(i) for i in idx)
        return self.smem.view(_storage(buf.dtype)), np.asarray(idx[0]) + int(self._eval(buf.elem_offset, env))

    def _load(self, buf, indices, env):
        mem, at = self._memory(buf, indices, env)
        return _bf16_values(mem[at]) if _is_bf16(buf.dtype) else mem[at].copy()

    def _store(self, buf, indices, value, env):
        mem, at = self._memory(buf, indices, env)
        mem[at] = _bf16_bits(value) if _is_bf16(buf.dtype) else value

    def _address(self, ptr, env, space: str):
        """(byte array, byte offset) a pointer operand points to: ``address_of(buf[i])`` in a global tensor, or
        ``cvta_generic_to_shared(address_of(buf[i]))`` in the shared arena; ``space`` is the one expected."""
        shared = _op(ptr) == "tirx.cuda.cvta_generic_to_shared"
        load = ptr.args[0].args[0] if shared else ptr.args[0]
        if _op(ptr.args[0] if shared else ptr) != "tirx.address_of" or space != ("shared" if shared else "global"):
            raise NotImplementedError(f"emulator: a {space} address: {ptr}")
        buf, idx = load.source, [int(self._eval(i, env)) for i in load.indices]
        size = _storage(buf.dtype).itemsize
        if shared:
            return self.smem, (idx[0] + int(self._eval(buf.elem_offset, env))) * size
        tensor = self.mem[self._param(buf)]
        return tensor.reshape(-1).view(np.uint8), int(np.ravel_multi_index(idx, tensor.shape)) * size

    def _shared_offset(self, ptr, env) -> int:
        """The shared-arena byte offset a pointer into shared memory names: ``cvta_generic_to_shared(
        address_of(buf[i]))`` (a shared-window address: the arena starts at 0 here) or ``address_of(buf[i])``
        (a generic pointer), ``buf`` a view of the block's shared arena."""
        inner = ptr.args[0] if _op(ptr) == "tirx.cuda.cvta_generic_to_shared" else ptr
        load = inner.args[0] if _op(inner) == "tirx.address_of" else None
        if not isinstance(load, irx.TensorLoad) or self._param(load.source) in self.mem or \
                self._local(load.source) in env:
            raise NotImplementedError(f"emulator: a shared address: {ptr}")
        return (int(self._eval(load.indices[0], env)) + int(self._eval(load.source.elem_offset, env))) * \
            _storage(load.source.dtype).itemsize

    # ---------------------------------------------------------------- expressions

    def _eval(self, e, env):
        if type(e) in _BIN:  # the common cases first: index math is most of the work
            return _BIN[type(e)](self._eval(e.a, env), self._eval(e.b, env))
        if isinstance(e, px.Var):
            return env[_key(e)]
        if isinstance(e, px.IntImm):
            return int(e.value)  # Python ints
        if isinstance(e, (int, float)):
            return e
        if isinstance(e, px.FloatImm):
            return _values(e.ty.dtype).type(e.value)
        if isinstance(e, px.Not):
            return np.logical_not(self._eval(e.a, env))
        if isinstance(e, px.Cast):
            v = np.asarray(self._eval(e.value, env)).astype(_values(e.ty.dtype))
            return _bf16_values(_bf16_bits(v)) if _is_bf16(e.ty.dtype) else v
        if isinstance(e, px.Ramp):
            return self._eval(e.base, env) + np.arange(int(e.lanes)) * self._eval(e.stride, env)
        if isinstance(e, px.Broadcast):
            return np.full(int(e.lanes), self._eval(e.value, env))
        if isinstance(e, irx.TensorLoad):
            return self._load(e.source, e.indices, env)
        if _op(e) == "tirx.tvm_warp_shuffle_xor":
            return env[_SHUFFLED].pop(0)  # exchanged before the statement ran (_exec)
        if _op(e).endswith(".if_then_else"):
            c, a, b = e.args
            return self._eval(a, env) if self._eval(c, env) else self._eval(b, env)
        if _op(e) == "tirx.cuda.cvta_generic_to_shared":  # a shared-window address (a descriptor's start)
            return self._shared_offset(e, env)
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_cluster_rank":  # %cluster_ctarank
            return self.cta.rank
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_peer_address":  # mapa
            return self._peer_address(e, env)
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_grid_x":  # gridDim.x
            return self.grid[0]
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_row_factor":
            return self._row_factor(e, env)
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_warp_uniform":  # __shfl_sync(v, 0)
            return self._eval(e.args[1], env)  # of a value uniform over the warp by construction: the value
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_once":  # the identity
            return self._eval(e.args[1], env)
        if isinstance(e, px.Select):  # both sides evaluated, as a SEL instruction's operands are
            with np.errstate(invalid="ignore", over="ignore"):
                t, f = self._eval(e.true_value, env), self._eval(e.false_value, env)
            return np.where(self._eval(e.condition, env), t, f)[()]
        if isinstance(e, (px.Div, px.Mod)) and "int" in str(e.ty.dtype):  # C's / and %: toward zero
            x, y = self._eval(e.a, env), self._eval(e.b, env)
            q = np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))
            return q if isinstance(e, px.Div) else x - q * y
        if isinstance(e, px.Div):
            return np.true_divide(self._eval(e.a, env), self._eval(e.b, env))
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_exp2":  # ex2.approx.ftz: exact
            y = np.exp2(np.asarray(self._eval(e.args[1], env), np.float32))  # here; under 2^-126 flushed to 0
            return np.where(y < np.float32(2.0 ** -126), np.float32(0), y)
        if _op(e) == "tirx.pow":
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                x, y = (np.asarray(self._eval(a, env), _values(e.ty.dtype)) for a in e.args)
                return np.power(x, y)[()]
        if _op(e) in _MATH:  # libdevice's float32 functions, to within their few ulp
            with np.errstate(divide="ignore", invalid="ignore"):
                x = self._eval(e.args[0], env)
                return _MATH[_op(e)](np.asarray(x, _values(e.ty.dtype)))[()]
        raise NotImplementedError(f"emulator: {type(e).__name__}: {e}")


_MATH = {"tirx.tanh": np.tanh, "tirx.log": np.log, "prim.log2": np.log2, "tirx.exp": np.exp, "tirx.exp2": np.exp2,
         "tirx.sqrt": np.sqrt, "tirx.rsqrt": lambda x: 1 / np.sqrt(x), "tirx.log1p": np.log1p,
         "tirx.sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tirx.erf": np.vectorize(math.erf, otypes=[np.float32]),
         "tirx.sin": np.sin, "tirx.cos": np.cos, "tirx.tan": np.tan, "tirx.atan": np.arctan, "tirx.floor": np.floor,
         "prim.ceil": np.ceil, "tirx.round": np.rint, "tirx.trunc": np.trunc}
_WARPGROUP = {"wgmma.fence": Emulator._wgmma_fence, "wgmma.mma_async": Emulator._wgmma_issue,
              "wgmma.commit_group": Emulator._wgmma_commit, "wgmma.wait_group": Emulator._wgmma_wait}
