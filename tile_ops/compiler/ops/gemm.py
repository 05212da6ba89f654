"""``T.gemm(A, B, C)``: C += op(A) @ op(B) on tensor cores.  The instruction fixes C's register layout (and a
fragment A's): wgmma on sm_90a where the operands allow it (warpgroups, swizzled panels), else mma.sync over
a grid of warps (``policy``).  Lowered by the target's instructions: ``targets/sm90.wgmma_gemm``,
``targets/sm80.mma_gemm``."""

from __future__ import annotations

from ...lang.ir import Gemm, error
from ..layout import MmaAccumLayout, MmaWarps, SharedLayout, in_swizzled_panels
from ..exprs import dtype_bits
from ..targets import MMA_TYPES, sm80, sm90
from . import TileOp, tile_op

POLICIES = ("square", "full_row", "full_col")


@tile_op(Gemm)
class GemmOp(TileOp):
    def reads(self, node, buffers):
        return [node.A, node.B] + ([] if node.clear_accum else [node.C])

    def writes(self, node):
        return [node.C]

    def constrain(self, inf, g):
        M, N = g.C.shape if len(g.C.shape) == 2 else (None, None)
        if g.C.scope != "fragment" or M is None:
            raise error(g.loc, f"T.gemm: C must be a 2-D fragment, got {g.C.scope} {list(g.C.shape)}")
        policy = "full_row" if g.A.scope == "fragment" else g.policy
        if policy not in POLICIES:
            raise error(g.loc, f"T.gemm: unknown policy {g.policy!r}; accepted: {', '.join(POLICIES)}")
        if g.A.scope == "fragment":
            check_fragment_a(g)
        check_operands(g)
        threads = inf.kernel.threads
        if inf.wgmma and uses_wgmma(g, threads):
            inf.assign(g.C, MmaAccumLayout.for_wgmma(M, N, threads, splits_n(g, threads)), g)
            if g.A.scope == "fragment":  # wgmma's register A: the accumulator layout of (M, K), rows as C's
                inf.assign(g.A, MmaAccumLayout.for_wgmma(M, g.A.shape[1], threads), g)
            return
        warps = MmaWarps.choose(M, N, inf.warps, policy)
        if warps is None:
            raise error(g.loc, f"T.gemm: a {M}x{N} accumulator cannot be tiled by {inf.warps} warps with m16n8 "
                               f"mma.sync tiles (policy {policy}); M must be a multiple of 16*warps_m and N of 8*warps_n")
        inf.assign(g.C, MmaAccumLayout(warps), g)
        if g.A.scope == "fragment":
            inf.assign(g.A, MmaAccumLayout(MmaWarps(M, g.A.shape[1], warps.wm, 1)), g)

    def lower(self, lw, g, vm):  # (its operands were checked by layout inference, on every path)
        if is_wgmma(lw, g):
            return sm90.wgmma_gemm(lw, g)
        sm80.mma_gemm(lw, g)


def is_wgmma(lw, g: Gemm) -> bool:
    lay = lw.infer.layouts.get(g.C)
    return isinstance(lay, MmaAccumLayout) and lay.wgmma


def check_fragment_a(g: Gemm):
    """A register A operand is the (M, K) accumulator layout read 16 columns per k step, as
    16-bit pairs: both mma.sync and wgmma need it untransposed, 16-bit and K a multiple of 16."""
    A = g.A
    if g.transpose_A:
        raise error(g.loc, f"T.gemm: the fragment A operand {A.name} cannot be transposed (transpose_A=True "
                           f"needs A in shared memory)")
    if A.dtype not in MMA_TYPES:
        raise error(g.loc, f"T.gemm: the fragment A operand {A.name} has dtype {A.dtype}; register A operands "
                           f"are float16 or bfloat16 (T.copy a float32 fragment into one to cast it)")
    if len(A.shape) != 2 or A.shape[1] % 16:
        raise error(g.loc, f"T.gemm: the fragment A operand {A.name}{list(A.shape)} must be (M, K) with K a "
                           f"multiple of 16 (registers feed the tensor cores 16 columns per k step)")


def check_operands(g: Gemm) -> None:
    """What every T.gemm needs, whichever instruction runs it: 16-bit A and B of one dtype, an fp32
    accumulator, B shared and A shared or a fragment, shapes that agree, K a multiple of 16."""
    A, B, C = g.A, g.B, g.C
    for x in (A, B):
        if x.dtype not in MMA_TYPES:
            raise error(g.loc, f"T.gemm: operand {x.name} has dtype {x.dtype}; accepted: float16 or bfloat16")
    if A.dtype != B.dtype:
        raise error(g.loc, f"T.gemm: A and B dtypes differ ({A.dtype} vs {B.dtype})")
    if C.dtype != "float32":
        raise error(g.loc, f"T.gemm: the accumulator {C.name} must be float32, got {C.dtype}")
    if B.scope != "shared" or A.scope not in ("shared", "fragment"):
        raise error(g.loc, "T.gemm: B must be a shared tile and A a shared tile or a fragment")
    M, N = C.shape
    Ka, Ma = (A.shape[0], A.shape[1]) if g.transpose_A else (A.shape[1], A.shape[0])
    Kb, Nb = (B.shape[1], B.shape[0]) if g.transpose_B else (B.shape[0], B.shape[1])
    if (Ma, Nb) != (M, N) or Ka != Kb:
        raise error(g.loc, f"T.gemm: shapes do not match: A{list(A.shape)} B{list(B.shape)} C{list(C.shape)} "
                           f"(transpose_A={g.transpose_A}, transpose_B={g.transpose_B})")
    if Ka % 16:
        raise error(g.loc, f"T.gemm: K={Ka} must be a multiple of 16 (the m16n8k16 / m64nNk16 instructions)")


def splits_n(g: Gemm, threads: int) -> bool:
    """Several warpgroups each take N / warpgroups columns of all M rows: by policy="full_col", or by "square"
    where M is too short to stack them (a 64-row tile over two).  A register A operand would have to be whole
    in every warpgroup, so those stack along M."""
    n_wg = threads // 128
    if n_wg < 2 or g.A.scope != "shared":
        return False
    return g.policy == "full_col" or g.policy == "square" and g.C.shape[0] % (64 * n_wg) != 0


def uses_wgmma(g: Gemm, threads: int) -> bool:
    """Whether a gemm can be one wgmma per warpgroup and 64-row slice: 16-bit operands, B (and A
    unless it is a register fragment) in descriptor-readable (swizzled panel) shared layouts,
    warpgroups stacked along M with N <= 256, or split along N (``splits_n``) into column blocks of
    at most 256 that start on a B descriptor boundary (a whole swizzle panel when N is B's
    contiguous dim, any 8 rows when K is)."""
    M, N = g.C.shape
    Ka = g.A.shape[0] if g.transpose_A else g.A.shape[1]
    n_wg = threads // 128
    ok = (g.A.scope in ("shared", "fragment") and g.B.scope == "shared" and g.A.dtype == g.B.dtype
          and g.A.dtype in MMA_TYPES and g.C.dtype == "float32" and threads % 128 == 0
          and N % 8 == 0 and Ka % 16 == 0 and all(in_swizzled_panels(t) for t in (g.A, g.B) if t.scope == "shared"))
    if not ok:
        return False
    if not splits_n(g, threads):
        return g.policy != "full_col" and M % (64 * n_wg) == 0 and N <= 256
    wn = N // n_wg
    b_panel = SharedLayout(*g.B.shape, dtype_bits(g.B.dtype)).panel
    return M % 64 == 0 and N % (8 * n_wg) == 0 and wn <= 256 and (g.transpose_B or wn % b_panel == 0)
