"""FlashAttention backward: dQ, dK, dV of O = softmax(scale * Q K^T + mask) V from the forward's O and LSE.

Two programs.  ``attention_delta``: Delta = rowsum(dO * O) per query row.  ``flash_attention_backward``: a
block owns ``block_N`` keys of one K/V head and keeps their dK and dV in registers; it walks every query tile
that sees them, in every query head of the head's group (GQA sums the group here, without atomics).  Per
query tile, in the keys-by-queries orientation so that P^T and dS^T come out of the tensor cores in the
register layout the next products read them in:

    S^T  = K Q^T                  P^T = 2^(score(S^T) - LSE)      (masked to 0)
    dP^T = V dO^T                 dS^T = P^T (dP^T - Delta) dscore/ds
    dV  += P^T dO                 dK  += dS^T Q                  (P^T, dS^T from registers)
    dQ   = dS K                   (dS^T through shared memory)   added into a float32 dQ with T.atomic_add

Every size and stride is launch-time, as in the forward (one kernel per head dim, dtype, mask kind, config).
The torch side: ops/attention.py."""


import tile_ops
import tile_ops.lang as T

from .attention_config import AttentionConfig
from .attention_mask import LOG2E, Window, score_log2, strided


@tile_ops.jit(out_idx=[])
def attention_delta(dim: int, dtype: str = "float16", block_M: int = 64):
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in float32, for (B, H, S, D) views."""
    vec = 8
    B, H, S = T.dynamic("B"), T.dynamic("H"), T.dynamic("S")

    @T.prim_func
    def delta(O: strided("O", (B, H, S, dim), dtype, vec), dO: strided("dO", (B, H, S, dim), dtype, vec),
              Delta: T.Tensor((B, H, S), "float32")):
        with T.Kernel(T.ceildiv(S, block_M), H, B, threads=block_M) as (bx, h, b):
            O_s = T.alloc_shared((block_M, dim), dtype)
            dO_s = T.alloc_shared((block_M, dim), dtype)
            acc = T.alloc_fragment((block_M,), "float32")
            T.copy(O[b, h, bx * block_M, 0], O_s)
            T.copy(dO[b, h, bx * block_M, 0], dO_s)
            T.clear(acc)
            for d in T.serial(dim):
                for i in T.Parallel(block_M):
                    acc[i] = acc[i] + T.cast(O_s[i, d], "float32") * T.cast(dO_s[i, d], "float32")
            T.copy(acc, Delta[b, h, bx * block_M])

    return delta


@tile_ops.jit(out_idx=[])
def flash_attention_backward(dim: int, dtype: str = "float16", causal: bool = False, local: bool = False,
                             softcap: bool = False, alibi: bool = False,
                             cfg: AttentionConfig = AttentionConfig(64, 64, 2, 128)):
    """dK, dV (B, Hkv, Sk, D views) and dQ_acc += dQ (float32, (B, Hq, Sq, D), zeroed by the caller) for the
    forward of the same mask kind and scalars; LSE (natural log) from the forward, Delta from attention_delta.
    ``cfg``: block_M queries per step, block_N keys per block."""
    bM, bN = cfg.block_M, cfg.block_N
    vec = 16 // 2
    B, Hq, Hkv, Sq, Sk = T.dynamic("B"), T.dynamic("Hq"), T.dynamic("Hkv"), T.dynamic("Sq"), T.dynamic("Sk")
    q_types = {n: strided(n, (B, Hq, Sq, dim), dtype, vec) for n in ("Q", "dO")}
    kv_types = {n: strided(n, (B, Hkv, Sk, dim), dtype, vec) for n in ("K", "V", "dK", "dV")}
    rows = T.Tensor((B, Hq, Sq), "float32")
    dq_type = T.Tensor((B, Hq, Sq, dim), "float32")
    f32, i32 = T.Scalar("float32"), T.Scalar("int32")

    def backward(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, scale, cap, left, right, Slopes=None):
        window = Window(Sq, Sk, causal, local, left, right)
        with T.Kernel(T.ceildiv(Sk, bN), Hkv, B, threads=cfg.threads) as (bx, kv_head, b):
            group = Hq // Hkv  # the query heads that read this K/V head
            k0 = bx * bN
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            Q_s = T.alloc_shared((bM, dim), dtype)
            dO_s = T.alloc_shared((bM, dim), dtype)
            dS_s = T.alloc_shared((bN, bM), dtype)
            ST = T.alloc_fragment((bN, bM), "float32")  # S^T, then P^T
            dPT = T.alloc_fragment((bN, bM), "float32")  # dP^T, then dS^T
            PT = T.alloc_fragment((bN, bM), dtype)
            dST = T.alloc_fragment((bN, bM), dtype)
            dQ = T.alloc_fragment((bM, dim), "float32")
            dK_f = T.alloc_fragment((bN, dim), "float32")
            dV_f = T.alloc_fragment((bN, dim), "float32")
            T.copy(K[b, kv_head, k0, 0], K_s)
            T.copy(V[b, kv_head, k0, 0], V_s)
            T.clear(dK_f)
            T.clear(dV_f)
            first, count = window.query_tiles(k0, bN, bM)
            for t in T.Pipelined(count * group, num_stages=cfg.num_stages):
                h = kv_head * group + t // count
                q0 = (first + t % count) * bM
                T.copy(Q[b, h, q0, 0], Q_s)
                T.copy(dO[b, h, q0, 0], dO_s)
                T.gemm(K_s, Q_s, ST, transpose_B=True, clear_accum=True, policy="full_row")
                T.gemm(V_s, dO_s, dPT, transpose_B=True, clear_accum=True, policy="full_row")
                for j, i in T.Parallel(bN, bM):
                    q, k = q0 + i, k0 + j
                    row = T.min(q, Sq - 1)
                    slope = Slopes[b, h] if alibi else 0.0
                    x = score_log2(ST[j, i], q, k, Sq, Sk, scale, cap, slope, softcap, alibi)
                    if softcap:  # d score / d s through the cap's tanh: scale (1 - tanh^2), from the raw S
                        dPT[j, i] = (dPT[j, i] - Delta[b, h, row]) * (scale - scale * T.tanh(ST[j, i] * scale / cap)
                                                                       * T.tanh(ST[j, i] * scale / cap))
                    else:
                        dPT[j, i] = (dPT[j, i] - Delta[b, h, row]) * scale
                    ST[j, i] = T.where(window.visible(q, k) & (q < Sq), T.exp2(x - LSE[b, h, row] * LOG2E), 0.0)
                    dPT[j, i] = dPT[j, i] * ST[j, i]
                T.copy(ST, PT)
                T.gemm(PT, dO_s, dV_f, policy="full_row")
                T.copy(dPT, dST)
                T.gemm(dST, Q_s, dK_f, policy="full_row")
                T.copy(dST, dS_s)
                T.gemm(dS_s, K_s, dQ, transpose_A=True, clear_accum=True)
                T.atomic_add(dQ_acc[b, h, q0, 0], dQ)
            T.copy(dK_f, dK[b, kv_head, k0, 0])
            T.copy(dV_f, dV[b, kv_head, k0, 0])

    Q_t, dO_t = q_types["Q"], q_types["dO"]
    K_t, V_t, dK_t, dV_t = (kv_types[n] for n in ("K", "V", "dK", "dV"))
    if alibi:
        @T.prim_func
        def flash_attention_bwd(Q: Q_t, K: K_t, V: V_t, dO: dO_t, LSE: rows, Delta: rows, dQ_acc: dq_type,
                                dK: dK_t, dV: dV_t,
                                Slopes: T.Tensor((B, Hq), "float32", strides=(T.dynamic("slopes_stride_b"), 1)),
                                scale: f32, softcap: f32, window_left: i32, window_right: i32):
            backward(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, scale, softcap, window_left, window_right, Slopes)
    else:
        @T.prim_func
        def flash_attention_bwd(Q: Q_t, K: K_t, V: V_t, dO: dO_t, LSE: rows, Delta: rows, dQ_acc: dq_type,
                                dK: dK_t, dV: dV_t, scale: f32, softcap: f32, window_left: i32, window_right: i32):
            backward(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, scale, softcap, window_left, window_right)

    return flash_attention_bwd
