"""Tile programs used by the tests: the 20-line GEMM of the README, verbatim."""

import tile_ops
import tile_ops.lang as T
from tile_ops.kernels.gemm_softmax import merge_row_statistics


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


@tile_ops.jit(out_idx=[2])
def matmul_any_m(N, K, block_M=128, block_N=128, block_K=32, num_stages=3, threads=128, dtype="float16",
                 persistent=True, transpose_A=False, m_multiple=1):
    """The README's GEMM with M a T.dynamic size: one kernel for every M (A stored (M, K), or (K, M))."""
    M = T.dynamic("M", multiple_of=m_multiple)
    A_shape = (K, M) if transpose_A else (M, K)
    A_tile = (block_K, block_M) if transpose_A else (block_M, block_K)

    @T.prim_func
    def main(A: T.Tensor(A_shape, dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads, persistent=persistent) as (bx, by):
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared((block_K, block_N), dtype)
            C_f = T.alloc_fragment((block_M, block_N), "float32")
            T.clear(C_f)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                if transpose_A:
                    T.copy(A[k * block_K, by * block_M], A_s)
                else:
                    T.copy(A[by * block_M, k * block_K], A_s)
                T.copy(B[k * block_K, bx * block_N], B_s)
                T.gemm(A_s, B_s, C_f, transpose_A=transpose_A)
            T.copy(C_f, C[by * block_M, bx * block_N])

    return main


@tile_ops.jit(out_idx=[3])
def chained_matmul(M, N, K, L, block_M=64, block_L=64, num_stages=2, threads=128, dtype="float16"):
    """C = (A @ B) @ D with FlashAttention's structure (Q, K^T, V): per tile of L, S = A @ B[:, tile] in a
    float32 fragment, cast to a ``dtype`` fragment P of the same layout, C += P @ D[tile, :] with P as
    the register A operand (wgmma's rs form on sm_90a, mma.sync's A fragment elsewhere).  A's K and N are
    whole tiles (at most 256)."""

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, L), dtype), D: T.Tensor((L, N), dtype),
             C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            A_s = T.alloc_shared((block_M, K), dtype)
            B_s = T.alloc_shared((K, block_L), dtype)
            D_s = T.alloc_shared((block_L, N), dtype)
            S_f = T.alloc_fragment((block_M, block_L), "float32")
            P_f = T.alloc_fragment((block_M, block_L), dtype)
            C_f = T.alloc_fragment((block_M, N), "float32")
            T.copy(A[bx * block_M, 0], A_s)
            T.clear(C_f)
            for j in T.Pipelined(T.ceildiv(L, block_L), num_stages=num_stages):
                T.copy(B[0, j * block_L], B_s)
                T.copy(D[j * block_L, 0], D_s)
                T.gemm(A_s, B_s, S_f, clear_accum=True, policy="full_row")  # S's rows per warp are P's
                T.copy(S_f, P_f)
                T.gemm(P_f, D_s, C_f)
            T.copy(C_f, C[bx * block_M, 0])

    return main


@tile_ops.jit(out_idx=[3])
def chained_matmul_sum(M, N, K, L, J, block_M=64, num_stages=2, threads=128, dtype="float16"):
    """C = (A @ B) @ (D[0] + ... + D[J-1]): P = A @ B is cast once, then the pipelined loop only issues
    the gemm reading P from registers, so on sm_90a its wgmma groups stay in flight across steps (the
    deferred wait) all reading P.  K, L and N are whole tiles (at most 256)."""

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, L), dtype), D: T.Tensor((J, L, N), dtype),
             C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            A_s = T.alloc_shared((block_M, K), dtype)
            B_s = T.alloc_shared((K, L), dtype)
            D_s = T.alloc_shared((L, N), dtype)
            S_f = T.alloc_fragment((block_M, L), "float32")
            P_f = T.alloc_fragment((block_M, L), dtype)
            C_f = T.alloc_fragment((block_M, N), "float32")
            T.copy(A[bx * block_M, 0], A_s)
            T.copy(B[0, 0], B_s)
            T.gemm(A_s, B_s, S_f, clear_accum=True, policy="full_row")
            T.copy(S_f, P_f)
            T.clear(C_f)
            for j in T.Pipelined(J, num_stages=num_stages):
                T.copy(D[j, 0, 0], D_s)
                T.gemm(P_f, D_s, C_f)
            T.copy(C_f, C[bx * block_M, 0])

    return main


@tile_ops.jit(out_idx=[2, 3])
def softmax_stats_over_cluster(valid, rows=64, cols=64, K=64, cluster=4, threads=128):
    """Row max (log2 units) and sum of 2^(s - max) of the scores S = X @ W, whose columns are split over
    a cluster's blocks and merged with T.cluster_allreduce (the library's merge_row_statistics); columns from ``valid`` on are -inf (a
    block can have none).  Every block writes the whole row's statistics."""
    @T.prim_func
    def main(X: T.Tensor((rows, K), "float16"), W: T.Tensor((K, cols * cluster), "float16"),
             Max: T.Tensor((cluster, rows), "float32"), Sum: T.Tensor((cluster, rows), "float32")):
        with T.Kernel(cluster, threads=threads, cluster=cluster) as bx:
            X_s = T.alloc_shared((rows, K), "float16")
            W_s = T.alloc_shared((K, cols), "float16")
            S = T.alloc_fragment((rows, cols), "float32")
            m = T.alloc_fragment((rows,), "float32")
            l = T.alloc_fragment((rows,), "float32")
            T.copy(X[0, 0], X_s)
            T.copy(W[0, bx * cols], W_s)
            T.clear(S)
            T.gemm(X_s, W_s, S)
            for r, c in T.Parallel(rows, cols):
                S[r, c] = T.if_then_else(bx * cols + c < valid, S[r, c], -T.infinity("float32"))
            T.reduce_max(S, m, dim=1)
            for r, c in T.Parallel(rows, cols):
                S[r, c] = T.exp2(S[r, c] - m[r])
            T.reduce_sum(S, l, dim=1)
            T.cluster_allreduce((m, l), merge_row_statistics)
            for r in T.Parallel(rows):
                Max[bx, r] = m[r]
                Sum[bx, r] = l[r]

    return main
