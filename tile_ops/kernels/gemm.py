"""GEMM programs: C[b] = op(A[b]) @ op(B[b]) (+ bias), fp16/bf16 in, fp32 accumulate, any output dtype; the
split-K reduction and the row padding TMA needs.  Configs: gemm_config; which one: gemm_defaults; the
torch-side launch: gemm_launch."""


import contextlib

import tile_ops
import tile_ops.lang as T
from tile_ops.compiler.targets import smem_limit

from .gemm_config import _ESIZE, GemmConfig, _misfit, _pow2, shared_memory_bytes


def split_k_tiles(K: int, cfg: GemmConfig) -> int:
    """k-tiles (of ``block_K``) per split: split s covers k-tiles [s * n, min((s + 1) * n, ceil(K / bK)))."""
    k_tiles = -(-K // cfg.block_K)
    return -(-k_tiles // cfg.split_k)



@tile_ops.jit(out_idx=[-1])
def gemm(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
         dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig(), a_cols=None, b_cols=None,
         bias_dtype=None, one_wave=False, m_multiple=1):
    """C = A @ B (+ Bias, in ``bias_dtype``: the input dtype unless given).  With ``cfg.split_k > 1`` the
    split-K partial kernel instead: grid z is (split, batch); split s sums k-tiles [s * n, (s + 1) * n) (n =
    ``split_k_tiles``; the last splits may get fewer, or none: zeros) into W[s] in fp32, without the bias;
    ``gemm_splitk_reduce`` adds up.  ``a_cols``/``b_cols``: A's/B's stored row length when padded past the
    logical one (``PaddedGemm``).

    ``M=None``: M is a T.dynamic size, one kernel for every M (a multiple of ``m_multiple``, which A's rows need
    for TMA or vector loads when A is stored transposed); ``one_wave``: launched only where the grid is one wave
    of CTAs, so each CTA runs one tile (its epilogue may lie over the dead pipeline stages); a cluster's grid is
    rounded up to whole clusters (the tiles past M compute nothing that is stored)."""
    bM, bN, bK, splits = cfg.block_M, cfg.block_N, cfg.block_K, cfg.split_k
    bias_dtype = bias_dtype or dtype
    _check_problem(1 if M is None else M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype)
    dynamic = M is None
    M = T.dynamic("M", multiple_of=m_multiple) if dynamic else M
    A_shape = (batch_a, K, a_cols or M) if trans_A else (batch_a, M, a_cols or K)
    B_shape = (batch_b, N, b_cols or K) if trans_B else (batch_b, K, b_cols or N)
    A_tile = (bK, bM) if trans_A else (bM, bK)
    B_tile = (bN, bK) if trans_B else (bK, bN)
    k_tiles, split_tiles = T.ceildiv(K, bK), split_k_tiles(K, cfg)
    tma_rows = all(T.known_multiple(shape[-1]) * _ESIZE[dtype] % 16 == 0 for shape in (A_shape, B_shape))
    misfit = _misfit(cfg, 1 if dynamic else M, N, trans_A)
    if misfit and not (dynamic and "cluster=" in misfit):  # a dynamic grid is rounded up to whole clusters
        raise ValueError(f"gemm: {misfit}")

    clustered = cfg.cluster * cfg.cluster_n > 1  # grid x: M tiles, grid y: N tiles, a cfg.cluster x cluster_n rectangle
    m_tiles = T.ceildiv(M, bM * cfg.cluster) * cfg.cluster if dynamic and clustered else T.ceildiv(M, bM)
    grid = [T.ceildiv(N, bN), m_tiles, batch * splits]
    overlaid = one_wave if dynamic else None
    persistent = not (dynamic and one_wave) or cfg.pingpong or cfg.stream_k > 0

    def load_A(A, A_s, bz, by, k):  # A's k-th tile of block rows by, stored either way round
        za = bz if batch_a > 1 else 0
        if trans_A:
            T.copy(A[za, k * bK, by * bM], A_s)
        else:
            T.copy(A[za, by * bM, k * bK], A_s)

    def load_B(B, B_s, bz, bx, k):  # B's k-th tile of block columns bx
        zb = bz if batch_b > 1 else 0
        evict = "evict_first" if cfg.b_evict_first else None
        if trans_B:
            T.copy(B[zb, bx * bN, k * bK], B_s, eviction_policy=evict)
        else:
            T.copy(B[zb, k * bK, bx * bN], B_s, eviction_policy=evict)

    @contextlib.contextmanager
    def tiles():
        """The launch, rasterized: yields (by, bx, bz), this block's M tile, N tile and batch (and split).
        In clusters grid x runs over M tiles, so that a cluster row shares B's tile."""
        with T.Kernel(*([grid[1], grid[0]] if clustered else grid[:2]), grid[2], threads=cfg.threads,
                      cluster=(cfg.cluster, cfg.cluster_n), pingpong=cfg.pingpong, stream_k=cfg.stream_k,
                      persistent=persistent) as ids:
            if cfg.swizzle:
                T.use_swizzle(cfg.swizzle)
            yield ids if clustered else (ids[1], ids[0], ids[2])

    def body(A, B, Bias, C):
        with tiles() as (by, bx, bz):
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared(B_tile, dtype)
            C_f = T.alloc_fragment((bM, bN), "float32")
            split, k0, steps = 0, 0, k_tiles
            if splits > 1:  # this CTA's K range
                split, bz = bz // batch, bz % batch
                k0 = split * split_tiles
                steps = T.max(T.min(k_tiles - k0, split_tiles), 0)
            T.clear(C_f)
            for k in T.Pipelined(steps, num_stages=cfg.num_stages):
                load_A(A, A_s, bz, by, k0 + k)
                load_B(B, B_s, bz, bx, k0 + k)
                T.gemm(A_s, B_s, C_f, transpose_A=trans_A, transpose_B=trans_B, policy=cfg.policy)
            if splits > 1:
                T.copy(C_f, C[split, bz, by * bM, bx * bN])
                return
            if has_bias:
                _add_bias(C_f, Bias, bx * bN, bM, bN, bias_dtype)
            # coalesced (TMA) stores of a staged tile
            if _shared_epilogue_fits(cfg, M, N, batch, dtype, out_dtype, tma_rows, overlaid):
                C_s = T.alloc_shared((bM, bN), out_dtype)
                T.copy(C_f, C_s)
                T.copy(C_s, C[bz, by * bM, bx * bN])
            else:
                T.copy(C_f, C[bz, by * bM, bx * bN])

    def swapped_body(A, B, Bias, C):  # the C^T tile (bN x bM) = B^T tile @ A^T tile
        with tiles() as (by, bx, bz):
            B_s = T.alloc_shared(B_tile, dtype)
            A_s = T.alloc_shared(A_tile, dtype)
            Ct_f = T.alloc_fragment((bN, bM), "float32")
            T.clear(Ct_f)
            for k in T.Pipelined(k_tiles, num_stages=cfg.num_stages):
                load_B(B, B_s, bz, bx, k)
                load_A(A, A_s, bz, by, k)
                T.gemm(B_s, A_s, Ct_f, transpose_A=not trans_B, transpose_B=not trans_A)
            if has_bias:
                _add_bias(Ct_f, Bias, bx * bN, bN, bM, bias_dtype, along_rows=True)
            # transposed into a staged C tile, TMA-stored
            if _shared_epilogue_fits(cfg, M, N, batch, dtype, out_dtype, tma_rows, overlaid):
                C_s = T.alloc_shared((bM, bN), out_dtype)
                for i, j in T.Parallel(bN, bM):
                    C_s[j, i] = Ct_f[i, j]
                T.copy(C_s, C[bz, by * bM, bx * bN])
            else:
                for i, j in T.Parallel(bN, bM):
                    C[bz, by * bM + j, bx * bN + i] = Ct_f[i, j]

    if cfg.swap_ab:
        @T.prim_func
        def gemm_swapped_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype),
                                Bias: T.Tensor((N,), bias_dtype), C: T.Tensor((batch, M, N), out_dtype)):
            swapped_body(A, B, Bias, C)

        return gemm_swapped_kernel

    if splits == 1:
        @T.prim_func
        def gemm_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), Bias: T.Tensor((N,), bias_dtype),
                        C: T.Tensor((batch, M, N), out_dtype)):
            body(A, B, Bias, C)

        return gemm_kernel

    @T.prim_func
    def gemm_splitk_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), Bias: T.Tensor((N,), bias_dtype),
                           W: T.Tensor((splits, batch, M, N), T.float32)):  # Bias: unused, the reduction adds it
        body(A, B, Bias, W)

    return gemm_splitk_kernel


def _check_problem(M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype) -> None:
    """The problem itself: sizes of at least 1 (the op answers empty problems without a kernel), operand
    batches of 1 (broadcast) or ``batch``, dtypes the kernel computes."""
    if min(M, N, K, batch) < 1 or batch_a not in (1, batch) or batch_b not in (1, batch):
        raise ValueError(f"gemm: M={M}, N={N}, K={K}, batch={batch} (batch_a={batch_a}, batch_b={batch_b}): sizes "
                         f"must be at least 1, and each operand's batch 1 (broadcast) or the batch")
    for name, dt, accepted in (("dtype", dtype, ("float16", "bfloat16")), ("out_dtype", out_dtype, tuple(_ESIZE)),
                               ("bias_dtype", bias_dtype, tuple(_ESIZE))):
        if dt not in accepted:
            raise ValueError(f"gemm: {name}={dt!r}; accepted: {', '.join(accepted)}")



def _shared_epilogue_fits(cfg: GemmConfig, M, N: int, batch: int, dtype: str, out_dtype: str,
                          tma_rows: bool, overlaid: bool | None) -> bool:
    """``cfg.epilogue == "shared"`` unless the output tile in ``out_dtype`` would overflow shared memory
    (e.g. 128x256 fp32 beside three stages, over more than a wave): then the direct epilogue, rather than a
    compile error.  ``overlaid``: whether the epilogue lies over the dead stages (None: as M's grid says)."""
    return (cfg.epilogue == "shared"
            and shared_memory_bytes(cfg, M, N, 0, dtype, batch, out_dtype, tma_rows, overlaid) <= smem_limit("sm_90a"))


def _add_bias(acc, Bias, n0, rows: int, cols: int, dtype: str, along_rows: bool = False):
    """acc[i, j] += Bias[n0 + j] (``along_rows``: Bias[n0 + i], the swapped gemm's C^T tile), inside a
    kernel being traced (the epilogue of the gemm kernels)."""
    bias_s = T.alloc_shared((rows if along_rows else cols,), dtype)
    T.copy(Bias[n0], bias_s)
    for i, j in T.Parallel(rows, cols):
        acc[i, j] = acc[i, j] + (bias_s[i] if along_rows else bias_s[j])


def reduce_tile(M: int, N: int) -> tuple:
    """(block_M, block_N, threads) of ``gemm_splitk_reduce``: narrow column tiles, so that even a decode
    problem's reduction (few rows) has a CTA per SM or so (N / 64 of them) reading the partials."""
    return min(64, max(16, _pow2(M))), 64, 128


@tile_ops.jit(out_idx=[-1])
def gemm_splitk_reduce(M, N, batch=1, split_k=2, has_bias=False, dtype="float16", out_dtype="float16",
                       block_M=16, block_N=64, threads=128, bias_dtype=None):
    """C[b] = sum over s of W[s, b] (+ Bias, in ``bias_dtype``: ``dtype`` unless given), cast to ``out_dtype``:
    the second kernel of a split-K gemm.  ``M=None``: a T.dynamic M."""
    bM, bN = block_M, block_N
    bias_dtype = bias_dtype or dtype
    M = T.dynamic("M") if M is None else M

    @T.prim_func
    def splitk_reduce(W: T.Tensor((split_k, batch, M, N), T.float32), Bias: T.Tensor((N,), bias_dtype),
                      C: T.Tensor((batch, M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), batch, threads=threads) as (bx, by, bz):
            acc = T.alloc_fragment((bM, bN), "float32")
            part = T.alloc_fragment((bM, bN), "float32")
            T.copy(W[0, bz, by * bM, bx * bN], acc)
            for s in T.unroll(split_k - 1):
                T.copy(W[s + 1, bz, by * bM, bx * bN], part)
                for i, j in T.Parallel(bM, bN):
                    acc[i, j] = acc[i, j] + part[i, j]
            if has_bias:
                _add_bias(acc, Bias, bx * bN, bM, bN, bias_dtype)
            T.copy(acc, C[bz, by * bM, bx * bN])

    return splitk_reduce


@tile_ops.jit(out_idx=[-1])
def pad_rows(batch, rows, cols, padded, dtype="float16", block_R=16, block_C=256, threads=256):
    """Y[b, r, :cols] = X[b, r]; Y[b, r, cols:padded] = 0: a matrix re-laid with rows of ``padded``
    elements (a 16-byte multiple), so that TMA can load it (``PaddedGemm``).  ``rows=None``: a T.dynamic
    count, named M (a gemm's A)."""
    rows = T.dynamic("M") if rows is None else rows

    @T.prim_func
    def pad(X: T.Tensor((batch, rows, cols), dtype), Y: T.Tensor((batch, rows, padded), dtype)):
        # rows on grid x, which takes 2^31 - 1 blocks (y: 65535, i.e. ~1M rows)
        with T.Kernel(T.ceildiv(rows, block_R), T.ceildiv(padded, block_C), batch, threads=threads) as (bx, by, bz):
            tile = T.alloc_fragment((block_R, block_C), dtype)
            T.copy(X[bz, bx * block_R, by * block_C], tile)  # zeros past the row
            T.copy(tile, Y[bz, bx * block_R, by * block_C])

    return pad
