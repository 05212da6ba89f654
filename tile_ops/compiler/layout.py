"""Layouts: where each element of a fragment lives (thread, register) and where each element
of a shared tile lives (a swizzled offset).  Fragment layouts are inferred, never written by
the kernel author: ``T.gemm`` fixes its accumulator's, and copies, reductions and
``T.Parallel`` propagate them (infer.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx



@dataclass(frozen=True)
class MmaWarps:
    """How a block's warps tile an (M, N) mma.sync accumulator: ``wm x wn`` warps of ``WM x WN``."""

    M: int
    N: int
    wm: int
    wn: int

    @property
    def WM(self) -> int:
        return self.M // self.wm

    @property
    def WN(self) -> int:
        return self.N // self.wn

    @staticmethod
    def choose(M: int, N: int, warps: int, policy: str) -> "MmaWarps":
        """Split ``warps`` over (M, N) so warp tiles are multiples of 16x16 and as square as possible."""
        options = []
        for wm in range(1, warps + 1):
            if warps % wm:
                continue
            wn = warps // wm
            if M % (16 * wm) or N % (8 * wn):
                continue
            if policy == "full_row" and wn != 1 or policy == "full_col" and wm != 1:
                continue
            WM, WN = M // wm, N // wn
            # prefer warp tiles with N a multiple of 16 (ldmatrix.x4 on B), then squareness
            options.append(((WN % 16 != 0), abs(WM - WN), -WM, wm, wn))
        if not options:
            return None
        *_, wm, wn = min(options)
        return MmaWarps(M, N, wm, wn)


class FragmentLayout:
    """Maps (thread, local index) of a fragment to its logical coordinates.

    ``coords(tid, r)`` returns the logical index tuple of local element ``r`` of thread ``tid``;
    ``local_size`` elements per thread; ``vec``: consecutive local indices that are consecutive
    along the last logical dim (the width of vector accesses).
    """

    kind = "abstract"
    local_size: int
    vec: int = 1

    def coords(self, tid, r):
        raise NotImplementedError

    def row_layout(self) -> "FragmentLayout":
        raise NotImplementedError(f"{self.kind} fragments cannot be reduced along a dimension")

    def owner(self, tid):
        """A condition true for exactly one of the threads holding each element, or None when no
        element is held twice."""
        return None


class MmaAccumLayout(FragmentLayout):
    """The m16n8 mma.sync accumulator layout over a warp grid (also the A-operand register layout
    of m16n8k16, which is what lets a gemm take its A from a fragment).

    ``wgmma=True`` is the Hopper warpgroup variant: a warpgroup's 4 warps hold 16-row slices of
    each 64-row block (one m64 wgmma per warpgroup and block), and warps are numbered down the
    warp grid's columns.  Warpgroups stack along M (``wn == 1``: every warp spans all N columns,
    a warp's slices are 64 * warpgroups rows apart) or, split along N (``wm == 4``), each holds
    all M rows of its ``N / warpgroups`` columns.  Within a 16 x 8 piece the register order is the
    same as mma.sync's, so reductions and copies work on either."""

    vec = 2

    def __init__(self, warps: MmaWarps, wgmma: bool = False):
        self.w, self.wgmma = warps, wgmma
        self.kind = "wgmma" if wgmma else "mma"
        self.mi, self.ni = warps.WM // 16, warps.WN // 8
        self.local_size = self.mi * self.ni * 4
        self.shape = (warps.M, warps.N)

    @staticmethod
    def for_wgmma(M: int, N: int, threads: int, split_n: bool = False) -> "MmaAccumLayout":
        warps = MmaWarps(M, N, 4, threads // 128) if split_n else MmaWarps(M, N, threads // 32, 1)
        return MmaAccumLayout(warps, wgmma=True)

    def __eq__(self, other):
        return isinstance(other, MmaAccumLayout) and (other.w, other.wgmma) == (self.w, self.wgmma)

    def __hash__(self):
        return hash((self.w, self.wgmma))

    def row0(self, wr, mi):
        """First row of a warp's ``mi``-th 16-row slice."""
        if self.wgmma:
            return mi * 16 * self.w.wm + wr * 16
        return wr * self.w.WM + mi * 16

    def warp_rc(self, tid):
        warp = tid // 32
        if self.wgmma:  # column-major: a warpgroup's 4 consecutive warps share its columns
            return warp % self.w.wm, warp // self.w.wm
        return warp // self.w.wn, warp % self.w.wn

    @staticmethod
    def local_index(mi_idx, ni_idx, e, ni):
        return (mi_idx * ni + ni_idx) * 4 + e

    def a_operand_words(self, mi, kk) -> list:
        """The four 32-bit words (pairs of 16-bit locals) this thread passes as the A operand of the
        k16 step ``kk`` on 16-row slice ``mi``: the 16 x 16 block of (M, K) fragment columns
        kk*16 .. kk*16+15, i.e. its 16 x 8 pieces 2kk and 2kk + 1, rows 0-7 then 8-15 of each.  The
        same for mma.sync m16n8k16 and for each warp's 16 rows of wgmma m64nNk16."""
        return [self.local_index(mi, 2 * kk + h, e, self.ni) // 2 for h in (0, 1) for e in (0, 2)]

    def coords(self, tid, r):
        # r = ((mi * ni + nj) * 4 + e); e: (row half, column pair element)
        lane = tid % 32
        wr, wc = self.warp_rc(tid)
        e = r % 4
        nj = (r // 4) % self.ni
        mi = r // (4 * self.ni)
        i = self.row0(wr, mi) + (e // 2) * 8 + lane // 4
        j = wc * self.w.WN + nj * 8 + (lane % 4) * 2 + e % 2
        return (i, j)

    def row_layout(self) -> "MmaRowLayout":
        return MmaRowLayout(self)


class MmaRowLayout(FragmentLayout):
    """A 1-D fragment holding one value per accumulator row, replicated over the 4 lanes (and the
    warps) that share the row: what ``T.reduce_*(acc, row, dim=1)`` produces."""

    kind = "mma_row"

    def __init__(self, accum: MmaAccumLayout):
        self.accum = accum
        self.local_size = accum.mi * 2
        self.shape = (accum.w.M,)

    def __eq__(self, other):
        """Rows of accumulators of any width are one layout where the rows lie alike (``holds_rows_of``) and one
        lane owns each (the same warp grid columns): FlashAttention's row statistics of S scale O."""
        return isinstance(other, MmaRowLayout) and self._rows() == other._rows()

    def __hash__(self):
        return hash(("row",) + self._rows())

    def _rows(self) -> tuple:
        a = self.accum
        return a.wgmma, a.w.M, a.w.wm, a.w.wn

    def coords(self, tid, r):
        lane = tid % 32
        wr, _ = self.accum.warp_rc(tid)
        return (self.accum.row0(wr, r // 2) + (r % 2) * 8 + lane // 4,)

    def owner(self, tid):
        _, wc = self.accum.warp_rc(tid)
        lane0 = tid % 4 == 0  # the first lane of the quad
        return lane0 if self.accum.w.wn == 1 else tirx.And(lane0, wc == 0)

    def holds_rows_of(self, accum: "MmaAccumLayout") -> bool:
        """Whether every thread holds here the rows it holds of ``accum``, in the same order: the rows of
        an accumulator of another width (FlashAttention's O rescaled by a statistic of S) over the same
        warp grid rows.  Rows follow M, the warps along it and, for mma.sync, how warps are numbered
        (``warp // wn``); wgmma numbers warps down the columns (``warp % wm``)."""
        a, b = self.accum, accum
        return (a.wgmma, a.w.M, a.w.wm) == (b.wgmma, b.w.M, b.w.wm) and (a.wgmma or a.w.wn == b.w.wn)

    def row_of_accum_local(self, r_acc, accum: "MmaAccumLayout | None" = None):
        """Local index in this layout of the row that local ``r_acc`` of ``accum`` (default: the
        accumulator reduced into this one; else one it ``holds_rows_of``) lies in."""
        e = r_acc % 4
        mi = r_acc // (4 * (accum or self.accum).ni)
        return mi * 2 + e // 2


class BlockedLayout(FragmentLayout):
    """Default for fragments no gemm constrains: threads own ``vec`` consecutive elements of the
    row-major flattened tile, round-robin (coalesced, vectorizable)."""

    kind = "blocked"

    def __init__(self, shape, threads: int, vec: int):
        self.shape, self.threads, self.vec = tuple(shape), threads, vec
        total = 1
        for s in shape:
            total *= s
        self.local_size = total // threads

    def __eq__(self, other):
        return isinstance(other, BlockedLayout) and (other.shape, other.threads, other.vec) == (
            self.shape, self.threads, self.vec)

    def __hash__(self):
        return hash((self.shape, self.threads, self.vec))

    def coords(self, tid, r):
        flat = ((r // self.vec) * self.threads + tid) * self.vec + r % self.vec
        out = []
        for s in reversed(self.shape):
            out.append(flat % s)
            flat = flat // s
        return tuple(reversed(out))

    @staticmethod
    def make(shape, threads: int, dtype_bits: int):
        total = 1
        for s in shape:
            total *= s
        for vec in (128 // dtype_bits, 4, 2, 1):
            if shape[-1] % vec == 0 and total % (threads * vec) == 0:
                return BlockedLayout(shape, threads, vec)
        return None


# ----------------------------------------------------------------------------- shared tiles


class SharedLayout:
    """A (rows, cols) shared tile stored as column panels of at most 128 bytes per row, each panel
    row-major with its 16-byte chunks XOR-swizzled by row.  This is the layout TMA writes with
    CU_TENSOR_MAP_SWIZZLE_{32,64,128}B (one box per panel) and wgmma reads through matrix
    descriptors, and 8 rows read at one column (ldmatrix, cp.async rows) hit 8 bank groups."""

    def __init__(self, rows: int, cols: int, dtype_bits: int):
        self.rows, self.cols, self.dtype_bits = rows, cols, dtype_bits
        self.chunk = 128 // dtype_bits  # elements per 16-byte chunk
        chunks = cols // self.chunk if cols % self.chunk == 0 else 0
        self.xor_width = min(8, chunks & -chunks)  # chunks per panel row: 2, 4, 8 -> 32/64/128B swizzle
        self.swizzle = self.xor_width >= 2
        self.panel = self.xor_width * self.chunk if self.swizzle else cols  # elements per panel row
        self.rows_per_group = 8 // self.xor_width if self.swizzle else 1  # rows sharing a 128-byte line

    @property
    def swizzle_bytes(self) -> int:
        return 16 * self.xor_width if self.swizzle else 0

    @property
    def panel_elems(self) -> int:
        return self.rows * self.panel

    def offset(self, i, j):
        if not self.swizzle:
            return i * self.cols + j
        jj = j % self.panel
        key = (i // self.rows_per_group) % self.xor_width
        return (j // self.panel) * self.panel_elems + i * self.panel + ((jj // self.chunk) ^ key) * self.chunk \
            + jj % self.chunk

    def describe(self) -> str:
        if not self.swizzle:
            return "row-major"
        panels = self.cols // self.panel
        return f"{self.swizzle_bytes}B-swizzled" + (f", {panels} panels of {self.panel} columns" if panels > 1 else "")


def shared_layout(tile) -> SharedLayout:
    """The layout of a 2-D shared tile."""
    import tvm

    return SharedLayout(tile.shape[0], tile.shape[1], tvm.runtime.DataType(tile.dtype).bits)


def in_swizzled_panels(tile) -> bool:
    """A 2-D shared tile laid out as whole swizzled panels of 8-row groups: what wgmma descriptors
    read and TMA boxes write."""
    if len(tile.shape) != 2:
        return False
    lay = shared_layout(tile)
    return lay.swizzle and tile.shape[0] % 8 == 0 and tile.shape[1] % lay.panel == 0
