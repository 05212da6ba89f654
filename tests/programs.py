"""Tile programs used by the tests: the 20-line GEMM of the README, verbatim, and small elementwise and
copy programs that exercise vectorized T.Parallel loops and copies."""

import tile_ops
import tile_ops.lang as T


@tile_ops.jit(out_idx=[2])
def matmul(M, N, K, block_M=128, block_N=128, block_K=32, num_stages=3, threads=128,
           dtype="float16", accum_dtype="float32", out_dtype=None, transpose_A=False, transpose_B=False):
    out_dtype = out_dtype or dtype
    A_shape = (K, M) if transpose_A else (M, K)
    B_shape = (N, K) if transpose_B else (K, N)
    A_tile = (block_K, block_M) if transpose_A else (block_M, block_K)
    B_tile = (block_N, block_K) if transpose_B else (block_K, block_N)

    @T.prim_func
    def main(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), C: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared(B_tile, dtype)
            C_f = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.clear(C_f)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                if transpose_A:
                    T.copy(A[k * block_K, by * block_M], A_s)
                else:
                    T.copy(A[by * block_M, k * block_K], A_s)
                if transpose_B:
                    T.copy(B[bx * block_N, k * block_K], B_s)
                else:
                    T.copy(B[k * block_K, bx * block_N], B_s)
                T.gemm(A_s, B_s, C_f, transpose_A=transpose_A, transpose_B=transpose_B)
            T.copy(C_f, C[by * block_M, bx * block_N])

    return main


@tile_ops.jit(out_idx=[3])
def elementwise(M, N, block_M=32, block_N=64, threads=128, dtype="float16", out_dtype=None, offset=0):
    """C = 2 A + B[:, offset:] (zero past N) + bias, through shared tiles: a cp.async copy, a
    synchronous 1-D copy, a T.Parallel over shared and global tiles, a shared->global copy."""
    out_dtype = out_dtype or dtype

    @T.prim_func
    def main(A: T.Tensor((M, N), dtype), B: T.Tensor((M, N), dtype), bias: T.Tensor((N,), dtype),
             C: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_s = T.alloc_shared((block_M, block_N), dtype)
            bias_s = T.alloc_shared((block_N,), dtype)
            C_s = T.alloc_shared((block_M, block_N), out_dtype)
            T.copy(A[by * block_M, bx * block_N], A_s)
            T.copy(bias[bx * block_N], bias_s)
            for i, j in T.Parallel(block_M, block_N):
                C_s[i, j] = T.cast(A_s[i, j], "float32") * 2 + B[by * block_M + i, bx * block_N + j + offset] + \
                    bias_s[j]
            T.copy(C_s, C[by * block_M, bx * block_N])

    return main


@tile_ops.jit(out_idx=[1, 2])
def copies(M, N, block_M=32, block_N=64, threads=128, dtype="float16", out_dtype=None):
    """C = A through two shared tiles (cleared, cp.async, shared->shared, shared->global) and
    D = A (cast to out_dtype) by a global->global copy."""
    out_dtype = out_dtype or dtype

    @T.prim_func
    def main(A: T.Tensor((M, N), dtype), C: T.Tensor((M, N), dtype), D: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            S1 = T.alloc_shared((block_M, block_N), dtype)
            S2 = T.alloc_shared((block_M, block_N), dtype)
            T.clear(S1)
            T.copy(A[by * block_M, bx * block_N], S1)
            T.copy(S1, S2)
            T.copy(S2, C[by * block_M, bx * block_N])
            T.copy(A[by * block_M:(by + 1) * block_M, bx * block_N:(bx + 1) * block_N], D[by * block_M, bx * block_N])

    return main


@tile_ops.jit(out_idx=[1])
def column_block_sum(M, K, block_M=32, block_K=64, num_stages=3, threads=128):
    """C[:, c] = sum over k of A[:, k * block_K + c]: a T.Parallel that reads a multi-stage shared
    tile inside T.Pipelined."""

    @T.prim_func
    def main(A: T.Tensor((M, K), "float16"), C: T.Tensor((M, block_K), "float32")):
        with T.Kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            A_s = T.alloc_shared((block_M, block_K), "float16")
            acc = T.alloc_shared((block_M, block_K), "float32")
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                T.copy(A[bx * block_M, k * block_K], A_s)
                for i, j in T.Parallel(block_M, block_K):
                    acc[i, j] = acc[i, j] + A_s[i, j]
            T.copy(acc, C[bx * block_M, 0])

    return main
