"""FlashAttention forward: O = softmax(scale * Q K^T + mask) V per (batch, head), the scores never leave the chip.

A block owns ``block_M`` query rows of one head.  It walks the key/value tiles its rows can see (causal and
sliding windows skip the rest) in a pipelined loop: S = Q K^T into a float32 fragment, the mask and the score
transform (softcap, ALiBi) in one pass, the online softmax (running row max ``m`` and sum ``l`` in base 2, the
accumulator rescaled by 2^(m_old - m_new)), then P V with P from registers.  Plain scores (no softcap, no ALiBi)
stay unscaled until exp2, whose argument s * scale * log2(e) - m is then one FFMA (the scale is positive).  P V is
deferred: the compiler may run it during the next iteration, where on sm_90a its wgmmas overlap the next tile's
softmax (FlashAttention-3's in-warpgroup overlap).  Rows that see no key get O = 0 and LSE = -inf.

Every size is a ``T.dynamic`` one (batch, heads, both lengths and every stride but the last) and every number
of the mask and the scores a ``T.Scalar`` (scale, softcap, window sizes), so one kernel per (head dim, dtype,
mask kind, config) serves every shape and every layout whose rows are contiguous: (B, S, H, D)
tensors and (B, H, S, D) ones alike, read through (B, H, S, D) strides.  Causal masks are aligned to the
bottom-right corner (query i sees key j <= i + Sk - Sq), as flash-attn >= 2.1.

Configs: attention_config; the torch side: ops/attention.py."""


import tile_ops
import tile_ops.lang as T

from .attention_config import AttentionConfig
from .attention_mask import LN2, LOG2E, Window, score_log2, strided


@tile_ops.jit(out_idx=[])
def flash_attention_forward(dim: int, dtype: str = "float16", causal: bool = False, local: bool = False,
                            softcap: bool = False, alibi: bool = False, cfg: AttentionConfig = AttentionConfig()):
    """The mask kind and score transform are compile-time, their numbers launch-time scalars: ``scale``;
    ``softcap`` (with ``softcap=True``: scores become softcap * tanh(scores / softcap), before the ALiBi bias
    -slope * |distance to the diagonal| is added); ``window_left`` / ``window_right`` (with ``local=True``: a
    query row sees keys within left before and right after its diagonal, -1 unbounded; ``causal`` fixes right
    at 0)."""
    bM, bN = cfg.block_M, cfg.block_N
    vec = 16 // (2 if dtype in ("float16", "bfloat16") else 4)  # a 16-byte row chunk: TMA's and cp.async's unit
    B, Hq, Hkv, Sq, Sk = T.dynamic("B"), T.dynamic("Hq"), T.dynamic("Hkv"), T.dynamic("Sq"), T.dynamic("Sk")
    inf = T.infinity("float32")

    q_type, o_type = strided("Q", (B, Hq, Sq, dim), dtype, vec), strided("O", (B, Hq, Sq, dim), dtype, vec)
    k_type, v_type = strided("K", (B, Hkv, Sk, dim), dtype, vec), strided("V", (B, Hkv, Sk, dim), dtype, vec)
    lse_type = T.Tensor((B, Hq, Sq), "float32")
    f32, i32 = T.Scalar("float32"), T.Scalar("int32")

    def attention(Q, K, V, O, LSE, scale, cap, left, right, Slopes=None):
        window = Window(Sq, Sk, causal, local, left, right)
        plain = not softcap and not alibi
        c = scale * LOG2E if plain else 1.0  # what turns the scores in S (and m) into log2 units
        # a cluster's query blocks share the K/V loads (multicast) where they walk the same key tiles
        n = cfg.cluster if not (causal or local) else 1
        with T.Kernel(T.ceildiv(Sq, n * bM) * n, Hq, B, threads=cfg.threads, cluster=n) as (bx, h, b):
            kv_head = h // (Hq // Hkv)  # GQA/MQA: a group of query heads reads one K/V head
            slope = Slopes[b, h] if alibi else 0.0
            Q_s = T.alloc_shared((bM, dim), dtype)
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            S = T.alloc_fragment((bM, bN), "float32")
            P = T.alloc_fragment((bM, bN), dtype)
            acc = T.alloc_fragment((bM, dim), "float32")
            m = T.alloc_fragment((bM,), "float32")  # running row max of the scores in S
            m_sub = T.alloc_fragment((bM,), "float32")  # what exp2 subtracts: m * c, or 0 while m is -inf (no key yet)
            rescale = T.alloc_fragment((bM,), "float32")  # the previous max, then 2^(previous - new)
            l = T.alloc_fragment((bM,), "float32")  # running row sum of 2^(score - m)
            l_tile = T.alloc_fragment((bM,), "float32")
            T.copy(Q[b, h, bx * bM, 0], Q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -inf)
            first, count = window.key_tiles(bx * bM, bM, bN)
            for t in T.Pipelined(count, num_stages=cfg.num_stages, mma_turns=True):
                k0 = (first + t) * bN
                T.copy(K[b, kv_head, k0, 0], K_s)  # keys past Sk load as 0; the mask hides them
                T.copy(V[b, kv_head, k0, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                with T.deferred():  # the tile's P V ends the iteration: on sm_90a it runs under the next softmax
                    T.gemm(P, V_s, acc, policy="full_row")
                for i, j in T.Parallel(bM, bN):
                    q, k = bx * bM + i, k0 + j
                    S[i, j] = T.where(window.visible(q, k), S[i, j] if plain else
                                      score_log2(S[i, j], q, k, Sq, Sk, scale, cap, slope, softcap, alibi), -inf)
                T.copy(m, rescale)
                T.reduce_max(S, m, dim=1, clear=False)
                for i in T.Parallel(bM):
                    m_sub[i] = T.where(m[i] == -inf, 0.0, m[i] * c)
                    rescale[i] = T.exp2(rescale[i] * c - m_sub[i])
                for i, j in T.Parallel(bM, bN):
                    S[i, j] = T.exp2(S[i, j] * c - m_sub[i])
                T.reduce_sum(S, l_tile, dim=1)
                for i in T.Parallel(bM):
                    l[i] = l[i] * rescale[i] + l_tile[i]
                for i, j in T.Parallel(bM, dim):
                    acc[i, j] = acc[i, j] * rescale[i]
                T.copy(S, P)  # in S's register layout: the A operand of P V
            for i, j in T.Parallel(bM, dim):
                acc[i, j] = T.where(l[i] > 0, acc[i, j] / l[i], 0.0)
            T.copy(acc, O[b, h, bx * bM, 0])
            for i in T.Parallel(bM):  # natural log, as flash-attn's
                LSE[b, h, bx * bM + i] = T.where(l[i] > 0, (m_sub[i] + T.log2(l[i])) * LN2, -inf)

    if alibi:  # one slope per (batch, head): a (B, Hq) view, a (Hq,) one expanded over the batch (stride 0)
        @T.prim_func
        def flash_attention(Q: q_type, K: k_type, V: v_type, O: o_type, LSE: lse_type,
                            Slopes: T.Tensor((B, Hq), "float32", strides=(T.dynamic("slopes_stride_b"), 1)),
                            scale: f32, softcap: f32, window_left: i32, window_right: i32):
            attention(Q, K, V, O, LSE, scale, softcap, window_left, window_right, Slopes)
    else:
        @T.prim_func
        def flash_attention(Q: q_type, K: k_type, V: v_type, O: o_type, LSE: lse_type, scale: f32, softcap: f32,
                            window_left: i32, window_right: i32):
            attention(Q, K, V, O, LSE, scale, softcap, window_left, window_right)

    return flash_attention
