"""Fused GEMM + softmax: out = softmax(scale * (A @ B), dim=-1), the scores never leave the chip.

A row block of ``block_M`` rows is shared by ``split`` blocks, each owning a contiguous run of
whole ``block_N`` column tiles (``block_columns``); with ``split > 1`` they form a thread-block
cluster (sm_90a) and merge their row statistics, (max, sum), in one ``T.cluster_allreduce``.

- One tile per block (the run is one tile): the score tile stays in registers: row max, exp2,
  row sum, merged over the cluster, rescale by 2^(own max - max) / sum, store.  The output is
  written once.
- Several tiles per block: a pipelined GEMM over K per tile, the running row max and sum updated
  online (base-2 exponentials), exp2(s - running max) stored (staged: through shared memory and
  TMA); the last tile stays in registers until the final max and sum are known, and a pass over
  the block's own output rescales the earlier tiles by exp2(max at that tile - final max) / final
  sum.  That pass re-reads and re-writes (n - 1) / n of the output, which the L2 does not keep:
  at 8192x2048x1024 it costs ~13 us of the walk's 74 (NOTES v10)."""


import functools
import math
import operator
import struct
import warnings
from dataclasses import dataclass, replace

import tile_ops
import tile_ops.lang as T
from tile_ops.lang import SharedMemoryError
from tile_ops.jit import default_arch
from tile_ops.autotune import config_for
from tile_ops.compiler.targets import Target, smem_limit

from .gemm import _DT, _kib, _ESIZE, _pow2, check_config_sizes

LOG2E = 1.4426950408889634
# the deferred store's exchange takes a few microseconds per tile (NOTES v10): a main loop of 8 K steps
# of 64 hides it
DEFERRED_MIN_K = 512


@dataclass(frozen=True)
class SoftmaxConfig:
    block_M: int = 128
    block_N: int = 128
    block_K: int = 32
    num_stages: int = 3
    threads: int = 256
    policy: str = "square"  # T.gemm warp policy; "full_row" keeps each row in one warp (no cross-warp reduce)
    split: int = 1  # blocks sharing a row block's columns: a thread-block cluster on sm_90a
    persistent: bool = True  # False: a block (cluster) per row block even with more than one wave (sm_90a)
    pingpong: bool = False  # sm_90a, threads=128: two consumer warpgroups per CTA on alternate row blocks
    stream_k: int = 0  # >= 2 (sm_90a, one tile per block): the last wave's row blocks split along K into up to this many parts
    # sm_90a: a row's tiles spread over the grid without a cluster, every tile stored once its row's
    # statistics are in, after the block's next tile (T.row_reduce_store): all SMs, GEMM-like waves
    deferred: bool = False

    def __post_init__(self):
        check_config_sizes(self)
        if not 1 <= self.split <= T.MAX_CLUSTER:
            raise ValueError(f"SoftmaxConfig.split={self.split}: must be in [1, {T.MAX_CLUSTER}] (a cluster's blocks)")
        if self.deferred and (self.split > 1 or self.pingpong or self.stream_k or not self.persistent):
            raise ValueError("SoftmaxConfig.deferred: one tile per block over the whole grid; it takes no split, "
                             "pingpong, stream_k or persistent=False")


def block_columns(N: int, cfg: SoftmaxConfig) -> int:
    """Columns each of a row block's ``split`` blocks owns: its share of N, rounded up to whole tiles."""
    share = -(-N // cfg.split)
    return -(-share // cfg.block_N) * cfg.block_N


def _every_block_has_columns(N: int, cfg: SoftmaxConfig) -> bool:
    return (cfg.split - 1) * block_columns(N, cfg) < N


def _widest_split(N: int, cfg: SoftmaxConfig, most: int = T.MAX_CLUSTER) -> int:
    """The largest cluster (<= ``most`` blocks) over which a row of N columns splits into whole tiles, each
    block getting some: ceil(N / block_N) blocks of one tile when that is <= 8."""
    return max(s for s in range(1, most + 1) if _every_block_has_columns(N, replace(cfg, split=s)))


def default_config(M: int, N: int, K: int, arch: str | None = None) -> SoftmaxConfig:
    """sm_90a: 128x256 tiles; rows of more than one tile spread over the whole grid, their statistics
    exchanged through global memory (``deferred``: every SM busy, where clusters of 8 fit on 120 of
    132) when TMA can store them and K is long enough to hide the exchange; otherwise a row split over
    a cluster of up to 8 blocks (one tile each up to N = 2048, then short walks; from N = 8192 walks of
    128-wide tiles: 2048x8192x256 64 us against 137).  bench_gemm_softmax.py --configs on the H200, NOTES.md
    v5, v10."""
    if (arch or default_arch()) == "sm_90a":
        if N <= 64:  # one 64-wide tile per row block, a block per 64 rows
            return SoftmaxConfig(block_M=64, block_N=64, block_K=64, num_stages=4, threads=128)
        tiles = SoftmaxConfig(128, 256, 64, 3, 256, "full_row")
        if tiles.block_N < N <= T.MAX_ROW_TILES * tiles.block_N and N % 8 == 0 and K % 8 == 0 \
                and K >= DEFERRED_MIN_K:
            return replace(tiles, deferred=True)
        if N >= 4 * T.MAX_CLUSTER * tiles.block_N:  # long walks: of 128-wide tiles (NOTES v10, measured at N = 8192)
            tiles = SoftmaxConfig(128, 128, 64, 4, 256, "full_row")
        return replace(tiles, split=_widest_split(N, tiles))
    return SoftmaxConfig(block_M=64, block_N=64 if N <= 64 else 128, threads=128)


def config_space(M: int, N: int, K: int, dtype: str = "float16", arch: str = "sm_90a") -> list[SoftmaxConfig]:
    """The autotuner's candidates (tile_ops.autotune): row block x threads, column tile, (block_K, stages),
    warp policy.  ``arch`` is the target: sm_90a (TMA stages + wgmma) pipelines 64-wide K steps deeper,
    and adds column splits over clusters."""
    depths = ((64, 3), (64, 4), (32, 4)) if arch == "sm_90a" else ((32, 3), (64, 2))
    space = []
    for bM, threads in ((64, 128), (128, 128), (128, 256)):
        for bN in (64, 128):
            if bN > max(64, _pow2(N)):
                continue
            space += [SoftmaxConfig(bM, bN, bK, stages, threads, policy)
                      for bK, stages in depths for policy in ("square", "full_row")]
    if arch == "sm_90a":  # 64-row tiles, two warpgroups splitting the columns (wgmma along N)
        space += [SoftmaxConfig(64, bN, 64, stages, 256, "full_col") for bN in (128, 256)
                  if bN <= max(128, _pow2(N)) for stages in (2, 3)]
        # clusters: one column tile per block, or a few when the row is wider than 8 tiles
        for bM, bN, threads, stages in ((128, 256, 256, 3), (128, 128, 256, 4), (64, 256, 128, 4)):
            for split in (2, 4, 8):
                cfg = SoftmaxConfig(bM, bN, 64, stages, threads, "full_row", split)
                if _every_block_has_columns(N, cfg):
                    space += [cfg, replace(cfg, persistent=False)] if bN == 256 else [cfg]
                    if threads == 128 and block_columns(N, cfg) == bN:  # two warpgroups, alternate row blocks
                        space.append(replace(cfg, num_stages=3, pingpong=True))
        # 64-row blocks (finer over the clusters that fit), the two warpgroups splitting the columns
        space += [cfg for cfg in (SoftmaxConfig(64, 256, 64, 4, 256, "full_col", split) for split in (2, 4, 8))
                  if _every_block_has_columns(N, cfg)]
        if N % 8 == 0 and K % 8 == 0:  # rows over the whole grid, statistics through global memory
            space += [cfg for cfg in (SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True),
                                      SoftmaxConfig(128, 128, 64, 4, 256, "full_row", deferred=True))
                      if -(-N // cfg.block_N) <= T.MAX_ROW_TILES]
    return space


def _output_tile_fits(smem_bytes: int, cfg, dtype: str, out_dtype: str) -> bool:
    """Whether a kernel whose shared memory ``smem_bytes`` counts its staged (block_M, block_N) output tile in
    ``dtype`` (one per consumer warpgroup with pingpong) still fits with the tile in ``out_dtype``."""
    wider = (_ESIZE[out_dtype] - _ESIZE[dtype]) * cfg.block_M * cfg.block_N * (2 if cfg.pingpong else 1)
    return smem_bytes + max(0, wider) <= smem_limit("sm_90a")


def shared_memory_bytes(cfg: SoftmaxConfig, M: int, N: int, K: int, dtype: str = "float16") -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs: pipelined A and B tiles, the staged
    output tile, with several tiles per block the per-tile running maxima (grow with N) and the final
    max/sum rows, and the cross-warp reduction scratch (none when each row stays in one warp); the
    cluster exchange buffers; with ``pingpong`` all but the pipeline twice (one per consumer warpgroup)."""
    esize = _ESIZE[dtype]
    tiles = _kib(cfg.num_stages * cfg.block_M * cfg.block_K * esize) + _kib(cfg.num_stages * cfg.block_K * cfg.block_N * esize)
    scratch_cols = 0 if cfg.policy == "full_row" else cfg.threads // 32
    n_tiles = block_columns(N, cfg) // cfg.block_N
    rows = _kib(cfg.block_M * cfg.block_N * esize)
    if cfg.deferred:  # the row factors of two tiles
        rows += _kib(2 * cfg.block_M * 4)
    elif n_tiles > 1:
        rows += _kib(n_tiles * cfg.block_M * 4) + 2 * _kib(cfg.block_M * 4)
    # (max, sum) slots and their mbarriers, two tile parities
    exchange = 2 * _kib(cfg.split * cfg.block_M * 8) + 16 if cfg.split > 1 else 0
    copies = 2 if cfg.pingpong else 1
    if _output_overlaid(cfg, M, N, K, n_tiles, esize):
        tiles, rows = max(tiles, rows), 0
    return tiles + copies * (rows + _kib(scratch_cols * cfg.block_M * 4) + exchange) + 16 * cfg.num_stages


def _output_overlaid(cfg: SoftmaxConfig, M: int, N: int, K: int, n_tiles: int, esize: int) -> bool:
    """Whether the sm_90a compiler lays the staged output tile over the dead pipeline stages
    (Lowerer._epilogue_overlay): 16-byte rows of A and B (TMA loads, so a warp-specialized pipeline), a
    block's one tile, no cluster exchange, a grid within a wave unless not persistent."""
    tma_rows = (K * esize) % 16 == 0 and (N * esize) % 16 == 0
    one_tile = not (cfg.deferred or cfg.pingpong or cfg.stream_k) and cfg.split == 1 and n_tiles == 1
    return tma_rows and one_tile and (not cfg.persistent or 0 < -(-M // cfg.block_M) <= Target.of("sm_90a").wave_ctas())


PARTS = ("all", "no_rescale", "gemm")


@tile_ops.jit(out_idx=[-1])
def gemm_softmax(M, N, K, scale=1.0, dtype="float16", out_dtype="float16", cfg: SoftmaxConfig = SoftmaxConfig(),
                 parts="all"):
    """``parts`` other than "all" are for attributing the kernel's time (bench_gemm_softmax.py --parts):
    "no_rescale" leaves out the normalization (the final pass and the cluster exchange; the output stays
    unnormalized), "gemm" also the softmax math (each tile's scaled scores are cast and stored)."""
    if parts not in PARTS:
        raise ValueError(f"gemm_softmax: parts={parts!r}, accepted: {', '.join(PARTS)}")
    if min(M, N, K) < 1 or dtype not in ("float16", "bfloat16") or out_dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"gemm_softmax: M={M}, N={N}, K={K}, dtype={dtype!r}, out_dtype={out_dtype!r}; accepted: "
                         f"sizes of at least 1, dtype float16 or bfloat16, out_dtype one of those or float32")
    bM, bN, bK, split = cfg.block_M, cfg.block_N, cfg.block_K, cfg.split
    cols = block_columns(N, cfg)
    if not _every_block_has_columns(N, cfg):
        raise ValueError(f"gemm_softmax: split={split} leaves the last block of a row without columns (N={N}, "
                         f"{cols} columns per block); split={_widest_split(N, cfg, split - 1)} fits")
    n_tiles = cols // bN
    if cfg.stream_k and n_tiles > 1:
        raise ValueError(f"gemm_softmax: stream_k needs one column tile per block (N={N} gives {n_tiles} of "
                         f"{bN} over split={split}): its K parts meet before the tile's softmax")
    if cfg.deferred and (N % 8 or K % 8):
        raise ValueError(f"gemm_softmax: deferred=True stores and loads every tile by TMA, which needs 16-byte "
                         f"rows: N and K multiples of 8, got N={N}, K={K}")
    if cfg.deferred and -(-N // bN) > T.MAX_ROW_TILES:
        raise ValueError(f"gemm_softmax: deferred=True takes rows of at most {T.MAX_ROW_TILES} tiles (N <= "
                         f"{T.MAX_ROW_TILES * bN} with block_N={bN}), got N={N}; use a cluster split")
    if cfg.pingpong and n_tiles > 1:
        raise ValueError(f"gemm_softmax: pingpong needs one column tile per block (N={N} gives {n_tiles} of "
                         f"{bN} over split={split}); use a wider split or block_N, or pingpong=False")
    # the output tile staged in shared memory beside the pipeline, unless it does not fit (fp32 output)
    staged = _output_tile_fits(shared_memory_bytes(cfg, M, N, K, dtype), cfg, dtype, out_dtype)
    # softmax(scale*s) == 2^(c*s - c*max) / sum.  With c > 0, c * max(s) == max(c * s): the scores stay
    # unscaled and c goes into exp2's argument (one FFMA a score); otherwise it scales them first.  The
    # test is on c as the kernel's float32 sees it: a c that rounds to 0 would make a masked -inf score NaN.
    # A c past float32's range (|scale| > 2.3e38) is no literal: the scores are scaled (as the reference scales
    # them in float32, inf past its range) and log2 e goes into exp2's argument.
    c = scale * LOG2E
    if math.isinf(_as_float32(c)):
        pre, post = _as_float32(scale), LOG2E
    else:
        pre, post = (1.0, c) if _as_float32(c) > 0 else (c, 1.0)

    def scores(A, B, A_s, B_s, S, row0, col0):
        """S = the (bM, bN) score tile at (row0, col0) times ``pre``; columns past N are -inf."""
        T.clear(S)
        for k in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.num_stages):
            T.copy(A[row0, k * bK], A_s)
            T.copy(B[k * bK, col0], B_s)
            T.gemm(A_s, B_s, S, policy=cfg.policy)
        # columns past N hold 0 (zero-filled loads): adding -inf masks them; a select of the scaled score
        # made ptxas spill 340 B on the walk path at N = 2304
        for r, col in T.Parallel(bM, bN):
            S[r, col] = S[r, col] * pre + T.if_then_else(col0 + col < N, 0.0, -T.infinity("float32"))

    if cfg.deferred:
        if not staged:
            raise ValueError(f"gemm_softmax: deferred=True stages a {cfg.block_M}x{cfg.block_N} {out_dtype} tile "
                             f"beside the pipeline, which does not fit in shared memory; use fewer stages, "
                             f"a narrower block_N or a float16/bfloat16 output")
        return _deferred_kernel(M, N, K, dtype, out_dtype, cfg, scores, post, parts)

    @T.prim_func
    def gemm_softmax_kernel(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), Out: T.Tensor((M, N), out_dtype)):
        with T.Kernel(split, T.ceildiv(M, bM), threads=cfg.threads, cluster=split,
                      persistent=cfg.persistent, pingpong=cfg.pingpong, stream_k=cfg.stream_k) as (rank, bx):
            A_s = T.alloc_shared((bM, bK), dtype)
            B_s = T.alloc_shared((bK, bN), dtype)
            S = T.alloc_fragment((bM, bN), "float32")
            if n_tiles == 1:
                scores(A, B, A_s, B_s, S, bx * bM, rank * cols)
                _normalize_in_registers(S, post, split, parts)
                if staged:  # coalesced (TMA on sm_90a) stores of the tile from shared memory
                    P_s = T.alloc_shared((bM, bN), out_dtype)
                    T.copy(S, P_s)
                    T.copy(P_s, Out[bx * bM, rank * cols])
                else:
                    T.copy(S, Out[bx * bM, rank * cols])
            else:
                _walk(A, B, A_s, B_s, S, Out, scores, post, bx * bM, rank * cols, n_tiles, split, parts, out_dtype,
                      staged, N)

    return gemm_softmax_kernel


def _deferred_kernel(M, N, K, dtype, out_dtype, cfg: SoftmaxConfig, scores, post: float, parts: str):
    """One (bM, bN) tile per block over a (column tiles, row blocks) grid; T.row_reduce_store merges the
    row's statistics across the grid and stores the tile normalized."""
    bM, bN = cfg.block_M, cfg.block_N

    @T.prim_func
    def gemm_softmax_kernel(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), Out: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), threads=cfg.threads) as (bx, by):
            A_s = T.alloc_shared((bM, cfg.block_K), dtype)
            B_s = T.alloc_shared((cfg.block_K, bN), dtype)
            S = T.alloc_fragment((bM, bN), "float32")
            P_s = T.alloc_shared((bM, bN), out_dtype)
            scores(A, B, A_s, B_s, S, by * bM, bx * bN)
            if parts == "gemm":
                _to_log2_units(S, post)
            else:
                m = T.alloc_fragment((bM,), "float32")
                l = T.alloc_fragment((bM,), "float32")
                _row_max_log2(S, m, post)
                for r, col in T.Parallel(bM, bN):
                    S[r, col] = T.exp2(S[r, col] * post - m[r])
                T.reduce_sum(S, l, dim=1)
            if parts == "all":
                T.row_reduce_store(S, (m, l), merge_row_statistics, normalize_row, P_s, Out[by * bM, bx * bN])
            else:
                T.copy(S, P_s)
                T.copy(P_s, Out[by * bM, bx * bN])

    return gemm_softmax_kernel


def merge_row_statistics(blocks):
    """The (max, sum) of a row split over a cluster's blocks, from each block's (``T.cluster_allreduce``'s
    combine): maxima in log2 units, sums of 2^(s - max); a block without values (max -inf) adds 0, not NaN."""
    top = functools.reduce(T.max, [m for m, _ in blocks])
    terms = [T.where(m == -T.infinity("float32"), 0.0, l * T.exp2(m - top)) for m, l in blocks]
    return top, functools.reduce(operator.add, terms)


def normalize_row(own, total):
    """A tile's row factor once the row's statistics are merged: 2^(own max - max) / sum; 0 where the tile has
    no values in the row (own max -inf)."""
    m, _ = own
    top, total_sum = total
    return T.where(m == -T.infinity("float32"), 0.0, T.exp2(m - top) / total_sum)


def _as_float32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # past float32's range: what the kernel's constant becomes
        return math.copysign(math.inf, x)


def _to_log2_units(S, post: float):
    """S *= post: what parts="gemm" stores instead of the softmax (the scores in log2 units)."""
    for r, col in T.Parallel(*S.shape):
        S[r, col] = S[r, col] * post


def _row_max_log2(S, m, post: float):
    """m = each row's max of S, in log2 units (times ``post``, which the exp2 arguments fold in)."""
    T.reduce_max(S, m, dim=1)
    for r in T.Parallel(m.shape[0]):
        m[r] = m[r] * post


def _normalize_in_registers(S, post: float, split: int, parts: str):
    """softmax over the rows of the score tile S (log2 units once times ``post``), whose row is split over
    the cluster's blocks: exp2 at the block's own max, then one exchange merges the blocks' (max, sum)
    and a factor rescales."""
    if parts == "gemm":
        return _to_log2_units(S, post)
    bM, bN = S.shape
    m = T.alloc_fragment((bM,), "float32")
    _row_max_log2(S, m, post)
    for r, col in T.Parallel(bM, bN):
        S[r, col] = T.exp2(S[r, col] * post - m[r])
    if parts != "all":
        return
    l = T.alloc_fragment((bM,), "float32")
    T.reduce_sum(S, l, dim=1)
    if split > 1:
        m_own = T.alloc_fragment((bM,), "float32")
        for r in T.Parallel(bM):
            m_own[r] = m[r]
        T.cluster_allreduce((m, l), merge_row_statistics)
        for r in T.Parallel(bM):
            l[r] = T.exp2(m_own[r] - m[r]) / l[r]
    else:
        for r in T.Parallel(bM):
            l[r] = 1.0 / l[r]
    for r, col in T.Parallel(bM, bN):
        S[r, col] = S[r, col] * l[r]


def _walk(A, B, A_s, B_s, S, Out, scores, post: float, row0, col0, n_tiles: int, split: int, parts: str,
          out_dtype: str, staged: bool, N: int):
    """The block walks its ``n_tiles`` column tiles with an online max and sum, storing exp2(s - running
    max) of all but the last; then (over the cluster) the final max and sum, the last tile normalized from
    registers, and a pass rescaling the earlier tiles of its own output.  ``staged``: every store and
    re-read goes through a shared tile (whole rows: TMA stores, coalesced loads) instead of the
    accumulator layout's 4-byte pieces, which cost the L2 two partial sectors per 16 bytes."""
    bM, bN = S.shape
    P = T.alloc_fragment((bM, bN), out_dtype)
    P_s = T.alloc_shared((bM, bN), out_dtype) if staged else None
    if parts != "gemm":  # the row statistics
        m = T.alloc_fragment((bM,), "float32")
        m_prev = T.alloc_fragment((bM,), "float32")
        m_tile = T.alloc_fragment((bM,), "float32")
        l = T.alloc_fragment((bM,), "float32")
        l_tile = T.alloc_fragment((bM,), "float32")
        m_hist = T.alloc_shared((n_tiles, bM), "float32")  # running max after each tile
        if parts == "all":
            m_fin = T.alloc_shared((bM,), "float32")
            l_fin = T.alloc_shared((bM,), "float32")
        T.fill(m, -T.infinity("float32"))
        T.fill(l, 0)

    def tile(j):
        """S = exp2(scores of tile j - running max), the running (max, sum) updated."""
        scores(A, B, A_s, B_s, S, row0, col0 + j * bN)
        if parts == "gemm":
            return _to_log2_units(S, post)
        _row_max_log2(S, m_tile, post)
        for r in T.Parallel(bM):
            m_prev[r] = m[r]
            m[r] = T.max(m[r], m_tile[r])
        for r, col in T.Parallel(bM, bN):
            S[r, col] = T.exp2(S[r, col] * post - m[r])
        T.reduce_sum(S, l_tile, dim=1)
        for r in T.Parallel(bM):
            l[r] = l[r] * T.exp2(m_prev[r] - m[r]) + l_tile[r]
            m_hist[j, r] = m[r]

    last = n_tiles - 1
    for j in T.serial(n_tiles):
        tile(j)
        # the last tile stays in registers until its factor is known: its window is moved past column N
        # here, where stores write nothing (the program's one pipelined loop must stay unconditional)
        skip = T.if_then_else(j < last, 0, N) if parts == "all" else 0
        _store_tile(S, P, P_s, Out, row0, col0 + j * bN + skip)
    if parts != "all":
        return
    if split > 1:  # the row's max and sum over the cluster
        T.cluster_allreduce((m, l), merge_row_statistics)
    for r in T.Parallel(bM):
        m_fin[r] = m[r]
        l_fin[r] = l[r]
    for j, r in T.Parallel(n_tiles, bM):  # per (tile, row) factor: 2^(m_j - m_final) / l_final
        m_hist[j, r] = T.exp2(m_hist[j, r] - m_fin[r]) / l_fin[r]
    for r, col in T.Parallel(bM, bN):  # the last tile, still in registers
        S[r, col] = S[r, col] * m_hist[last, r]
    _store_tile(S, P, P_s, Out, row0, col0 + last * bN)
    for j in T.serial(last):
        _rescale_tile(P, P_s, Out, m_hist, j, row0, col0 + j * bN)


def _store_tile(S, P, P_s, Out, row0, col0):
    """Out[row0:, col0:] = S (cast), through the shared tile ``P_s`` when there is one."""
    if P_s is None:
        T.copy(S, P)
        T.copy(P, Out[row0, col0])
    else:
        T.copy(S, P_s)
        T.copy(P_s, Out[row0, col0])


def _rescale_tile(P, P_s, Out, factor, j, row0, col0):
    """Out[row0:, col0:] *= factor[j, row]: a tile of the block's own output re-read and re-written.
    Staged tiles were stored whole-row, so the pass runs over the tile in the same coalesced order,
    in registers (every thread's loads of the tile in flight at once); otherwise each thread re-reads
    the accumulator-layout pieces it wrote."""
    bM, bN = P.shape
    if P_s is None:
        T.copy(Out[row0, col0], P)
        for r, col in T.Parallel(bM, bN):
            P[r, col] = P[r, col] * factor[j, r]
        T.copy(P, Out[row0, col0])
    else:
        for r, col in T.Parallel(bM, bN):
            Out[row0 + r, col0 + col] = Out[row0 + r, col0 + col] * factor[j, r]


_SCALES_SEEN: dict = {}  # the problem (shape, dtypes) -> the scales compiled for it in this process
MANY_SCALES = 8


def get_gemm_softmax_kernel(a, b, out, scale=1.0, cfg=None):
    """The kernel computing out (M, N) = softmax(scale * a (M, K) @ b (K, N), -1)."""
    M, K = a.shape
    N = b.shape[1]
    if cfg is None:
        cfg = config_for("gemm_softmax", M, N, K, _DT[a.dtype], a.device)
        if cfg.deferred and not _output_tile_fits(shared_memory_bytes(cfg, M, N, K, _DT[a.dtype]), cfg,
                                                  _DT[a.dtype], _DT[out.dtype]):  # a float32 output
            cfg = replace(cfg, deferred=False)  # first: _widest_split tries splits, which a deferred config refuses
            cfg = replace(cfg, split=_widest_split(N, cfg))
    _note_scale((M, N, K, a.dtype, out.dtype), float(scale))
    try:
        return gemm_softmax(M, N, K, float(scale), _DT[a.dtype], _DT[out.dtype], cfg)
    except SharedMemoryError as e:  # the kernel's line and "reduce block sizes": nothing an op caller can change
        raise ValueError(f"tile_ops.gemm_softmax: rows of N = {N} scores are too wide for its kernel on {e.arch}: "
                         f"the per-row state it keeps on chip grows with N ({e.needed} bytes of shared memory "
                         f"needed, {e.limit} available); accepted: narrower rows; for these, compute "
                         f"torch.softmax(scale * tile_ops.gemm(a, b), -1)") from e


def _note_scale(problem, scale: float) -> None:
    """The scale is a constant of the compiled kernel (folded into its exp2 multiplier): a scale that changes
    every call (a learnable temperature) compiles a kernel, and stores one on disk, every call. Say so once."""
    seen = _SCALES_SEEN.setdefault(problem, set())
    seen.add(scale)
    if len(seen) == MANY_SCALES:
        warnings.warn(f"tile_ops.gemm_softmax: {MANY_SCALES} different scales for one problem {problem[:3]}; each "
                      f"compiles (and caches) its own kernel, the scale being a constant of it. For a scale that "
                      f"changes every step, pass scale=1.0 and multiply a (or b) by it instead", stacklevel=3)


def gemm_softmax_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr)`` for a kernel from ``get_gemm_softmax_kernel``."""

    run = kernel.launcher(device)

    def launch(a_ptr, b_ptr, out_ptr):
        run([a_ptr, b_ptr, out_ptr])

    return launch


def gemm_softmax_plan(kernel, device, a, b, out):
    """``gemm_softmax_launcher``'s launch as a plan program (``Kernel.plan``) over plan buffer indices."""
    return kernel.plan(device, [a, b, out])


def launch_gemm_softmax(a, b, out, scale=1.0, cfg=None):
    """a (M, K), b (K, N) row-major; out (M, N) contiguous = softmax(scale * a @ b, -1)."""
    if not math.isfinite(scale):
        raise ValueError(f"tile_ops.gemm_softmax: scale must be finite, got {scale}")
    a, b = a.contiguous(), b.contiguous()
    kernel = get_gemm_softmax_kernel(a, b, out, scale, cfg)
    gemm_softmax_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr())
    return out
