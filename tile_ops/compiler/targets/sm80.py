"""The Ampere-class instructions (every target): ``cp.async`` tile loads and ``ldmatrix`` + ``mma.sync``
gemms over a grid of warps."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..cuda import emit_ptx, l2_cache_hint
from ..exprs import dtype_bits, pad
from ..layout import MmaAccumLayout
from . import MMA_TYPES


def cp_async_tile(lw, node, s_start, d_start, extents, stage, vec: int, asynchronous: bool):
    """``vec`` elements a cp.async, zero-filled past the global tensor's edges, into ``stage`` of the tile;
    unless ``asynchronous`` (a pipeline's load, committed by it), committed and waited for here."""
    sb, db = node.src.buffer, node.dst.buffer
    t = lw.shared[db]
    bits = dtype_bits(sb.dtype)
    hint, policy = l2_cache_hint(node.eviction)

    def one(idx):
        g = [a + b for a, b in zip(s_start, pad(idx, s_start))]
        pred = lw.in_bounds(sb, s_start, idx)
        if pred is not None:  # out of bounds: copy 0 bytes (zero-fill) from a safe address
            g = [tirx.if_then_else(pred, x, 0) for x in g]
        d = [a + b for a, b in zip(d_start, pad(idx, d_start))]
        dst_ptr = t.view.ptr_to([lw.shared_offset(t, d, stage)])
        src_ptr = lw.global_ptr(sb, g)
        nbytes = vec * bits // 8
        chain = f"cp.async.{'cg' if nbytes == 16 else 'ca'}.shared.global{hint}"
        size = [tirx.Cast("uint32", tirx.if_then_else(pred, nbytes, 0))] if pred is not None else []
        if policy and not size:  # spelt out: the policy is the operand after src-size
            size = [tirx.const(nbytes, "uint32")]
        T.evaluate(TS.ptx[chain](dst_ptr, src_ptr, nbytes, *size, *policy))

    lw.flat_loop(extents, one, vec)
    if not asynchronous:
        emit_ptx("cp.async.commit_group")
        emit_ptx("cp.async.wait_group", 0)


def mma_gemm(lw, g):
    """Per 16-wide k step: A's and B's warp tiles by ldmatrix (``.trans`` where the tile is stored the other
    way round; A from its registers when it is a fragment), then one m16n8k16 mma.sync per 16x8 piece."""
    A, B, C = g.A, g.B, g.C
    Ka = A.shape[0] if g.transpose_A else A.shape[1]
    lay: MmaAccumLayout = lw.infer.layouts[C]
    w = lay.w
    if g.clear_accum:
        with T.unroll(0, lay.local_size) as r:
            T.buffer_store(lw.frags[C], tirx.const(0.0, "float32"), [r])
    mi_n, ni_n = w.WM // 16, w.WN // 8
    b_x4 = w.WN % 16 == 0
    a_regs = T.alloc_local([mi_n * 4], "uint32")
    b_regs = T.alloc_local([ni_n * 2], "uint32")
    IRBuilder.name("a_regs", a_regs)
    IRBuilder.name("b_regs", b_regs)
    lane = tirx.floormod(lw.tid, 32)
    wr, wc = lay.warp_rc(lw.tid)
    m_base, n_base = wr * w.WM, wc * w.WN
    el = MMA_TYPES[A.dtype]
    with T.unroll(0, Ka // 16) as kk:
        k0 = kk * 16
        if A.scope == "shared":
            ta = lw.shared[A]
            for mi in range(mi_n):
                m0 = m_base + mi * 16
                if not g.transpose_A:  # (M, K) tile, K contiguous
                    row, col = m0 + tirx.floormod(lane, 16), k0 + tirx.floordiv(lane, 16) * 8
                    trans = ""
                else:  # (K, M) tile
                    row = k0 + tirx.floordiv(lane, 16) * 8 + tirx.floormod(lane, 8)
                    col = m0 + tirx.floormod(tirx.floordiv(lane, 8), 2) * 8
                    trans = ".trans"
                ptr = ta.view.ptr_to([lw.shared_offset(ta, [row, col], lw.stage(A))])
                T.evaluate(TS.ptx[f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16"](
                    *[a_regs[mi * 4 + q] for q in range(4)], ptr))
        tb = lw.shared[B]
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
            ptr = tb.view.ptr_to([lw.shared_offset(tb, [row, col], lw.stage(B))])
            n_regs = 4 if b_x4 else 2
            T.evaluate(TS.ptx[f"ldmatrix.sync.aligned.m8n8.x{n_regs}{trans}.shared.b16"](
                *[b_regs[nj * 2 + q] for q in range(n_regs)], ptr))
        a_words = lw.frags[A].view("uint32") if A.scope == "fragment" else None
        a_lay = lw.infer.layouts.get(A)
        for mi in range(mi_n):
            if a_words is not None:  # A from registers: the accumulator layout of (M, K) is the A layout
                a_ops = [a_words[x] for x in a_lay.a_operand_words(mi, kk)]
            else:
                a_ops = [a_regs[mi * 4 + q] for q in range(4)]
            for nj in range(ni_n):
                c = [lw.frags[C][(mi * ni_n + nj) * 4 + e] for e in range(4)]
                T.evaluate(TS.ptx[f"mma.sync.aligned.m16n8k16.row.col.f32.{el}.{el}.f32"](
                    *c, *a_ops, b_regs[nj * 2], b_regs[nj * 2 + 1], *c))
