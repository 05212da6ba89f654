"""Tile programs used by the tests: the 20-line GEMM of the README, verbatim."""

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
