"""A FlashAttention-2 forward kernel written in the tile language as the README describes it (S = Q K^T into a
float32 fragment, online softmax with T.reduce_max / T.reduce_sum, O rescaled in a T.Parallel by a row statistic of
S, P cast into a fragment that is the register A operand of P @ V), lowered for sm_80 and run on the CPU emulator
(tile_ops/jit/emulator.py) against a float64 softmax(Q K^T / sqrt(d)) V: several Q blocks and KV tiles, ragged
sequence lengths (keys past the end masked), a causal mask with a loop extent computed from the block index,
float16 and bfloat16.  P is rounded to the input dtype before P @ V, so results match to a tolerance, not exactly;
deliberately broken variants (no rescale of O, no mask of the padded keys) must miss it.  The same program also
builds for sm_90a (wgmma, TMA) where nvcc is present."""

import math
import time

import numpy as np
import pytest
import torch
from tvm.tirx import stmt as ts

import tile_ops
import tile_ops.lang as T
from test_compiler import needs_cuobjdump, needs_nvcc
from test_wgmma_rs import RS_PTX
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from tile_ops.jit.emulator import Emulator

LOG2E = math.log2(math.e)


def flash_attention(seq_q, seq_kv, dim, block_M=64, block_N=64, num_stages=2, threads=128, dtype="float16",
                    causal=False, rescale=True, mask=True):
    """O = softmax(Q K^T / sqrt(dim)) V for one head; ``rescale``/``mask`` False are the broken variants.  A
    sequence length of None is a T.dynamic size: one kernel for every length."""
    scale = LOG2E / math.sqrt(dim)  # exp(x / sqrt(d)) = exp2(x * scale)
    seq_q = T.dynamic("Sq") if seq_q is None else seq_q
    seq_kv = T.dynamic("Sk") if seq_kv is None else seq_kv

    @T.prim_func
    def main(Q: T.Tensor((seq_q, dim), dtype), K: T.Tensor((seq_kv, dim), dtype), V: T.Tensor((seq_kv, dim), dtype),
             O: T.Tensor((seq_q, dim), dtype)):
        with T.Kernel(T.ceildiv(seq_q, block_M), threads=threads) as bx:
            Q_s = T.alloc_shared((block_M, dim), dtype)
            K_s = T.alloc_shared((block_N, dim), dtype)
            V_s = T.alloc_shared((block_N, dim), dtype)
            S = T.alloc_fragment((block_M, block_N), "float32")
            P = T.alloc_fragment((block_M, block_N), dtype)
            acc = T.alloc_fragment((block_M, dim), "float32")
            m = T.alloc_fragment((block_M,), "float32")       # running row max of the raw scores
            m_prev = T.alloc_fragment((block_M,), "float32")
            l = T.alloc_fragment((block_M,), "float32")       # running row sum of exp2((s - m) * scale)
            l_tile = T.alloc_fragment((block_M,), "float32")
            T.copy(Q[bx * block_M, 0], Q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -T.infinity("float32"))  # exp2(-inf) = 0: the first tile's rescale of acc and l is 0
            tiles = T.ceildiv(seq_kv, block_N)
            if causal:  # the tiles up to the diagonal; none is fully masked for any row (block_M == block_N)
                tiles = T.min(tiles, T.ceildiv((bx + 1) * block_M, block_N))
            for k in T.Pipelined(tiles, num_stages=num_stages):
                T.copy(K[k * block_N, 0], K_s)  # rows past seq_kv load as 0: their scores are 0, not -inf
                T.copy(V[k * block_N, 0], V_s)
                # S and acc have different widths: both full_row, so a row's S and acc sit in the same threads
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                if mask:  # padded keys (and with causal, future keys) get probability exactly 0
                    for i, j in T.Parallel(block_M, block_N):
                        end = T.min(seq_kv, bx * block_M + i + 1) if causal else seq_kv  # keys before `end`
                        S[i, j] = T.if_then_else(k * block_N + j < end, S[i, j], -T.infinity("float32"))
                T.copy(m, m_prev)
                T.reduce_max(S, m, dim=1, clear=False)  # m = max(m_prev, this tile's row max)
                for i, j in T.Parallel(block_M, block_N):
                    S[i, j] = T.exp2(S[i, j] * scale - m[i] * scale)
                T.reduce_sum(S, l_tile, dim=1)
                for i in T.Parallel(block_M):
                    l[i] = l[i] * T.exp2(m_prev[i] * scale - m[i] * scale) + l_tile[i]
                if rescale:
                    for i, j in T.Parallel(block_M, dim):
                        acc[i, j] = acc[i, j] * T.exp2(m_prev[i] * scale - m[i] * scale)
                T.copy(S, P)  # P in S's register layout: the A operand of P @ V
                T.gemm(P, V_s, acc, policy="full_row")
            for i, j in T.Parallel(block_M, dim):
                acc[i, j] = acc[i, j] / l[i]
            T.copy(acc, O[bx * block_M, 0])

    return main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _bits(t):
    """A torch tensor as the numpy array the emulator takes: bfloat16 as uint16 bits."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def run_attention(seq_q, seq_kv, dim, dtype="float16", causal=False, lk=None, **kw):
    """(O from the emulator, float64 reference from the same rounded inputs, grid, PTX that ran), float64.
    ``lk``: a kernel lowered with T.dynamic lengths, run at these."""
    lk = lk or lower(flash_attention(seq_q, seq_kv, dim, dtype=dtype, causal=causal, **kw), "sm_80")
    gen = torch.Generator().manual_seed(seq_q * 1000 + seq_kv + dim)
    q, k, v = (torch.randn(n, dim, generator=gen).to(getattr(torch, dtype)) for n in (seq_q, seq_kv, seq_kv))
    out = torch.full((seq_q, dim), float("nan"), dtype=getattr(torch, dtype))  # written everywhere, or NaN shows
    lengths = {"Sq": seq_q, "Sk": seq_kv}
    emu = Emulator(lk.func, {"Q": _bits(q), "K": _bits(k), "V": _bits(v), "O": _bits(out), **lengths})
    emu.run(tuple(evaluate(g, lengths) for g in lk.meta.grid))
    s = q.double() @ k.double().T / math.sqrt(dim)
    if causal:
        s = s.masked_fill(torch.ones(seq_q, seq_kv, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.softmax(s, dim=1) @ v.double()
    return out.double().numpy(), ref.numpy(), lk.meta.grid, emu.ran


def rel_err(out, ref):
    return np.abs(out - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("shape, kw, grid, tiles, tol", [
    # 2 Q blocks; block 0 runs 1 KV tile, block 1 two: the loop extent depends on bx (3 tiles, not 4)
    pytest.param((128, 128, 64), dict(causal=True), (2, 1, 1), 3, 2e-3, id="causal-128x128-d64"),
    # 2 Q blocks x 2 KV tiles, both ragged: keys 72..127 of the last tile are zero-filled loads, masked
    pytest.param((100, 72, 32), dict(), (2, 1, 1), 4, 2e-3, id="ragged-100x72-d32"),
    # bfloat16 P and O round to 8 bits: 2^-8 relative
    pytest.param((64, 128, 32), dict(dtype="bfloat16"), (1, 1, 1), 2, 8e-3, id="bf16-64x128-d32"),
])
def test_flash_attention_matches_float64_softmax(shape, kw, grid, tiles, tol):
    t0 = time.perf_counter()
    out, ref, lk_grid, ran = run_attention(*shape, **kw)
    assert lk_grid == grid
    el = "bf16" if kw.get("dtype") == "bfloat16" else "f16"
    assert {"cp.async.cg.16", "ldmatrix.x4", "ldmatrix.x4.trans", f"mma.{el}"} <= set(ran), sorted(ran)
    # per KV tile and lane (4 warps of 16 rows): S is (64/8) x (dim/16) m16n8k16 steps, P @ V (dim/8) x (64/16)
    assert ran[f"mma.{el}"] == tiles * 128 * shape[2], ran
    assert not np.isnan(out).any()
    err = rel_err(out, ref)
    print(f"{shape} {kw}: max abs err / max |O| = {err:.2e} ({time.perf_counter() - t0:.1f} s)")
    assert err < tol


def test_one_kernel_runs_every_sequence_length():
    """Sq and Sk T.dynamic sizes: the grid, the KV loop's trip count (with causal, from bx too) and the key mask
    follow them at launch; one lowered kernel at several lengths, shorter than a tile and ragged."""
    lk = lower(flash_attention(None, None, 32, causal=True), "sm_80")
    assert lk.meta.dims == [("Sq", 1), ("Sk", 1)] and lk.meta.grid[0] == "((Sq + 63) // 64)"
    for seq_q, seq_kv in ((100, 72), (5, 130), (64, 64)):
        out, ref, grid, _ = run_attention(seq_q, seq_kv, 32, causal=True, lk=lk)
        assert grid == lk.meta.grid and not np.isnan(out).any()
        assert rel_err(out, ref) < 2e-3, (seq_q, seq_kv)


@pytest.mark.parametrize("broken", [dict(rescale=False), dict(mask=False)], ids=["no-rescale", "no-mask"])
def test_a_broken_variant_misses_the_tolerance(broken):
    """Without the rescale of O by exp2(m_old - m_new) the first tile's share keeps a stale max; without the mask
    the 56 zero-filled keys of the ragged tile each add exp2(-m) to the row sums (their V rows are 0, so only l
    shows it).  One Q block over two KV tiles, the last ragged."""
    out, ref, _, _ = run_attention(64, 72, 32, **broken)
    assert rel_err(out, ref) > 2e-2


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, dtype="bfloat16"), dict(seq_q=None, seq_kv=None)])
def test_flash_attention_builds_for_sm90a(kw):
    """The same program on the Hopper path: both gemms are wgmma (P @ V from registers), K and V tiles by TMA;
    with T.dynamic lengths too (the tensor maps' rows at launch)."""
    kw = dict(dict(seq_q=1000, seq_kv=1000), **kw)
    kernel = tile_ops.compile(flash_attention(kw.pop("seq_q"), kw.pop("seq_kv"), 64, **kw), target="sm_90a")
    assert RS_PTX.search(kernel.source)  # P @ V: wgmma with A from registers
    mix = kernel.instruction_mix()
    assert mix.get("HGMMA", 0) >= 8 and mix.get("UTMALDG", 0) >= 2, mix
