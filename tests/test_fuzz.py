"""The CPU side of the fuzzing (hypothesis; the GPU side is test_fuzz_gpu.py, same seeds and reruns):

* the attention op's CPU path (the float32 reference) against an oracle written apart from it, query row by
  query row from flash-attn's definitions (bottom-right causal diagonal, windows, softcap, ALiBi, GQA), over
  the GPU fuzz's space at short lengths;
* the gemm op's CPU path (batches, transposes, bias, out_dtype) against float64;
* random configs of the autotuner's gemm space at random shapes, lowered, built by nvcc and read back by the
  SASS check, as the autotuner would build them."""

import math

import pytest
import torch

from test_fuzz_gpu import (attention_cases, attention_kinds, case_key, check_attention, check_gemm, fuzz, gemm_cases,
                           gemm_kinds)
from tile_ops.jit.build import _find_tool

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 40


def row_by_row_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, return_lse=False):
    """(out, lse) of (B, S, H, D) float64 inputs, one query row at a time: query i sees key j when j lies in
    [i + Sk - Sq - left, i + Sk - Sq + right] (right = 0 if causal, -1 unbounded)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size[0], 0 if causal else window_size[1]
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            for i in range(Sq):
                diagonal = i + Sk - Sq
                keys = [j for j in range(Sk) if (right < 0 or j <= diagonal + right) and (left < 0 or j >= diagonal - left)]
                if not keys:
                    continue
                s = k[b, keys, kv] @ q[b, i, h] * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if alibi_slopes is not None:
                    s = s - alibi_slopes[h] * torch.tensor([abs(diagonal - j) for j in keys], dtype=torch.float64)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, kv]
    return (out, lse) if return_lse else out


@pytest.mark.parametrize("shard", range(2))
def test_fuzz_attention_reference_against_a_row_by_row_oracle(shard):
    check = lambda c: check_attention(dict(c, B=min(c["B"], 2)), "cpu", row_by_row_attention)  # noqa: E731
    fuzz(shard, attention_cases(attention_kinds(shard), max_len=24), check, case_key, examples=EXAMPLES)


def test_fuzz_gemm_reference():
    fuzz(0, gemm_cases(gemm_kinds(0, N=(8, 72, 255), K=(13, 64, 200)), max_m=300), lambda c: check_gemm(c, "cpu"),
         case_key, examples=EXAMPLES)


@st.composite
def tuner_configs(draw, op):
    from tile_ops.autotune import targets

    from tile_ops.compiler.targets import smem_limit

    target = targets.get(op)
    M, N, K = draw(st.integers(1, 5000)), draw(st.integers(1, 625)) * 8, draw(st.integers(2, 625)) * 8
    arch, dtype = draw(st.sampled_from(["sm_90a", "sm_80"])), draw(st.sampled_from(["float16", "bfloat16"]))
    fits = [c for c in target.config_space((M, N, K), dtype, arch)  # what the tuner builds (the rest it skips)
            if target.shared_memory_bytes(c, (M, N, K), dtype) <= smem_limit(arch)]
    return dict(op=op, shape=(M, N, K), arch=arch, dtype=dtype, cfg=draw(st.sampled_from(fits)))


def build_config(c):
    from tile_ops.autotune import targets

    kernel = targets.get(c["op"]).compile(c["shape"], c["dtype"], c["cfg"], c["arch"])
    assert kernel.meta.grid, c


@pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None, reason="nvcc not installed")
@pytest.mark.parametrize("op", ["gemm", "gemm_softmax"])
def test_fuzz_tuner_configs_lower_and_build(op, tmp_path, monkeypatch):
    """A config the autotuner may try at a shape lowers, builds, and passes the SASS accumulator-order check."""
    import tile_ops  # noqa: F401  (registers the ops' targets)

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    fuzz(0, tuner_configs(op), build_config, case_key, examples=4, distinct=1.0)
