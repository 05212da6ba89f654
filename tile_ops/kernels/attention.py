"""FlashAttention forward: O = softmax(scale * Q K^T + mask) V per (batch, head), the scores never leave the chip.

A block owns ``block_M`` query rows of one head.  It walks the key/value tiles its rows can see (causal and
sliding windows skip the rest) in a pipelined loop: S = Q K^T into a float32 fragment, the mask and the score
transform (scale, softcap, ALiBi) in one pass, the online softmax (running row max ``m`` and sum ``l`` in base
2, the accumulator rescaled by 2^(m_old - m_new)), then P V with P from registers.  Rows that see no key get
O = 0 and LSE = -inf.

Every size is a ``T.dynamic`` one: batch, heads, both lengths and every stride but the last, so one kernel per
(head dim, dtype, mask, config) serves every shape and every layout whose rows are contiguous: (B, S, H, D)
tensors and (B, H, S, D) ones alike, read through (B, H, S, D) strides.  Causal masks are aligned to the
bottom-right corner (query i sees key j <= i + Sk - Sq), as flash-attn >= 2.1.

Configs: attention_config; the torch side: ops/attention.py."""


import math

import tile_ops
import tile_ops.lang as T

from .attention_config import AttentionConfig

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def strided(name: str, dims: tuple, dtype: str, vec: int):
    """A (B, H, S, D) view whose batch, head and row strides are read at launch (multiples of ``vec``)."""
    strides = tuple(T.dynamic(f"{name}_stride_{axis}", multiple_of=vec) for axis in "bhs")
    return T.Tensor(dims, dtype, strides=strides + (1,))


@tile_ops.jit(out_idx=[])
def flash_attention_forward(dim: int, dtype: str = "float16", causal: bool = False, window: tuple = (-1, -1),
                            softcap: float = 0.0, alibi: bool = False, scale: float | None = None,
                            cfg: AttentionConfig = AttentionConfig()):
    """``window`` = (left, right): a query row sees keys within ``left`` before and ``right`` after its diagonal
    (-1: unbounded); ``causal`` is right = 0.  ``softcap`` > 0: scores become softcap * tanh(scores / softcap)
    before the ALiBi bias (-slope * |distance to the diagonal|) is added; ``scale`` defaults to 1/sqrt(dim)."""
    left, right = window
    right = 0 if causal else right
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    bM, bN = cfg.block_M, cfg.block_N
    vec = 16 // (2 if dtype in ("float16", "bfloat16") else 4)  # a 16-byte row chunk: TMA's and cp.async's unit
    B, Hq, Hkv, Sq, Sk = T.dynamic("B"), T.dynamic("Hq"), T.dynamic("Hkv"), T.dynamic("Sq"), T.dynamic("Sk")
    inf = T.infinity("float32")

    def score(s, q, k, slope):
        """The score of query ``q`` and key ``k`` in log2 units, from the raw product ``s``."""
        x = s * (scale * LOG2E) if softcap <= 0 else T.tanh(s * (scale / softcap)) * (softcap * LOG2E)
        if alibi:
            x = x - slope * LOG2E * T.cast(T.abs(q + (Sk - Sq) - k), "float32")
        return x

    def visible(q, k):
        """Whether query ``q`` sees key ``k``: inside the keys, and the window around its diagonal."""
        cond = k < Sk
        if right >= 0:
            cond = cond & (k <= q + (Sk - Sq) + right)
        if left >= 0:
            cond = cond & (k >= q + (Sk - Sq) - left)
        return cond

    def key_tiles(bx):
        """(first, count) of the key tiles block ``bx``'s rows see."""
        end = Sk if right < 0 else T.min(Sk, (bx + 1) * bM + (Sk - Sq) + right)
        start = 0 if left < 0 else T.max(bx * bM + (Sk - Sq) - left, 0)
        first = start // bN
        return first, T.max(T.ceildiv(end, bN) - first, 0)

    q_type, o_type = strided("Q", (B, Hq, Sq, dim), dtype, vec), strided("O", (B, Hq, Sq, dim), dtype, vec)
    k_type, v_type = strided("K", (B, Hkv, Sk, dim), dtype, vec), strided("V", (B, Hkv, Sk, dim), dtype, vec)
    lse_type = T.Tensor((B, Hq, Sq), "float32")

    def attention(Q, K, V, O, LSE, Slopes=None):
        with T.Kernel(T.ceildiv(Sq, bM), Hq, B, threads=cfg.threads) as (bx, h, b):
            kv_head = h // (Hq // Hkv)  # GQA/MQA: a group of query heads reads one K/V head
            slope = Slopes[b, h] if alibi else 0.0
            Q_s = T.alloc_shared((bM, dim), dtype)
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            S = T.alloc_fragment((bM, bN), "float32")
            P = T.alloc_fragment((bM, bN), dtype)
            acc = T.alloc_fragment((bM, dim), "float32")
            m = T.alloc_fragment((bM,), "float32")  # running row max of the scores (log2 units)
            rescale = T.alloc_fragment((bM,), "float32")  # the previous max, then 2^(previous - new)
            l = T.alloc_fragment((bM,), "float32")  # running row sum of 2^(score - m)
            l_tile = T.alloc_fragment((bM,), "float32")
            T.copy(Q[b, h, bx * bM, 0], Q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -inf)
            first, count = key_tiles(bx)
            for t in T.Pipelined(count, num_stages=cfg.num_stages):
                k0 = (first + t) * bN
                T.copy(K[b, kv_head, k0, 0], K_s)  # keys past Sk load as 0; the mask hides them
                T.copy(V[b, kv_head, k0, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                for i, j in T.Parallel(bM, bN):
                    q, k = bx * bM + i, k0 + j
                    S[i, j] = T.where(visible(q, k), score(S[i, j], q, k, slope), -inf)
                T.copy(m, rescale)
                T.reduce_max(S, m, dim=1, clear=False)
                for i in T.Parallel(bM):  # a row that has seen no key yet keeps m = -inf: subtract 0 instead
                    rescale[i] = T.exp2(rescale[i] - T.where(m[i] == -inf, 0.0, m[i]))
                for i, j in T.Parallel(bM, bN):
                    S[i, j] = T.exp2(S[i, j] - T.where(m[i] == -inf, 0.0, m[i]))
                T.reduce_sum(S, l_tile, dim=1)
                for i in T.Parallel(bM):
                    l[i] = l[i] * rescale[i] + l_tile[i]
                for i, j in T.Parallel(bM, dim):
                    acc[i, j] = acc[i, j] * rescale[i]
                T.copy(S, P)  # in S's register layout: the A operand of P V
                T.gemm(P, V_s, acc, policy="full_row")
            for i, j in T.Parallel(bM, dim):
                acc[i, j] = T.where(l[i] > 0, acc[i, j] / l[i], 0.0)
            T.copy(acc, O[b, h, bx * bM, 0])
            for i in T.Parallel(bM):  # natural log, as flash-attn's
                LSE[b, h, bx * bM + i] = T.where(l[i] > 0, (m[i] + T.log2(l[i])) * LN2, -inf)

    if alibi:  # one slope per (batch, head): a (B, Hq) view, a (Hq,) one expanded over the batch (stride 0)
        @T.prim_func
        def flash_attention(Q: q_type, K: k_type, V: v_type, O: o_type, LSE: lse_type,
                            Slopes: T.Tensor((B, Hq), "float32", strides=(T.dynamic("slopes_stride_b"), 1))):
            attention(Q, K, V, O, LSE, Slopes)
    else:
        @T.prim_func
        def flash_attention(Q: q_type, K: k_type, V: v_type, O: o_type, LSE: lse_type):
            attention(Q, K, V, O, LSE)

    return flash_attention
