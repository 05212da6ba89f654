"""tile_ops.interpret: a program run on CPU tensors by the emulator, written in place, against float64 (the
README's matmul on both paths; the FlashAttention forward through strided views, TMA, wgmma and its scalars),
and its refusals."""

import importlib
import itertools
import math

import pytest
import torch

import tile_ops
from programs import matmul, matmul_any_m
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


def test_tile_ops_interpret_runs_the_factories_on_the_emulator(monkeypatch):
    """TILE_OPS_INTERPRET=1: a factory returns an interpreted kernel (nothing compiled, no GPU), called as a compiled
    one: outputs allocated NaN-filled on the CPU, or written in place (a T.dynamic M read from the tensors).  (Both
    paths run through the emulator in the tests above.)"""
    monkeypatch.setenv("TILE_OPS_INTERPRET", "1")
    jit = importlib.import_module("tile_ops.jit")  # (tile_ops.jit is the decorator)
    monkeypatch.setattr(jit, "_load_or_build", lambda *a: pytest.fail("compiled under TILE_OPS_INTERPRET"))
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(70, 64, generator=gen).half(), torch.randn(64, 130, generator=gen).half()
    kernel = matmul(70, 130, 64, block_M=64, block_N=64, target="sm_90a")
    assert isinstance(kernel, jit.interpret.Interpreted) and kernel is matmul(70, 130, 64, block_M=64,
                                                                                      block_N=64, target="sm_90a")
    assert rel_err(kernel(a, b), a.double() @ b.double()) < 1e-2
    assert any(k.startswith("wgmma") for k in kernel.ran), kernel.ran
    dynamic = matmul_any_m(130, 64, block_M=64, block_N=64, persistent=False, target="sm_90a")
    c = torch.full((70, 130), math.nan).half()
    dynamic.launch(a, b, c)  # M read from the tensors, written in place
    assert rel_err(c, a.double() @ b.double()) < 1e-2
    with pytest.raises(TypeError, match="takes 2 tensors"):
        kernel(a)


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


VARLEN = dict(lq=[5, 0, 67], lk=[9, 0, 66], Hq=2, Hkv=1, D=32)  # Sq != Sk, an empty sequence, lengths off the tiles
SCALARS = dict(scale=32 ** -0.5, softcap=0.0, window_left=-1, window_right=-1)


def packed_inputs(seed=3):
    """q (7 rows past the last sequence), k, v and the offsets of VARLEN's sequences."""
    lq, lk, Hq, Hkv, D = (VARLEN[n] for n in ("lq", "lk", "Hq", "Hkv", "D"))
    oq, ok = [0] + list(itertools.accumulate(lq)), [0] + list(itertools.accumulate(lk))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(oq[-1] + 7, Hq, D, generator=gen).half()
    k, v = (torch.randn(ok[-1] + 3, Hkv, D, generator=gen).half() for _ in range(2))
    return q, k, v, oq, ok


def packed(t):
    return t.unsqueeze(0).transpose(1, 2)


def sequences(oq, ok):
    return [(q0, q1, k0, k1) for q0, q1, k0, k1 in zip(oq, oq[1:], ok, ok[1:]) if q1 > q0]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_varlen_forward_writes_each_sequence_and_nothing_past_it(arch):
    """Packed sequences in one launch over their query tiles, GQA and causal: each matches float64 alone, and the
    rows past the last sequence stay as poisoned (a tile's rows past its sequence are never stored: T.when)."""
    from tile_ops.kernels.attention_launch import varlen_tiles

    q, k, v, oq, ok = packed_inputs()
    out, lse = torch.full_like(q, math.nan), torch.full((q.shape[1], q.shape[0]), math.nan)
    cfg = AttentionConfig(64, 64, 2, 128)
    tiles = torch.tensor(varlen_tiles(oq, ok, cfg.block_M, True), dtype=torch.int32)
    prog = flash_attention_forward.fn(VARLEN["D"], "float16", causal=True, varlen=True, cfg=cfg)
    tile_ops.interpret(prog, *map(packed, (q, k, v, out)), lse.unsqueeze(0), tiles, torch.tensor(oq, dtype=torch.int32),
                       torch.tensor(ok, dtype=torch.int32), arch=arch, **SCALARS)
    for q0, q1, k0, k1 in sequences(oq, ok):
        ref, ref_lse = attention_reference(q[None, q0:q1].double(), k[None, k0:k1].double(), v[None, k0:k1].double(),
                                           causal=True, return_lse=True)
        assert (out[q0:q1].double() - ref[0]).abs().max() < 4e-3
        assert torch.allclose(lse[:, q0:q1].double(), ref_lse[0], atol=2e-3)
    assert out[oq[-1]:].isnan().all() and lse[:, oq[-1]:].isnan().all()


def test_varlen_backward_kernels_match_each_sequence():
    """The key-block kernel (dK, dV stored only for its sequence's keys; dQ by atomic adds, of 0 past a sequence)
    and the query-block dQ kernel over the packed sequences of the forward test, against float64 autograd."""
    from tile_ops.kernels.attention_backward import attention_delta, flash_attention_backward, flash_attention_backward_dq
    from tile_ops.kernels.attention_launch import varlen_tiles

    q, k, v, oq, ok = packed_inputs()
    cfg, D = AttentionConfig(64, 64, 2, 128), VARLEN["D"]
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), -math.inf)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).half()
    refs = {}
    for q0, q1, k0, k1 in sequences(oq, ok):
        qs, ks, vs = (t[None, a:b].double().requires_grad_() for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        o, l_ = attention_reference(qs, ks, vs, causal=True, return_lse=True)
        out[q0:q1], lse[:, q0:q1] = o[0].detach().half(), l_[0].detach().float()
        o.backward(dout[None, q0:q1].double())
        refs[q0, k0] = (qs.grad[0], ks.grad[0], vs.grad[0])
    delta = torch.full((1,) + lse.shape, math.nan)
    tile_ops.interpret(attention_delta.fn(D, "float16"), packed(out), packed(dout), delta, arch="sm_90a")
    cu = [torch.tensor(o, dtype=torch.int32) for o in (oq, ok)]
    inputs = [*map(packed, (q, k, v, dout)), lse.unsqueeze(0), delta]
    dq_acc = torch.zeros(1, q.shape[1], q.shape[0], D)
    dk, dv = (torch.full_like(k, math.nan) for _ in range(2))
    key_tiles = torch.tensor(varlen_tiles(ok, oq, cfg.block_N, False), dtype=torch.int32)
    tile_ops.interpret(flash_attention_backward.fn(D, "float16", causal=True, varlen=True, cfg=cfg), *inputs,
                       dq_acc, packed(dk), packed(dv), key_tiles, *cu, arch="sm_90a", **SCALARS)
    dq_acc = dq_acc[0].transpose(0, 1)
    dq = torch.full_like(q, math.nan)
    query_tiles = torch.tensor(varlen_tiles(oq, ok, cfg.block_M, True), dtype=torch.int32)
    tile_ops.interpret(flash_attention_backward_dq.fn(D, "float16", causal=True, varlen=True, cfg=cfg), *inputs,
                       packed(dq), query_tiles, *cu, arch="sm_80", **SCALARS)
    for q0, q1, k0, k1 in sequences(oq, ok):
        rq, rk, rv = refs[q0, k0]
        for got, want in ((dq_acc[q0:q1], rq), (dq[q0:q1], rq), (dk[k0:k1], rk), (dv[k0:k1], rv)):
            assert (got.double() - want).abs().max() < 1e-2 * want.abs().max(), (q0, k0)
    assert dq[oq[-1]:].isnan().all() and dk[ok[-1]:].isnan().all() and dv[ok[-1]:].isnan().all()
    assert torch.equal(dq_acc[oq[-1]:], torch.zeros_like(dq_acc[oq[-1]:]))  # (adds of 0 past the last sequence)


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
