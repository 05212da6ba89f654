"""Layout inference: give every fragment a layout, driven by the gemm instruction chosen and
propagated through copies, reductions and T.Parallel, to a fixed point."""

from __future__ import annotations

import tvm

from ..lang import ir
from ..lang.ir import Copy, For, Gemm, Parallel, Reduce, RowSoftmaxStore, Store, error
from .exprs import collect_loads
from .layout import BlockedLayout, MmaAccumLayout, MmaRowLayout, MmaWarps, SharedLayout


def walk(body):
    for node in body:
        yield node
        if isinstance(node, (For, Parallel, RowSoftmaxStore)):
            yield from walk(node.body)


def dtype_bits(dtype: str) -> int:
    return tvm.runtime.DataType(dtype).bits


class LayoutInference:
    def __init__(self, kernel: ir.Kernel, buffers: dict, wgmma: bool = False):
        self.kernel, self.buffers, self.wgmma = kernel, buffers, wgmma
        self.warps = kernel.threads // 32
        self.layouts: dict = {}  # TileBuffer -> FragmentLayout
        self.origin: dict = {}  # TileBuffer -> node that fixed its layout
        self.parallel: dict = {}  # id(Parallel node) -> anchor layout or None

    def run(self) -> "LayoutInference":
        nodes = list(walk(self.kernel.body))
        for node in nodes:  # the gemm instruction fixes accumulators (and fragment A operands) first
            if isinstance(node, Gemm):
                self.gemm(node)
        for _ in range(4):
            changed = False
            for node in nodes:
                changed |= self.propagate(node)
            if not changed:
                break
        for node in nodes:  # a source no gemm laid out would get a blocked layout: rows spread over threads
            if isinstance(node, Reduce) and node.src not in self.layouts:
                raise _not_accumulator(node)
        for group in self.unlaid_groups(nodes):  # one default per group: a copy or loop pairs their registers
            first = group[0]
            lay = BlockedLayout.make(first.shape, self.kernel.threads, max(dtype_bits(b.dtype) for b in group))
            if lay is None:
                raise error(first.loc, f"fragment {first.name}{list(first.shape)} cannot be split evenly over "
                                       f"{self.kernel.threads} threads")
            for buf in group:
                self.assign(buf, lay, buf)
        for node in nodes:
            if isinstance(node, Parallel):
                if id(node) not in self.parallel:
                    self.parallel[id(node)] = self.anchor(node)
                self.check_rows(node, self.parallel[id(node)])
        return self

    def unlaid_groups(self, nodes) -> list:
        """The fragments no gemm laid out, in groups that must share a layout: those a T.copy joins or one
        T.Parallel indexes in full.  A default per fragment would follow its own dtype (16 bytes a thread:
        4 floats, 8 halves), and a cast copy between two would pair registers holding other elements."""
        unlaid = [b for b in self.kernel.allocs if b.scope == "fragment" and b not in self.layouts]
        parent = {b: b for b in unlaid}

        def root(b):
            while parent[b] is not b:
                b = parent[b]
            return b

        for node in nodes:
            if isinstance(node, Copy):
                joined = [node.src.buffer, node.dst.buffer]
            elif isinstance(node, Parallel):
                joined = [b for b, kind in self.fragments_in(node) if kind == "full"]
            else:
                continue
            joined = [b for b in joined if b in parent]
            for b in joined[1:]:
                parent[root(b)] = root(joined[0])
        groups: dict = {}
        for b in unlaid:
            groups.setdefault(root(b), []).append(b)
        return list(groups.values())

    def check_rows(self, node: Parallel, anchor) -> None:
        """A 1-D fragment read by row inside T.Parallel over an accumulator must hold each thread's rows of
        that accumulator: a statistic of S may rescale O (another width, the same warp rows), not an
        accumulator whose rows sit in other threads."""
        if len(node.vars) != 2:
            return
        for buf, kind in self.fragments_in(node):
            lay = self.layouts[buf]
            if kind != "row" or isinstance(anchor, MmaAccumLayout) and isinstance(lay, MmaRowLayout) and (
                    lay.holds_rows_of(anchor)):
                continue
            if not isinstance(anchor, MmaAccumLayout):
                raise error(node.loc, f"fragment {buf.name} is read by row in a T.Parallel whose 2-D fragments "
                                      f"{'no gemm laid out' if anchor else 'are none'}: a row value (what "
                                      f"T.reduce_* writes) applies to a gemm's accumulator, or one copied from it")
            w = anchor.w
            held = (f"the rows of a {lay.accum.w.M}x{lay.accum.w.N} accumulator over {lay.accum.w.wm}x"
                    f"{lay.accum.w.wn} warps" if isinstance(lay, MmaRowLayout) else f"a {lay.kind} layout")
            raise error(node.loc, f"fragment {buf.name} holds {held}, but this T.Parallel's {w.M}x{w.N} "
                                  f"accumulator is over {w.wm}x{w.wn} warps (along M x N): a row value can "
                                  f"only scale an accumulator whose rows sit in the same threads; give both "
                                  f'gemms policy="full_row" (every warp along M)')

    def assign(self, buf, layout, node) -> bool:
        old = self.layouts.get(buf)
        if old is None:
            if tuple(layout.shape) != buf.shape:
                raise error(node.loc, f"fragment {buf.name}{list(buf.shape)} cannot take a layout of shape "
                                      f"{list(layout.shape)}")
            self.layouts[buf], self.origin[buf] = layout, node
            return True
        if old != layout:
            first = self.origin[buf].loc
            raise error(node.loc, f"fragment {buf.name} is used inconsistently: here it needs a {layout.kind} "
                                  f"layout, but line {first.lineno if first else '?'} gave it a {old.kind} layout "
                                  f"with another thread mapping")
        return False

    def gemm(self, g: Gemm):
        M, N = g.C.shape if len(g.C.shape) == 2 else (None, None)
        if g.C.scope != "fragment" or M is None:
            raise error(g.loc, f"T.gemm: C must be a 2-D fragment, got {g.C.scope} {list(g.C.shape)}")
        policy = "full_row" if g.A.scope == "fragment" else g.policy
        if policy not in ("square", "full_row", "full_col"):
            raise error(g.loc, f"T.gemm: unknown policy {g.policy!r}; accepted: square, full_row, full_col")
        if g.A.scope == "fragment":
            self.check_fragment_a(g)
        check_gemm_operands(g)
        if self.wgmma and uses_wgmma(g, self.kernel.threads):
            self.assign(g.C, MmaAccumLayout.for_wgmma(M, N, self.kernel.threads, splits_n(g, self.kernel.threads)), g)
            if g.A.scope == "fragment":  # wgmma's register A: the accumulator layout of (M, K), rows as C's
                self.assign(g.A, MmaAccumLayout.for_wgmma(M, g.A.shape[1], self.kernel.threads), g)
            return
        warps = MmaWarps.choose(M, N, self.warps, policy)
        if warps is None:
            raise error(g.loc, f"T.gemm: a {M}x{N} accumulator cannot be tiled by {self.warps} warps with m16n8 "
                               f"mma.sync tiles (policy {policy}); M must be a multiple of 16*warps_m and N of 8*warps_n")
        self.assign(g.C, MmaAccumLayout(warps), g)
        if g.A.scope == "fragment":
            self.assign(g.A, MmaAccumLayout(MmaWarps(M, g.A.shape[1], warps.wm, 1)), g)

    @staticmethod
    def check_fragment_a(g: Gemm):
        """A register A operand is the (M, K) accumulator layout read 16 columns per k step, as
        16-bit pairs: both mma.sync and wgmma need it untransposed, 16-bit and K a multiple of 16."""
        A = g.A
        if g.transpose_A:
            raise error(g.loc, f"T.gemm: the fragment A operand {A.name} cannot be transposed (transpose_A=True "
                               f"needs A in shared memory)")
        if A.dtype not in ("float16", "bfloat16"):
            raise error(g.loc, f"T.gemm: the fragment A operand {A.name} has dtype {A.dtype}; register A operands "
                               f"are float16 or bfloat16 (T.copy a float32 fragment into one to cast it)")
        if len(A.shape) != 2 or A.shape[1] % 16:
            raise error(g.loc, f"T.gemm: the fragment A operand {A.name}{list(A.shape)} must be (M, K) with K a "
                               f"multiple of 16 (registers feed the tensor cores 16 columns per k step)")

    def propagate(self, node) -> bool:
        changed = False
        if isinstance(node, Reduce):
            src_l = self.layouts.get(node.src)
            if node.src.scope != "fragment" or node.dst.scope != "fragment":
                raise error(node.loc, "T.reduce_*: source and destination must be fragments")
            if src_l is not None:
                if len(node.src.shape) != 2 or node.dim not in (1, -1):
                    raise error(node.loc, "T.reduce_*: only row reductions (dim=1) of 2-D fragments are supported")
                if not isinstance(src_l, MmaAccumLayout):
                    raise _not_accumulator(node)
                changed |= self.assign(node.dst, src_l.row_layout(), node)
        elif isinstance(node, Copy):
            s, d = node.src.buffer, node.dst.buffer
            if s.scope == "fragment" and d.scope == "fragment":
                for a, b in ((s, d), (d, s)):
                    if a in self.layouts and b not in self.layouts:
                        changed |= self.assign(b, self.layouts[a], node)
                if s in self.layouts and d in self.layouts and self.layouts[s] != self.layouts[d]:
                    raise error(node.loc, f"T.copy between fragments {s.name} and {d.name} with different layouts")
        elif isinstance(node, Parallel):
            anchor = self.anchor(node)
            if anchor is not None:
                for buf, kind in self.fragments_in(node):
                    want = anchor if kind == "full" else self.row_of(anchor, node)
                    if want is not None and buf not in self.layouts:
                        changed |= self.assign(buf, want, node)
        return changed

    def fragments_in(self, node: Parallel):
        """Fragments accessed in a T.Parallel body: 'full' when indexed by all loop vars in order,
        'row' when a 1-D fragment is indexed by the first loop var."""
        out = []

        def classify(buf, idx, loc):
            if buf.scope != "fragment":
                return
            if _is_vars(idx, node.vars):
                out.append((buf, "full"))
            elif len(idx) == 1 and len(node.vars) == 2 and _is_vars(idx, node.vars[:1]):
                out.append((buf, "row"))
            else:
                raise error(loc, f"inside T.Parallel, fragment {buf.name} must be indexed by the loop variables "
                                 f"({', '.join(str(v) for v in node.vars)})")

        for st in node.body:
            if not isinstance(st, Store):
                raise error(st.loc, "only element assignments are allowed inside T.Parallel")
            classify(st.buffer, st.indices, st.loc)
            for buf_var, idx in collect_loads(st.value):
                buf = self.buffers.get(buf_var)
                if buf is not None:
                    classify(buf, idx, st.loc)
        return out

    def row_of(self, anchor, node):
        if len(node.vars) == 1:
            return anchor
        if isinstance(anchor, MmaAccumLayout):
            return anchor.row_layout()
        return None

    def anchor(self, node: Parallel):
        full = [self.layouts[b] for b, k in self.fragments_in(node) if k == "full" and b in self.layouts]
        if not full:
            return None
        first = full[0]
        for lay in full[1:]:
            if lay != first:
                raise error(node.loc, "T.Parallel mixes fragments with different layouts")
        if list(first.shape) != list(node.extents):
            raise error(node.loc, f"T.Parallel extents {node.extents} differ from the fragment shape {list(first.shape)}")
        return first


MMA_DTYPES = {"float16": "f16", "bfloat16": "bf16"}  # what mma.sync and wgmma multiply (accumulating in fp32)


def _not_accumulator(node: Reduce):
    return error(node.loc, f"T.reduce_*: {node.src.name} must have a gemm accumulator layout "
                           f"(reduce a fragment produced by T.gemm or copied from one)")


def check_gemm_operands(g: Gemm) -> None:
    """What every T.gemm needs, whichever instruction runs it: 16-bit A and B of one dtype, an fp32
    accumulator, B shared and A shared or a fragment, shapes that agree, K a multiple of 16."""
    A, B, C = g.A, g.B, g.C
    for x in (A, B):
        if x.dtype not in MMA_DTYPES:
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
    """policy="full_col" with several warpgroups: each takes N / warpgroups columns of all M rows
    (e.g. a 64-row tile, too short to stack warpgroups along M).  A register A operand would have to
    be whole in every warpgroup, so those stack along M."""
    return g.policy == "full_col" and threads >= 256 and g.A.scope == "shared"


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
          and g.A.dtype in ("float16", "bfloat16") and g.C.dtype == "float32" and threads % 128 == 0
          and N % 8 == 0 and Ka % 16 == 0 and all(in_swizzled_panels(t) for t in (g.A, g.B) if t.scope == "shared"))
    if not ok:
        return False
    if not splits_n(g, threads):
        return g.policy != "full_col" and M % (64 * n_wg) == 0 and N <= 256
    wn = N // n_wg
    b_panel = SharedLayout(*g.B.shape, dtype_bits(g.B.dtype)).panel
    return M % 64 == 0 and N % (8 * n_wg) == 0 and wn <= 256 and (g.transpose_B or wn % b_panel == 0)


def in_swizzled_panels(tile) -> bool:
    """A 2-D shared tile laid out as whole swizzled panels of 8-row groups: what wgmma descriptors
    read and TMA boxes write."""
    if len(tile.shape) != 2:
        return False
    rows, cols = tile.shape
    lay = SharedLayout(rows, cols, dtype_bits(tile.dtype))
    return lay.swizzle and rows % 8 == 0 and cols % lay.panel == 0


def _is_vars(idx, vars_) -> bool:
    return len(idx) == len(vars_) and all(isinstance(i, tvm.ir.expr.Var) and i.same_as(v) for i, v in zip(idx, vars_))
