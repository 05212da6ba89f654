"""Fused GEMM + softmax: out = softmax(scale * (A @ B), dim=-1), the scores never leave the chip.

One block owns ``block_M`` rows.  It walks N in ``block_N`` tiles: a pipelined GEMM over K gives
the score tile, the running row max and sum are updated online (base-2 exponentials), and
exp2(s - running max) goes to the output.  A last pass over the block's own output rescales each
tile by exp2(max at that tile - final max) / final sum, so the GEMM runs once."""


import math
from dataclasses import dataclass

import tile_ops
import tile_ops.lang as T
from tile_ops.jit import default_arch
from tile_ops.autotune import config_for

from .gemm import _DT, _kib, _ESIZE, _pow2

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SoftmaxConfig:
    block_M: int = 128
    block_N: int = 128
    block_K: int = 32
    num_stages: int = 3
    threads: int = 256
    policy: str = "square"  # T.gemm warp policy; "full_row" keeps each row in one warp (no cross-warp reduce)


def default_config(M: int, N: int, K: int, arch: str | None = None) -> SoftmaxConfig:
    # one block per 64 rows: the grid is M / block_M blocks, so smaller row blocks fill more SMs
    if (arch or default_arch()) == "sm_90a":  # TMA stages of 64-wide K feed one wgmma warpgroup
        return SoftmaxConfig(block_M=64, block_N=64 if N <= 64 else 128, block_K=64, num_stages=4, threads=128)
    return SoftmaxConfig(block_M=64, block_N=64 if N <= 64 else 128, threads=128)


def config_space(M: int, N: int, K: int, dtype: str = "float16", arch: str = "sm_90a") -> list[SoftmaxConfig]:
    """The autotuner's candidates (tile_ops.autotune): row block x threads, column tile, (block_K, stages),
    warp policy.  ``arch`` is the target: sm_90a (TMA stages + wgmma) pipelines 64-wide K steps deeper."""
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
    return space


def shared_memory_bytes(cfg: SoftmaxConfig, M: int, N: int, K: int, dtype: str = "float16") -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs: pipelined A and B tiles, the per-tile
    running maxima (grow with N), the final max/sum rows and the cross-warp reduction scratch (none when
    each row stays in one warp)."""
    esize = _ESIZE[dtype]
    tiles = _kib(cfg.num_stages * cfg.block_M * cfg.block_K * esize) + _kib(cfg.num_stages * cfg.block_K * cfg.block_N * esize)
    scratch_cols = 0 if cfg.policy == "full_row" else cfg.threads // 32
    rows = _kib(-(-N // cfg.block_N) * cfg.block_M * 4) + 2 * _kib(cfg.block_M * 4) + _kib(scratch_cols * cfg.block_M * 4)
    return tiles + rows + 16 * cfg.num_stages


PARTS = ("all", "no_rescale", "gemm")


@tile_ops.jit(out_idx=[-1])
def gemm_softmax(M, N, K, scale=1.0, dtype="float16", out_dtype="float16", cfg: SoftmaxConfig = SoftmaxConfig(),
                 parts="all"):
    """``parts`` other than "all" are for attributing the kernel's time (bench_gemm_softmax.py --parts):
    "no_rescale" leaves out the final pass (the output stays unnormalized), "gemm" also the softmax math
    (each tile's scaled scores are cast and stored)."""
    if parts not in PARTS:
        raise ValueError(f"gemm_softmax: parts={parts!r}, accepted: {', '.join(PARTS)}")
    bM, bN, bK = cfg.block_M, cfg.block_N, cfg.block_K
    n_tiles = T.ceildiv(N, bN)
    c = scale * LOG2E  # softmax(scale*s) == 2^(c*s - c*max) / sum

    @T.prim_func
    def gemm_softmax_kernel(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), Out: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(M, bM), threads=cfg.threads) as bx:
            A_s = T.alloc_shared((bM, bK), dtype)
            B_s = T.alloc_shared((bK, bN), dtype)
            S = T.alloc_fragment((bM, bN), "float32")
            P = T.alloc_fragment((bM, bN), out_dtype)
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
            for j in T.serial(n_tiles):
                T.clear(S)
                for k in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.num_stages):
                    T.copy(A[bx * bM, k * bK], A_s)
                    T.copy(B[k * bK, j * bN], B_s)
                    T.gemm(A_s, B_s, S, policy=cfg.policy)
                for r, col in T.Parallel(bM, bN):  # scale into log2 units; mask columns past N
                    S[r, col] = T.if_then_else(j * bN + col < N, S[r, col] * c, -T.infinity("float32"))
                if parts != "gemm":
                    T.reduce_max(S, m_tile, dim=1)
                    for r in T.Parallel(bM):
                        m_prev[r] = m[r]
                        m[r] = T.max(m[r], m_tile[r])
                    for r, col in T.Parallel(bM, bN):
                        S[r, col] = T.exp2(S[r, col] - m[r])
                    T.reduce_sum(S, l_tile, dim=1)
                    for r in T.Parallel(bM):
                        l[r] = l[r] * T.exp2(m_prev[r] - m[r]) + l_tile[r]
                        m_hist[j, r] = m[r]
                T.copy(S, P)
                T.copy(P, Out[bx * bM, j * bN])
            if parts != "all":
                return
            for r in T.Parallel(bM):
                m_fin[r] = m[r]
                l_fin[r] = l[r]
            for j, r in T.Parallel(n_tiles, bM):  # per (tile, row) factor: 2^(m_j - m_final) / l_final
                m_hist[j, r] = T.exp2(m_hist[j, r] - m_fin[r]) / l_fin[r]
            for j in T.serial(n_tiles):  # each thread re-reads exactly the elements it wrote
                T.copy(Out[bx * bM, j * bN], P)
                for r, col in T.Parallel(bM, bN):
                    P[r, col] = P[r, col] * m_hist[j, r]
                T.copy(P, Out[bx * bM, j * bN])

    return gemm_softmax_kernel




def get_gemm_softmax_kernel(a, b, out, scale=1.0, cfg=None):
    """The kernel computing out (M, N) = softmax(scale * a (M, K) @ b (K, N), -1)."""
    M, K = a.shape
    N = b.shape[1]
    cfg = cfg or config_for("gemm_softmax", M, N, K, _DT[a.dtype], a.device)
    return gemm_softmax(M, N, K, float(scale), _DT[a.dtype], _DT[out.dtype], cfg)


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
