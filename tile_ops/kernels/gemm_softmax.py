"""Fused GEMM + softmax: out = softmax(scale * (A @ B), dim=-1), the scores never leave the chip.

A row block of ``block_M`` rows is shared by ``split`` blocks, each owning a contiguous run of
whole ``block_N`` column tiles (``block_columns``); with ``split > 1`` they form a thread-block
cluster (sm_90a) and merge their row statistics, (max, sum), in one ``T.cluster_allreduce``
(``merge_row_statistics``).

- One tile per block (the run is one tile): the score tile stays in registers: row max, exp2,
  row sum, merged over the cluster, rescale by 2^(own max - max) / sum, store.  The output is
  written once.
- Several tiles per block: a pipelined GEMM over K per tile, the running row max and sum updated
  online (base-2 exponentials), exp2(s - running max) stored (staged: through shared memory and
  TMA); the last tile stays in registers until the final max and sum are known, and a pass over
  the block's own output rescales the earlier tiles by exp2(max at that tile - final max) / final
  sum.  That pass re-reads and re-writes (n - 1) / n of the output, which the L2 does not keep.
- Rows over the whole grid (``deferred``, sm_90a): one tile per block, ``T.row_reduce_store`` (the row's
  statistics merged as over a cluster, each tile scaled by ``normalize_row``).

Configs: gemm_softmax_config; which one: gemm_softmax_defaults; the torch-side launch: gemm_softmax_launch."""


import functools
import math
import operator
import struct

import tile_ops
import tile_ops.lang as T

from .gemm_softmax_config import (SoftmaxConfig, _every_block_has_columns, _output_tile_fits, _widest_split,
                                  block_columns, shared_memory_bytes)

LOG2E = 1.4426950408889634


PARTS = ("all", "no_rescale", "gemm")


@tile_ops.jit(out_idx=[-1])
def gemm_softmax(M, N, K, scale=1.0, dtype="float16", out_dtype="float16", cfg: SoftmaxConfig = SoftmaxConfig(),
                 parts="all", one_wave=False):
    """``parts`` other than "all" are for attributing the kernel's time (bench_gemm_softmax.py --parts):
    "no_rescale" leaves out the normalization (the final pass and the cluster exchange; the output stays
    unnormalized), "gemm" also the softmax math (each tile's scaled scores are cast and stored).
    ``M=None``: M is a T.dynamic size, one kernel for every M; ``one_wave``: launched only where its row blocks
    make one wave of CTAs, so each CTA runs one tile (not persistent; the output tile may lie over the stages)."""
    if parts not in PARTS:
        raise ValueError(f"gemm_softmax: parts={parts!r}, accepted: {', '.join(PARTS)}")
    dynamic = M is None
    if (min(1 if M is None else M, N, K) < 1 or dtype not in ("float16", "bfloat16")
            or out_dtype not in ("float16", "bfloat16", "float32")):
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
    staged = _output_tile_fits(shared_memory_bytes(cfg, M, N, K, dtype, one_wave if dynamic else None), cfg, dtype,
                               out_dtype)
    M = T.dynamic("M") if dynamic else M
    persistent = cfg.persistent and not (dynamic and one_wave)
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
                      persistent=persistent, pingpong=cfg.pingpong, stream_k=cfg.stream_k) as (rank, bx):
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
    """The (max, sum) of a row split over blocks, from each block's (``T.cluster_allreduce``'s and
    ``T.row_reduce_store``'s combine): maxima in log2 units, sums of 2^(s - max); a block without values
    (max -inf) adds 0, not NaN."""
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

