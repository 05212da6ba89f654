"""The FlashAttention backward (tile_ops/kernels/attention_backward.py) on the CPU emulator against float64 autograd
of the reference: dQ (added into a float32 buffer by every key block), dK and dV (GQA's group summed in the
block), over ragged lengths, causal with Sq != Sk, windows, softcap, ALiBi, and rows that see no key; on the
sm_80 path (mma.sync, cp.async) and the sm_90a one (TMA, wgmma, dS^T through shared memory)."""

import numpy as np
import pytest
import torch

from test_attention_kernel import _bits
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from tile_ops.kernels.attention_backward import attention_delta, flash_attention_backward, flash_attention_backward_dq
from tile_ops.kernels.attention_config import AttentionConfig, splits_head_dim
from tile_ops.ops.attention import attention_reference
from tile_ops.jit.emulator import Emulator

SMALL = AttentionConfig(64, 64, 2, 128)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _views(sizes, **tensors):
    """Each (B, S, H, D) tensor's (B, H, S, D) view strides, under the kernels' names."""
    for name, t in tensors.items():
        view = t.transpose(1, 2)
        sizes.update({f"{name}_stride_{a}": view.stride(i) for i, a in enumerate("bhs")})
    return sizes


def _run(lk, arrays, sizes, grid_or_ctas):
    at = lambda values: [evaluate(x, sizes) for x in values]  # noqa: E731
    maps = {n: dict(t, dims=at(t["dims"]), strides=at(t["strides"])) for n, t in lk.meta.tensormaps.items()}
    emu = Emulator(lk.func, {**arrays, **sizes}, tensormaps=maps)
    if lk.meta.persistent_tiles:
        emu.run((grid_or_ctas, 1, 1), lk.meta.cluster_dims, resident=True)
    else:
        emu.run(tuple(at(lk.meta.grid)))
    return emu.ran


def backward_emulated(arch, B, Hq, Hkv, Sq, Sk, dim, dtype="float16", cfg=SMALL, seed=0, causal=False,
                      window=(-1, -1), softcap=0.0, alibi=False, scale=None, deterministic=False):
    """(dQ, dK, dV) from the emulated kernels and from float64 autograd of the reference, for (B, S, H, D)
    inputs; the forward's O and LSE from the reference; outputs poisoned with NaN.  ``deterministic``: dQ from
    its own kernel instead of atomic adds."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(B, s, h, dim, generator=gen).to(dt) for s, h in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    dout = torch.randn(B, Sq, Hq, dim, generator=gen).to(dt)
    slopes = torch.rand(Hq, generator=gen) * 0.3 if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, softmax_scale=scale)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_reference(q64, k64, v64, return_lse=True, **kw)
    out64.backward(dout.double())
    out = out64.detach().to(dt).contiguous()

    delta = torch.full((B, Hq, Sq), float("nan"))
    sizes = _views({"B": B, "H": Hq, "S": Sq}, O=out, dO=dout)
    _run(lower(attention_delta.fn(dim, dtype), arch), {"O": _bits(out), "dO": _bits(dout), "Delta": delta.numpy()},
         sizes, 2)
    ref_delta = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    assert (delta.double() - ref_delta).abs().max() < 1e-3 * ref_delta.abs().max()

    local = window[0] >= 0 or (window[1] >= 0 and not causal)
    options = dict(causal=causal, local=local, softcap=softcap > 0, alibi=alibi, cfg=cfg)
    lk = lower(flash_attention_backward.fn(dim, dtype, atomic_dq=not deterministic, **options), arch)
    dq_acc = torch.zeros(B, Hq, Sq, dim)
    dq = torch.full((B, Sq, Hq, dim), float("nan"), dtype=dt)
    dk, dv = (torch.full((B, Sk, Hkv, dim), float("nan"), dtype=dt) for _ in range(2))
    arrays = {"Q": _bits(q), "K": _bits(k), "V": _bits(v), "dO": _bits(dout), "LSE": lse64.detach().float().numpy(),
              "Delta": delta.numpy(), "dK": _bits(dk), "dV": _bits(dv),
              "scale": dim ** -0.5 if scale is None else scale, "softcap": softcap, "window_left": window[0],
              "window_right": window[1]}
    sizes = _views({"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "Sk": Sk}, Q=q, K=k, V=v, dO=dout, dK=dk, dV=dv, dQ=dq)
    if alibi:
        arrays["Slopes"] = slopes.expand(B, Hq).contiguous().reshape(-1).numpy()
        sizes["slopes_stride_b"] = Hq
    if deterministic:
        ran = _run(lower(flash_attention_backward_dq.fn(dim, dtype, **options), arch), {**arrays, "dQ": _bits(dq)},
                   sizes, 2)
    else:
        arrays["dQ_acc"] = dq_acc.numpy()
    ran = _run(lk, arrays, sizes, 2) if not deterministic else {**ran, **_run(lk, arrays, sizes, 2)}
    ours = (dq.double() if deterministic else dq_acc.transpose(1, 2).double(), dk.double(), dv.double())
    return ours, (q64.grad, k64.grad, v64.grad), ran


def check(ours, refs, tol):
    for name, x, ref in zip(("dQ", "dK", "dV"), ours, refs):
        assert not x.isnan().any(), f"{name}: an element was never written (or is NaN)"
        err = (x - ref).abs().max() / ref.abs().max().clamp_min(1e-6)
        assert err < tol, (name, err.item())


CASES = [
    dict(shape=(1, 1, 1, 70, 100)),  # ragged: partial query and key tiles
    dict(shape=(1, 2, 1, 64, 80), kw=dict(causal=True)),  # GQA 2/1: a key block sums two heads' queries
    dict(shape=(1, 1, 1, 100, 40), kw=dict(causal=True)),  # Sq > Sk: the first 60 rows see no key
    dict(shape=(1, 1, 1, 64, 70), kw=dict(window=(20, 5), scale=0.3)),  # a window: query tiles outside it skipped
    dict(shape=(1, 1, 1, 50, 70), kw=dict(softcap=2.0, alibi=True, causal=True), dtype="bfloat16"),
]
IDS = ["ragged", "gqa-causal", "causal-sq>sk", "window", "softcap-alibi-bf16"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_float64_on_sm80(case):
    ours, refs, ran = backward_emulated("sm_80", *case["shape"], 32, case.get("dtype", "float16"), **case.get("kw", {}))
    check(ours, refs, 2e-2 if case.get("dtype") == "bfloat16" else 5e-3)
    assert ran.get("red.add.f32x1", 0) > 0


@pytest.mark.parametrize("arch, case", [("sm_80", CASES[2]), ("sm_90a", CASES[1])], ids=["sm_80-causal-sq>sk", "sm_90a-gqa"])
def test_deterministic_backward_matches_float64(case, arch):
    """dQ from its own kernel (query blocks walking their key tiles) and dK, dV without the atomic dQ: no atomics."""
    ours, refs, ran = backward_emulated(arch, *case["shape"], 32 if arch == "sm_80" else 64,
                                        case.get("dtype", "float16"), deterministic=True, **case.get("kw", {}))
    check(ours, refs, 5e-3)
    assert not any(k.startswith("red.add") for k in ran), ran


@pytest.mark.parametrize("case, cfg", [(CASES[1], SMALL), (CASES[4], SMALL), (CASES[0], AttentionConfig(64, 128, 2, 256))],
                         ids=[IDS[1], IDS[4], IDS[0] + "-two-warpgroups"])
def test_backward_matches_float64_on_sm90a(case, cfg):
    """dQ's tile staged in shared memory and added by TMA's reduce-add (no per-element atomics); with two
    consumer warpgroups (the H100's config) over a ragged shape too."""
    ours, refs, ran = backward_emulated("sm_90a", *case["shape"], 64, case.get("dtype", "float16"), cfg=cfg,
                                        **case.get("kw", {}))
    check(ours, refs, 2e-2 if case.get("dtype") == "bfloat16" else 5e-3)
    assert any(k.startswith("wgmma") and ".rs" in k for k in ran) and any(k.startswith("tma.load") for k in ran), ran
    assert any(k.startswith("tma.reduce_add") for k in ran) and not any(k.startswith("red.add") for k in ran), ran


@pytest.mark.parametrize("arch, dim", [("sm_90a", 128), ("sm_80", 64)])
def test_backward_with_warpgroups_splitting_the_head_dim(arch, dim):
    """The large-head-dim layout (64 keys a block over two warpgroups, each half the head dim): P^T and dS^T
    through shared memory, every product on wgmma (sm_90a) or warps side by side along N (sm_80)."""
    cfg = AttentionConfig(64, 64, 2, 256)
    assert splits_head_dim(cfg)
    case = CASES[1]
    ours, refs, ran = backward_emulated(arch, *case["shape"], dim, cfg=cfg, **case.get("kw", {}))
    check(ours, refs, 5e-3)
    if arch == "sm_90a":
        assert any(k.startswith("wgmma") for k in ran) and not any(k.startswith("mma") for k in ran), ran
