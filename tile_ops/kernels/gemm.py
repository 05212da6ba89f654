"""GEMM: C[b] = op(A[b]) @ op(B[b]) (+ bias), fp16/bf16 in, fp32 accumulate, any output dtype."""


from dataclasses import dataclass

import torch

import tile_ops
import tile_ops.lang as T
from tile_ops.jit import default_arch
from tile_ops.autotune import config_for


@dataclass(frozen=True)
class GemmConfig:
    block_M: int = 128
    block_N: int = 256
    block_K: int = 32
    num_stages: int = 3
    threads: int = 256
    swizzle: int = 8
    policy: str = "square"  # T.gemm warp policy: "square" | "full_row" | "full_col"


_HOPPER_TILES = [GemmConfig(128, 256, 64, 4, 256, 8), GemmConfig(128, 128, 64, 5, 256, 8),
                 GemmConfig(128, 64, 64, 6, 128, 8), GemmConfig(64, 64, 64, 8, 128, 8)]


def default_config(M: int, N: int, K: int, arch: str | None = None) -> GemmConfig:
    """Heuristic until the autotuner has a table entry: big tiles for big problems, small M for decode."""
    if (arch or default_arch()) == "sm_90a":  # TMA + wgmma, warp-specialized
        if M <= 64:  # decode: bandwidth-bound, so enough CTAs to stream B from every SM
            return GemmConfig(64, 64, 128, 6, 128, 0)
        for cfg in _HOPPER_TILES:  # the biggest tile that still gives ~one CTA per SM
            if -(-M // cfg.block_M) * -(-N // cfg.block_N) >= 100:
                return cfg
        return _HOPPER_TILES[-1]
    if M <= 64:
        return GemmConfig(64, 128, 64, 4, 128, 0)
    if M * N <= 1024 * 1024:
        return GemmConfig(128, 128, 64, 3, 256, 8)
    return GemmConfig(128, 128, 32, 3, 128, 8)  # best of bench_gemm.py --configs on the H200 (NOTES.md)


# (block_M, block_N, threads): at most 128 fp32 accumulators per thread
_TILES = [(64, 64, 128), (64, 128, 128), (128, 64, 128), (128, 128, 128), (128, 128, 256), (128, 256, 256),
          (256, 128, 256)]
_DECODE_TILES = [(16, 128, 128), (16, 256, 128), (32, 128, 128), (32, 256, 128), (64, 128, 128), (64, 256, 256)]
# sm_90a: wgmma needs 64 rows per consumer warpgroup; TMA stages are cheap, so pipelines are deeper
_HOPPER_SPACE = [(128, 256, 256), (256, 128, 256), (128, 192, 256), (128, 128, 256), (128, 128, 128),
                 (128, 64, 128), (64, 128, 128), (64, 64, 128)]
_HOPPER_DECODE = [(64, 32, 128), (64, 64, 128), (64, 128, 128)]


def config_space(M: int, N: int, K: int, dtype: str = "float16", arch: str = "sm_90a") -> list[GemmConfig]:
    """The autotuner's candidates (tile_ops.autotune): tile x (block_K, stages) x rasterization, with the
    warp policy fixed per regime; tiles larger than the problem's power-of-two M or N are left out.
    ``arch`` is the target: sm_90a (TMA + wgmma) has its own tiles and depths."""
    if arch == "sm_90a":
        return _hopper_space(M, N)
    decode = M <= 64  # few rows: thin tiles whose warps split N ("full_col"), deeper K steps
    tiles = _DECODE_TILES if decode else _TILES
    depths = [(64, 3), (64, 4), (128, 2), (128, 3)] if decode else [(32, 3), (32, 4), (64, 2), (64, 3)]
    policy = "full_col" if decode else "square"
    space = []
    for bM, bN, threads in tiles:
        if bM > max(16, _pow2(M)) or bN > max(64, _pow2(N)):
            continue
        # a swizzle panel of 8 column blocks only reorders a grid wider than 8 with more than one row
        swizzles = (0, 8) if -(-N // bN) > 8 and -(-M // bM) > 1 else (0,)
        space += [GemmConfig(bM, bN, bK, stages, threads, sw, policy) for bK, stages in depths for sw in swizzles]
    return space


def _hopper_space(M: int, N: int) -> list[GemmConfig]:
    decode = M <= 64
    depths = [(64, 6), (64, 8), (128, 4), (128, 6)] if decode else [(64, 3), (64, 4), (64, 5), (128, 3)]
    space = []
    for bM, bN, threads in _HOPPER_DECODE if decode else _HOPPER_SPACE:
        if bM > max(64, _pow2(M)) or bN > max(64, _pow2(N)):
            continue
        swizzles = (0, 8) if -(-N // bN) > 8 and -(-M // bM) > 1 else (0,)
        space += [GemmConfig(bM, bN, bK, stages, threads, sw) for bK, stages in depths for sw in swizzles]
    return space


def shared_memory_bytes(cfg: GemmConfig, M: int, N: int, K: int, dtype: str = "float16") -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs: pipelined A and B tiles, the bias tile
    (each buffer starts on a 1 KiB boundary on sm_90a) and the pipeline's mbarriers."""
    esize = _ESIZE[dtype]
    tiles = [cfg.num_stages * cfg.block_M * cfg.block_K, cfg.num_stages * cfg.block_K * cfg.block_N, cfg.block_N]
    return _kib(sum(_kib(n * esize) for n in tiles) + 16 * cfg.num_stages)


def _kib(nbytes: int) -> int:
    return -(-nbytes // 1024) * 1024


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@tile_ops.jit(out_idx=[-1])
def gemm(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
         dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig()):
    bM, bN, bK = cfg.block_M, cfg.block_N, cfg.block_K
    A_shape = (batch_a, K, M) if trans_A else (batch_a, M, K)
    B_shape = (batch_b, N, K) if trans_B else (batch_b, K, N)
    A_tile = (bK, bM) if trans_A else (bM, bK)
    B_tile = (bN, bK) if trans_B else (bK, bN)

    @T.prim_func
    def gemm_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), Bias: T.Tensor((N,), dtype),
                    C: T.Tensor((batch, M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), batch, threads=cfg.threads) as (bx, by, bz):
            if cfg.swizzle:
                T.use_swizzle(cfg.swizzle)
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared(B_tile, dtype)
            C_f = T.alloc_fragment((bM, bN), "float32")
            za = bz if batch_a > 1 else 0
            zb = bz if batch_b > 1 else 0
            T.clear(C_f)
            for k in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.num_stages):
                if trans_A:
                    T.copy(A[za, k * bK, by * bM], A_s)
                else:
                    T.copy(A[za, by * bM, k * bK], A_s)
                if trans_B:
                    T.copy(B[zb, bx * bN, k * bK], B_s)
                else:
                    T.copy(B[zb, k * bK, bx * bN], B_s)
                T.gemm(A_s, B_s, C_f, transpose_A=trans_A, transpose_B=trans_B, policy=cfg.policy)
            if has_bias:
                bias_s = T.alloc_shared((bN,), dtype)
                T.copy(Bias[bx * bN], bias_s)
                for i, j in T.Parallel(bM, bN):
                    C_f[i, j] = C_f[i, j] + bias_s[j]
            T.copy(C_f, C[bz, by * bM, bx * bN])

    return gemm_kernel


_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _storage(x):
    """(view, transposed?, batch count): the kernel reads dense (batch, rows, cols) storage, so a 3-D view
    whose last two dims are row-major or a plain transpose is passed as is; anything else is copied."""
    batched = x.shape[0] > 1 and x.stride(0) != 0
    for trans in (False, True):
        s = x.transpose(-1, -2) if trans else x
        rows, cols = s.shape[-2:]
        if (s.stride(-1) == 1 or cols == 1) and (s.stride(-2) == cols or rows == 1) and (
                not batched or s.stride(0) == rows * cols):
            return x, trans, (x.shape[0] if batched else 1)
    return x.contiguous(), False, x.shape[0]


def _prepare(a, b):
    a, ta, ba = _storage(a)
    b, tb, bb = _storage(b)
    return a, b, ta, ba, tb, bb


def get_gemm_kernel(a, b, out, bias=None, cfg=None):
    """(kernel, a, b): the kernel for these operands and the operand views it reads."""
    Bt, M, K = a.shape
    N = b.shape[-1]
    a, b, ta, ba, tb, bb = _prepare(a, b)
    cfg = cfg or config_for("gemm", M, N, K, _DT[a.dtype], a.device)
    return gemm(M, N, K, Bt, ba, bb, ta, tb, bias is not None, _DT[a.dtype], _DT[out.dtype], cfg), a, b


def gemm_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr, bias_ptr=0)`` for a kernel from ``get_gemm_kernel`` (0: no bias)."""

    def launch(a_ptr, b_ptr, out_ptr, bias_ptr=0):
        # unused bias parameter slot: any valid pointer
        kernel.launch_ptrs([a_ptr, b_ptr, bias_ptr or out_ptr, out_ptr], device)

    return launch


def launch_gemm(a, b, out, bias=None, cfg=None):
    """a (Bt, M, K), b (Bt, K, N): row-major or plain-transposed views (batch stride 0 = broadcast);
    out (Bt, M, N) contiguous; bias (N,) or None."""
    kernel, a, b = get_gemm_kernel(a, b, out, bias, cfg)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    gemm_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr(), bias_ptr)
    return out
