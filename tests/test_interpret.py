"""tile_ops.interpret: a program run on CPU tensors by the emulator, written in place, against float64 (the
README's matmul on both paths; the FlashAttention forward through strided views, TMA, wgmma and its scalars),
and its refusals."""

import math

import pytest
import torch

import tile_ops
from programs import matmul
from tile_ops.kernels.attention import flash_attention_forward
from tile_ops.kernels.attention_config import AttentionConfig
from tile_ops.ops.attention import attention_reference


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("arch, dtype", [("sm_80", torch.float16), ("sm_90a", torch.bfloat16)])
def test_the_readme_matmul_runs_on_cpu_tensors(arch, dtype):
    M, N, K = 70, 130, 64
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(M, K, generator=gen).to(dtype), torch.randn(K, N, generator=gen).to(dtype)
    c = torch.full((M, N), math.nan, dtype=dtype)
    ran = tile_ops.interpret(matmul.fn(M, N, K, dtype=str(dtype)[6:]), a, b, c, arch=arch)
    assert rel_err(c, a.double() @ b.double()) < 1e-2
    assert any(k.startswith(("mma.", "wgmma")) for k in ran), ran


def test_flash_attention_forward_through_strided_views():
    """(B, S, H, D) storage seen as the kernel's (B, H, S, D) views; scale and window by name; TMA and wgmma."""
    B, S, H, D = 1, 70, 2, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, S, H, D, generator=gen).half() for _ in range(3))
    out = torch.full((B, S, H, D), math.nan, dtype=torch.float16)
    lse = torch.full((B, H, S), math.nan)
    prog = flash_attention_forward.fn(D, "float16", causal=True, cfg=AttentionConfig(64, 64, 2, 128))
    ran = tile_ops.interpret(prog, *(t.transpose(1, 2) for t in (q, k, v, out)), lse, scale=D ** -0.5, softcap=0.0,
                             window_left=-1, window_right=-1)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    assert rel_err(out, ref) < 4e-3 and (lse.double() - ref_lse).abs().max() < 2e-3
    assert any(k.startswith("tma.load") for k in ran) and any(k.startswith("wgmma") for k in ran), ran


@pytest.mark.parametrize("args, kw, error, match", [
    (lambda a, b, c: (a, b), {}, TypeError, r"takes 3 tensors, one per parameter \(A, B, C\), got 2"),
    (lambda a, b, c: (a, b, c.to("meta")), {}, TypeError, "parameter C must be a CPU torch.Tensor, got a tensor on meta"),
    (lambda a, b, c: (a, b, c[:, :8]), {}, ValueError, r"parameter C must be float16\[64, 64\], got float16\[64, 8\]"),
    (lambda a, b, c: (a.t(), b, c), {}, ValueError, "parameter A must be contiguous"),
])
def test_bad_calls_are_named(args, kw, error, match):
    a, b, c = (torch.zeros(64, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(error, match=match):
        tile_ops.interpret(matmul.fn(64, 64, 64), *args(a, b, c), arch="sm_80", **kw)


def test_a_missing_scalar_is_named():
    prog = flash_attention_forward.fn(64, "float16", cfg=AttentionConfig(64, 64, 2, 128))
    t = torch.zeros(1, 2, 64, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="needs the T.Scalars softcap, window_left, window_right by name"):
        tile_ops.interpret(prog, t, t, t, t.clone(), torch.zeros(1, 2, 64), scale=0.1)


def test_a_stream_k_gemm_gets_a_zeroed_workspace_and_leaves_its_flags_zero():
    """128 x 128 x 512 in 64 x 64 tiles on 3 CTAs: a tile is split between two, one adding the other's partial
    from the workspace after its flag."""
    from tile_ops.kernels.gemm import gemm
    from tile_ops.kernels.gemm_config import GemmConfig

    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 128, 512, generator=gen).half(), torch.randn(1, 512, 128, generator=gen).half()
    c = torch.full((1, 128, 128), math.nan, dtype=torch.float16)
    prog = gemm.fn(128, 128, 512, 1, 1, 1, False, False, False, "float16", "float16",
                   GemmConfig(64, 64, 64, 3, 128, stream_k=2))
    ran = tile_ops.interpret(prog, a, b, torch.zeros(128, dtype=torch.float16), c, ctas=3)
    assert rel_err(c, a.double() @ b.double()) < 5e-3
    assert {"tile_ops_flag_signal", "tile_ops_flag_wait"} <= set(ran), sorted(ran)
    with pytest.raises(ValueError, match="ctas=3 sets a persistent kernel's CTA count"):
        tile_ops.interpret(matmul.fn(64, 64, 64), *(torch.zeros(64, 64, dtype=torch.float16) for _ in range(3)),
                           arch="sm_80", ctas=3)
