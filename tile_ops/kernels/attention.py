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
from .attention_mask import LN2, LOG2E, Window, kernel_function, score_log2, sequence, signature, store_rows, strided


@tile_ops.jit(out_idx=[])
def flash_attention_forward(dim: int, dtype: str = "float16", causal: bool = False, local: bool = False,
                            softcap: bool = False, alibi: bool = False, varlen: bool = False,
                            cfg: AttentionConfig = AttentionConfig()):
    """The mask kind and score transform are compile-time, their numbers launch-time scalars: ``scale``;
    ``softcap`` (with ``softcap=True``: scores become softcap * tanh(scores / softcap), before the ALiBi bias
    -slope * |distance to the diagonal| is added); ``window_left`` / ``window_right`` (with ``local=True``: a
    query row sees keys within left before and right after its diagonal, -1 unbounded; ``causal`` fixes right
    at 0).  ``varlen``: packed sequences, flash-attn's varlen layout: Q, K, V and O are (1, H, total, D) views of
    (total, H, D) tensors, sequence s their rows CuQ[s]:CuQ[s + 1] (CuK[s]:CuK[s + 1] of K and V), LSE (1, H,
    total_q); a block computes the query tile ``Tiles[bx]`` = (sequence, query block), so the grid holds
    only tiles that exist, in the order the launch chooses (longest first).  Rows past a sequence's end are
    read (a neighbour's, masked as keys past its length) but never written."""
    bM, bN = cfg.block_M, cfg.block_N
    vec = 16 // (2 if dtype in ("float16", "bfloat16") else 4)  # a 16-byte row chunk: TMA's and cp.async's unit
    B, Hq, Hkv, Sq, Sk = T.dynamic("B"), T.dynamic("Hq"), T.dynamic("Hkv"), T.dynamic("Sq"), T.dynamic("Sk")
    inf = T.infinity("float32")
    capped = softcap

    def attention(Q, K, V, O, LSE, scale, softcap, window_left, window_right, Slopes=None, Tiles=None, CuQ=None,
                  CuK=None):
        plain = not capped and not alibi
        c = scale * LOG2E if plain else 1.0  # what turns the scores in S (and m) into log2 units
        # a cluster's query blocks share the K/V loads (multicast) where they walk the same key tiles
        n = cfg.cluster if not (causal or local or varlen) else 1
        grid = (Tiles.shape[0], Hq) if varlen else (T.ceildiv(Sq, n * bM) * n, Hq, B)
        with T.Kernel(*grid, threads=cfg.threads, cluster=n) as blocks:
            bx, h, b, seq, q_start, k_start, seq_q, seq_k = sequence(varlen, blocks, Tiles, CuQ, CuK, Sq, Sk)
            window = Window(seq_q, seq_k, causal, local, window_left, window_right)
            kv_head = h // (Hq // Hkv)  # GQA/MQA: a group of query heads reads one K/V head
            slope = Slopes[seq, h] if alibi else 0.0
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
            T.copy(Q[b, h, q_start + bx * bM, 0], Q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -inf)
            first, count = window.key_tiles(bx * bM, bM, bN)
            for t in T.Pipelined(count, num_stages=cfg.num_stages, mma_turns=True):
                k0 = (first + t) * bN
                T.copy(K[b, kv_head, k_start + k0, 0], K_s)  # keys past the sequence: masked (0 past the tensor)
                T.copy(V[b, kv_head, k_start + k0, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                with T.deferred():  # the tile's P V ends the iteration: on sm_90a it runs under the next softmax
                    T.gemm(P, V_s, acc, policy="full_row")
                for i, j in T.Parallel(bM, bN):
                    q, k = bx * bM + i, k0 + j
                    S[i, j] = T.where(window.visible(q, k), S[i, j] if plain else score_log2(
                        S[i, j], q, k, seq_q, seq_k, scale, softcap, slope, capped, alibi), -inf)
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
            store_rows(varlen, acc, O, b, h, q_start, bx * bM, seq_q)
            for i in T.Parallel(bM):  # natural log, as flash-attn's
                with T.when(bx * bM + i < seq_q):
                    LSE[b, h, q_start + bx * bM + i] = T.where(l[i] > 0, (m_sub[i] + T.log2(l[i])) * LN2, -inf)

    tensors = dict(Q=strided("Q", (B, Hq, Sq, dim), dtype, vec), K=strided("K", (B, Hkv, Sk, dim), dtype, vec),
                   V=strided("V", (B, Hkv, Sk, dim), dtype, vec), O=strided("O", (B, Hq, Sq, dim), dtype, vec),
                   LSE=T.Tensor((B, Hq, Sq), "float32"))
    return T.prim_func(kernel_function("flash_attention", signature(B, Hq, alibi, varlen, tensors), attention))
