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
                                  (up to head dim 128 a shared tile at a time: TMA's reduce-add on sm_90a)

Two consumer warpgroups split the block's keys (64 each) up to head dim 128; beyond it dK and dV of 64 keys each
fill a warpgroup's registers, so the warpgroups split the head dim instead (FlashAttention-3's layout at head
dim 256): each computes half of S^T's and dP^T's query columns, P^T and dS^T go through shared memory whole,
and each warpgroup's dV, dK and dQ products take its half of the head dim.

Every size and stride is launch-time, as in the forward (one kernel per head dim, dtype, mask kind, config).
The torch side: ops/attention.py."""


import tile_ops
import tile_ops.lang as T

from .attention_config import AttentionConfig, splits_head_dim
from .attention_mask import LOG2E, Window, kernel_function, score_log2, sequence, signature, store_rows, strided


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


def _types(dim, dtype):
    """(B, H, S, D) views of the query side and the key side, the (B, Hq, Sq) rows."""
    B, Hq, Hkv, Sq, Sk = T.dynamic("B"), T.dynamic("Hq"), T.dynamic("Hkv"), T.dynamic("Sq"), T.dynamic("Sk")
    q_side = lambda n: strided(n, (B, Hq, Sq, dim), dtype, 8)  # noqa: E731
    k_side = lambda n: strided(n, (B, Hkv, Sk, dim), dtype, 8)  # noqa: E731
    return q_side, k_side, T.Tensor((B, Hq, Sq), "float32"), (B, Hq, Hkv, Sq, Sk)


def _ds(S, dP, q, k, window, Sq, Sk, lse2, delta, scale, cap, slope, softcap, alibi):
    """Statements of a T.Parallel over one (query q, key k) element: S (the raw product) becomes P, dP (dO V^T)
    becomes dS = P (dP - Delta) dscore/ds, from the row's log-sum-exp in base 2 ``lse2`` and its ``delta``."""
    x = score_log2(S, q, k, Sq, Sk, scale, cap, slope, softcap, alibi)
    if softcap:  # d score / d s through the cap's tanh: scale (1 - tanh^2), from the raw S
        t = T.tanh(S * scale / cap)
        ds = (dP - delta) * (scale - scale * t * t)
    else:
        ds = (dP - delta) * scale
    p = T.where(window.visible(q, k) & (q < Sq), T.exp2(x - lse2), 0.0)
    return p, ds


@tile_ops.jit(out_idx=[])
def flash_attention_backward(dim: int, dtype: str = "float16", causal: bool = False, local: bool = False,
                             softcap: bool = False, alibi: bool = False, atomic_dq: bool = True, varlen: bool = False,
                             cfg: AttentionConfig = AttentionConfig(64, 64, 2, 128)):
    """dK, dV (B, Hkv, Sk, D views) for the forward of the same mask kind and scalars, from its LSE (natural log)
    and Delta (attention_delta's); with ``atomic_dq`` also dQ_acc += dQ (float32 (B, Hq, Sq, D), zeroed by the
    caller), else dQ is flash_attention_backward_dq's.  ``cfg``: block_M queries a step, block_N keys a block.
    ``varlen``: packed sequences as the forward's (B = 1, a block per ``Tiles`` entry: (sequence, key block));
    dQ's rows past a sequence get adds of 0 (their dS is 0), dK's and dV's are not stored."""
    bM, bN = cfg.block_M, cfg.block_N
    capped = softcap  # (the kernel's parameter ``softcap`` is the cap's value)
    staged_dq = dim <= 128  # dQ's float32 tile through shared memory (a larger one does not fit beside the rest)
    split_dim = splits_head_dim(cfg)
    policy = "full_col" if split_dim else "full_row"
    q_side, k_side, rows, (B, Hq, Hkv, Sq, Sk) = _types(dim, dtype)
    tensors = {"Q": q_side("Q"), "K": k_side("K"), "V": k_side("V"), "dO": q_side("dO"), "LSE": rows, "Delta": rows}
    if atomic_dq:
        tensors["dQ_acc"] = T.Tensor((B, Hq, Sq, dim), "float32")
    tensors.update(dK=k_side("dK"), dV=k_side("dV"))

    def backward(Q, K, V, dO, LSE, Delta, dK, dV, scale, softcap, window_left, window_right, dQ_acc=None,
                 Slopes=None, Tiles=None, CuQ=None, CuK=None):
        grid = (Tiles.shape[0], Hkv) if varlen else (T.ceildiv(Sk, bN), Hkv, B)
        with T.Kernel(*grid, threads=cfg.threads) as blocks:
            bx, kv_head, b, seq, q_start, k_start, seq_q, seq_k = sequence(varlen, blocks, Tiles, CuQ, CuK, Sq, Sk)
            window = Window(seq_q, seq_k, causal, local, window_left, window_right)
            group = Hq // Hkv  # the query heads that read this K/V head
            k0 = bx * bN
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            Q_s = T.alloc_shared((bM, dim), dtype)
            dO_s = T.alloc_shared((bM, dim), dtype)
            ST = T.alloc_fragment((bN, bM), "float32")  # S^T, then P^T
            dPT = T.alloc_fragment((bN, bM), "float32")  # dP^T, then dS^T
            if split_dim:  # each warpgroup holds half of P^T's and dS^T's columns: the products read them whole
                PT_s = T.alloc_shared((bN, bM), dtype)
            else:
                PT = T.alloc_fragment((bN, bM), dtype)
                dST = T.alloc_fragment((bN, bM), dtype)
            dK_f = T.alloc_fragment((bN, dim), "float32")
            dV_f = T.alloc_fragment((bN, dim), "float32")
            # the step's LSE (base 2) and Delta by query, two slots: one barrier a step orders their reuse
            lse_s = T.alloc_shared((2, bM), "float32")
            delta_s = T.alloc_shared((2, bM), "float32")
            if atomic_dq or split_dim:
                dS_s = T.alloc_shared((bN, bM), dtype)
            if atomic_dq:
                dQ = T.alloc_fragment((bM, dim), "float32")
                dQ_s = T.alloc_shared((bM, dim), "float32") if staged_dq else None
            T.copy(K[b, kv_head, k_start + k0, 0], K_s)
            T.copy(V[b, kv_head, k_start + k0, 0], V_s)
            T.clear(dK_f)
            T.clear(dV_f)
            first, count = window.query_tiles(k0, bN, bM)
            for g in T.serial(group):  # the pipeline runs on across the group's heads (one producer walk)
                for t in T.Pipelined(count, num_stages=cfg.num_stages):
                    h = kv_head * group + g
                    q0 = (first + t) * bM
                    slot = (g * count + t) % 2  # alternate across the heads' steps too
                    T.copy(Q[b, h, q_start + q0, 0], Q_s)
                    T.copy(dO[b, h, q_start + q0, 0], dO_s)
                    for i in T.Parallel(bM):  # once a step, not once an element (queries are S^T's columns)
                        row = q_start + T.min(q0 + i, seq_q - 1)
                        lse_s[slot, i] = LSE[b, h, row] * LOG2E
                        delta_s[slot, i] = Delta[b, h, row]
                    T.gemm(K_s, Q_s, ST, transpose_B=True, clear_accum=True, policy=policy)
                    T.gemm(V_s, dO_s, dPT, transpose_B=True, clear_accum=True, policy=policy)
                    for j, i in T.Parallel(bN, bM):
                        p, ds = _ds(ST[j, i], dPT[j, i], q0 + i, k0 + j, window, seq_q, seq_k, lse_s[slot, i],
                                    delta_s[slot, i], scale, softcap, Slopes[seq, h] if alibi else 0.0, capped, alibi)
                        dPT[j, i] = ds
                        ST[j, i] = p
                        dPT[j, i] = dPT[j, i] * ST[j, i]
                    if split_dim:
                        T.copy(ST, PT_s)
                        T.copy(dPT, dS_s)
                        T.gemm(PT_s, dO_s, dV_f, policy=policy)
                        T.gemm(dS_s, Q_s, dK_f, policy=policy)
                    else:
                        T.copy(ST, PT)
                        T.gemm(PT, dO_s, dV_f, policy=policy)
                        T.copy(dPT, dST)
                        T.gemm(dST, Q_s, dK_f, policy=policy)
                        if atomic_dq:
                            T.copy(dST, dS_s)
                    if atomic_dq:
                        T.gemm(dS_s, K_s, dQ, transpose_A=True, clear_accum=True)
                        if staged_dq:  # one reduce-add of the tile (TMA's on sm_90a), not one per element
                            T.copy(dQ, dQ_s)
                            T.atomic_add(dQ_acc[b, h, q_start + q0, 0], dQ_s)
                        else:
                            T.atomic_add(dQ_acc[b, h, q_start + q0, 0], dQ)
            store_rows(varlen, dK_f, dK, b, kv_head, k_start, k0, seq_k)
            store_rows(varlen, dV_f, dV, b, kv_head, k_start, k0, seq_k)

    return T.prim_func(kernel_function("flash_attention_bwd", signature(B, Hq, alibi, varlen, tensors), backward))


@tile_ops.jit(out_idx=[])
def flash_attention_backward_dq(dim: int, dtype: str = "float16", causal: bool = False, local: bool = False,
                                softcap: bool = False, alibi: bool = False, varlen: bool = False,
                                cfg: AttentionConfig = AttentionConfig(64, 64, 2, 128)):
    """dQ (a (B, Hq, Sq, D) view, written) without atomics: a block owns ``block_M`` query rows and walks the key
    tiles they see, as the forward does, recomputing P and dP: dQ += dS K with dS from registers.  With the
    key-block kernel's dK and dV (``atomic_dq=False``) the deterministic backward."""
    bM, bN = cfg.block_M, cfg.block_N
    capped = softcap  # (the kernel's parameter ``softcap`` is the cap's value)
    q_side, k_side, rows, (B, Hq, Hkv, Sq, Sk) = _types(dim, dtype)
    tensors = {"Q": q_side("Q"), "K": k_side("K"), "V": k_side("V"), "dO": q_side("dO"), "LSE": rows, "Delta": rows,
               "dQ": q_side("dQ")}

    def backward_dq(Q, K, V, dO, LSE, Delta, dQ, scale, softcap, window_left, window_right, Slopes=None, Tiles=None,
                    CuQ=None, CuK=None):
        grid = (Tiles.shape[0], Hq) if varlen else (T.ceildiv(Sq, bM), Hq, B)
        with T.Kernel(*grid, threads=cfg.threads) as blocks:
            bx, h, b, seq, q_start, k_start, seq_q, seq_k = sequence(varlen, blocks, Tiles, CuQ, CuK, Sq, Sk)
            window = Window(seq_q, seq_k, causal, local, window_left, window_right)
            kv_head = h // (Hq // Hkv)
            q0 = bx * bM
            Q_s = T.alloc_shared((bM, dim), dtype)
            dO_s = T.alloc_shared((bM, dim), dtype)
            K_s = T.alloc_shared((bN, dim), dtype)
            V_s = T.alloc_shared((bN, dim), dtype)
            S = T.alloc_fragment((bM, bN), "float32")  # S, then P
            dP = T.alloc_fragment((bM, bN), "float32")  # dP, then dS
            dS = T.alloc_fragment((bM, bN), dtype)
            dQ_f = T.alloc_fragment((bM, dim), "float32")
            lse = T.alloc_fragment((bM,), "float32")  # the rows' LSE, then in base 2
            delta = T.alloc_fragment((bM,), "float32")
            T.copy(Q[b, h, q_start + q0, 0], Q_s)
            T.copy(dO[b, h, q_start + q0, 0], dO_s)
            T.copy(LSE[b, h, q_start + q0], lse)  # (rows past the sequence: the next one's, masked by q < seq_q)
            T.copy(Delta[b, h, q_start + q0], delta)
            for i in T.Parallel(bM):  # in base 2 once, not once an element
                lse[i] = lse[i] * LOG2E
            T.clear(dQ_f)
            first, count = window.key_tiles(q0, bM, bN)
            for t in T.Pipelined(count, num_stages=cfg.num_stages):
                k0 = (first + t) * bN
                T.copy(K[b, kv_head, k_start + k0, 0], K_s)
                T.copy(V[b, kv_head, k_start + k0, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                T.gemm(dO_s, V_s, dP, transpose_B=True, clear_accum=True, policy="full_row")
                for i, j in T.Parallel(bM, bN):
                    p, ds = _ds(S[i, j], dP[i, j], q0 + i, k0 + j, window, seq_q, seq_k, lse[i], delta[i], scale,
                                softcap, Slopes[seq, h] if alibi else 0.0, capped, alibi)
                    dP[i, j] = ds
                    S[i, j] = p
                    dP[i, j] = dP[i, j] * S[i, j]
                T.copy(dP, dS)
                T.gemm(dS, K_s, dQ_f, policy="full_row")
            store_rows(varlen, dQ_f, dQ, b, h, q_start, q0, seq_q)

    return T.prim_func(kernel_function("flash_attention_bwd_dq", signature(B, Hq, alibi, varlen, tensors),
                                       backward_dq))
