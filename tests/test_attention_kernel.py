"""The library's FlashAttention forward (tile_ops/kernels/attention.py) on the CPU: its programs lowered for
sm_80 and run on the emulator (tile_ops/jit/emulator.py) against a float64 reference, over the features crossed
with ragged lengths: batches and heads, GQA, Sq != Sk, causal (bottom-right), sliding windows, softcap,
ALiBi, rows that see no key (O = 0, LSE = -inf), (B, S, H, D) tensors read through their strides; one lowered
kernel at several shapes.  The sm_90a path too (warp-specialized: K and V by 4-D TMA through their strides,
S = Q K^T and P V as wgmma with P from registers, a persistent tile walk), and its build where nvcc is
present."""


import numpy as np
import pytest
import torch

import tile_ops
from test_compiler import needs_cuobjdump, needs_nvcc
from test_wgmma_rs import RS_PTX
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from tile_ops.kernels.attention import flash_attention_forward
from tile_ops.kernels.attention_config import AttentionConfig
from tile_ops.ops.attention import attention_reference
from tile_ops.jit.emulator import Emulator

SMALL = AttentionConfig(64, 32, 2, 128)
CTAS = 2  # a persistent grid's CTAs on the emulator: each walks several (query block, head, batch) tiles


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _bits(t):
    """A torch tensor's storage as the flat numpy array the emulator takes (bfloat16 as uint16 bits)."""
    flat = t.reshape(-1)
    return flat.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else flat.numpy()


def _program(dim, dtype="float16", cfg=SMALL, **kw):
    return flash_attention_forward.fn(dim, dtype, cfg=cfg, **kw)


def run_emulated(lk, B, Hq, Hkv, Sq, Sk, dim, dtype="float16", slopes=None, seed=0, scale=None, softcap=0.0,
                 window=(-1, -1), ctas=None):
    """(O, LSE) from the emulator and the float64 reference's, for (B, S, H, D) inputs read as (B, H, S, D)
    views (strided), outputs poisoned with NaN first; the kernel's scalars as given; ``ctas``: the persistent
    grid (default CTAS)."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(B, Sq, Hq, dim, generator=gen).to(dt)
    k = torch.randn(B, Sk, Hkv, dim, generator=gen).to(dt)
    v = torch.randn(B, Sk, Hkv, dim, generator=gen).to(dt)
    out = torch.full((B, Sq, Hq, dim), float("nan"), dtype=dt)
    lse = torch.full((B, Hq, Sq), float("nan"), dtype=torch.float32)
    arrays = {"Q": _bits(q), "K": _bits(k), "V": _bits(v), "O": _bits(out), "LSE": lse.numpy()}
    sizes = {"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "Sk": Sk}
    scalars = dict(scale=dim ** -0.5 if scale is None else scale, softcap=softcap, window_left=window[0],
                   window_right=window[1])
    for name, t in (("Q", q), ("K", k), ("V", v), ("O", out)):
        view = t.transpose(1, 2)
        sizes.update({f"{name}_stride_{a}": view.stride(i) for i, a in enumerate("bhs")})
    if slopes is not None:
        arrays["Slopes"] = slopes.expand(B, Hq).contiguous().reshape(-1).numpy()
        sizes["slopes_stride_b"] = Hq
    # sm_90a: the tensor maps as the launch encodes them at these sizes; the persistent walk's CTAs all resident
    at = lambda values: [evaluate(x, sizes) for x in values]  # noqa: E731
    tensormaps = {n: dict(t, dims=at(t["dims"]), strides=at(t["strides"])) for n, t in lk.meta.tensormaps.items()}
    emu = Emulator(lk.func, {**arrays, **sizes, **scalars}, tensormaps=tensormaps)
    if lk.meta.persistent_tiles:
        emu.run((ctas or CTAS, 1, 1), lk.meta.cluster_dims, resident=True)
    else:
        emu.run(tuple(at(lk.meta.grid)))
    return out.double(), lse.double(), (q, k, v), emu.ran


def reference(q, k, v, **kw):
    out, lse = attention_reference(q.double(), k.double(), v.double(), return_lse=True, **kw)
    return out, lse


def check(out, lse, ref_out, ref_lse, tol):
    assert not out.isnan().any(), "an output element was never written (or is NaN)"
    assert not lse.isnan().any()
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows with no visible key: LSE -inf exactly there"
    finite = ~ref_lse.isinf()
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    err = (out - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)
    assert err < tol, err


@pytest.mark.parametrize("case", [
    dict(shape=(2, 1, 1, 100, 70), kw=dict()),  # ragged: 2 query blocks, 3 key tiles, the last ones partial
    dict(shape=(1, 2, 1, 80, 80), kw=dict(causal=True)),  # GQA 2/1, the diagonal's tiles
    dict(shape=(1, 2, 1, 100, 33), kw=dict(causal=True)),  # Sq > Sk: the first 67 rows see no key
    dict(shape=(1, 2, 2, 20, 90), kw=dict(causal=True), dtype="bfloat16"),  # Sq < Sk: bottom-right
    dict(shape=(1, 1, 1, 128, 160), kw=dict(window=(20, 5))),  # a sliding window: tiles outside it skipped
    dict(shape=(1, 1, 1, 100, 100), kw=dict(window=(-1, 7), scale=0.3)),  # bounded on the right only
    dict(shape=(1, 2, 1, 70, 70), kw=dict(softcap=2.0, alibi=True, causal=True, window=(30, 0))),
], ids=["ragged", "gqa-causal", "causal-sq>sk", "causal-sq<sk-bf16", "window", "window-right", "softcap-alibi"])
def test_forward_matches_float64(case):
    B, Hq, Hkv, Sq, Sk = case["shape"]
    kw, dtype, dim = case["kw"], case.get("dtype", "float16"), 32
    window, causal = kw.get("window", (-1, -1)), kw.get("causal", False)
    local = window[0] >= 0 or (window[1] >= 0 and not causal)
    lk = lower(_program(dim, dtype, causal=causal, local=local, softcap=kw.get("softcap", 0) > 0,
                        alibi=kw.get("alibi", False)), "sm_80")
    slopes = torch.rand(Hq) * 0.3 if kw.get("alibi") else None
    out, lse, (q, k, v), ran = run_emulated(lk, B, Hq, Hkv, Sq, Sk, dim, dtype, slopes, scale=kw.get("scale"),
                                            softcap=kw.get("softcap", 0.0), window=window)
    ref_out, ref_lse = reference(q, k, v, causal=causal, window_size=window, softcap=kw.get("softcap", 0.0),
                                 alibi_slopes=slopes, softmax_scale=kw.get("scale"))
    check(out.transpose(1, 2), lse, ref_out.transpose(1, 2), ref_lse, 8e-3 if dtype == "bfloat16" else 2e-3)
    assert ran.get(f"mma.{'bf16' if dtype == 'bfloat16' else 'f16'}", 0) > 0 and ran.get("cp.async.cg.16", 0) > 0


def test_one_kernel_serves_every_shape():
    """Batch, heads, lengths, strides and the scale are all launch-time values: one lowered kernel runs several
    shapes."""
    lk = lower(_program(32, causal=True), "sm_80")
    for i, (B, Hq, Hkv, Sq, Sk, scale) in enumerate(((1, 1, 1, 5, 9, None), (1, 3, 1, 70, 31, 0.05),
                                                     (1, 1, 1, 64, 64, 0.4))):
        out, lse, (q, k, v), _ = run_emulated(lk, B, Hq, Hkv, Sq, Sk, 32, seed=i, scale=scale)
        ref_out, ref_lse = reference(q, k, v, causal=True, softmax_scale=scale)
        check(out, lse, ref_out, ref_lse, 2e-3)


def test_a_window_skips_the_tiles_outside_it():
    """A window of 8 keys before the diagonal: each 64-row block walks at most 3 of the 4 key tiles, not all."""
    lk = lower(_program(32, local=True), "sm_80")
    _, _, _, ran = run_emulated(lk, 1, 1, 1, 128, 128, 32, window=(8, 0))
    full = lower(_program(32), "sm_80")
    _, _, _, ran_full = run_emulated(full, 1, 1, 1, 128, 128, 32)
    assert ran["mma.f16"] * 8 == ran_full["mma.f16"] * 5, (ran["mma.f16"], ran_full["mma.f16"])  # 2+3 of 8


@pytest.mark.parametrize("case", [
    # one consumer warpgroup; 2 CTAs walk 4 tiles (2 query blocks x 2 heads); GQA, causal with Sq < Sk
    dict(shape=(1, 2, 1, 100, 130), cfg=AttentionConfig(64, 64, 2, 128), kw=dict(causal=True)),
    # two consumer warpgroups on 128 rows; bf16; a window with softcap and ALiBi; 2 key tiles
    dict(shape=(1, 1, 1, 100, 120), cfg=AttentionConfig(128, 64, 2, 256), dtype="bfloat16",
         kw=dict(window=(70, 10), softcap=5.0, alibi=True)),
    # clusters of two query blocks sharing each K/V load (multicast); 150 rows: the fourth block lies past Sq
    dict(shape=(1, 2, 1, 150, 130), cfg=AttentionConfig(64, 64, 2, 128, cluster=2), kw=dict()),
], ids=["causal-gqa", "2-warpgroups-window-softcap-alibi-bf16", "cluster-multicast"])
def test_hopper_path_matches_float64(case):
    """The warp-specialized sm_90a kernel on the emulator: TMA loads of the strided K and V, the wgmma pair
    (P from registers), the persistent walk over (query block, head, batch)."""
    B, Hq, Hkv, Sq, Sk = case["shape"]
    kw, dtype, dim = case["kw"], case.get("dtype", "float16"), 64
    window = kw.get("window", (-1, -1))
    lk = lower(_program(dim, dtype, cfg=case["cfg"], causal=kw.get("causal", False), local=window != (-1, -1),
                        softcap=kw.get("softcap", 0) > 0, alibi=kw.get("alibi", False)), "sm_90a")
    assert set(lk.meta.tensormaps) == {"K_tmap", "V_tmap"} and lk.meta.persistent_tiles
    slopes = torch.rand(Hq) * 0.3 if kw.get("alibi") else None
    out, lse, (q, k, v), ran = run_emulated(lk, B, Hq, Hkv, Sq, Sk, dim, dtype, slopes, softcap=kw.get("softcap", 0.0),
                                            window=window)
    ref_out, ref_lse = reference(q, k, v, causal=kw.get("causal", False), window_size=window,
                                 softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)
    check(out, lse, ref_out, ref_lse, 8e-3 if dtype == "bfloat16" else 2e-3)
    el = "bf16" if dtype == "bfloat16" else "f16"
    loads = "tma.load.4d.swizzle128" + (".multicast" if case["cfg"].cluster > 1 else "")
    assert ran[loads] and ran[f"wgmma.m64n64k16.{el}"] and ran[f"wgmma.m64n64k16.{el}.rs.trans-b"], ran


@pytest.mark.parametrize("length", [192, 320])
def test_causal_tiles_are_walked_in_snake_order(length):
    """A causal tile's key loop runs as many steps as its query block's index: the persistent CTAs take round
    r's tiles in order on even rounds and in reverse on odd ones, which evens out their steps.  Three tiles
    over 2 CTAs (the last round odd: its tile goes to CTA 1) and five (even: CTA 0): every tile once."""
    lk = lower(_program(64, causal=True), "sm_90a")
    out, lse, (q, k, v), _ = run_emulated(lk, 1, 1, 1, length, length, 64, ctas=2)
    ref_out, ref_lse = reference(q, k, v, causal=True)
    check(out, lse, ref_out, ref_lse, 2e-3)


def test_two_consumer_warpgroups_issue_their_gemms_in_turns():
    """T.Pipelined(mma_turns=True) with two consumer warpgroups: each step, warpgroup w waits on named barrier
    5 + w before its first wgmma (S = Q K^T) and signals the other's after its last (the deferred P V), so one's
    softmax runs under the other's gemms; warpgroup 1 hands warpgroup 0 the first turn.  (The emulator runs
    this kernel in test_hopper_path_matches_float64.)"""
    from tile_ops.compiler import compile_program

    source = compile_program(_program(64, cfg=AttentionConfig(128, 64, 2, 256)), "sm_90a").source
    assert "if (wgmma_warpgroup == 1) {\n      tvm_builtin_ptx_bar_arrive_arrive((uint)5, (uint)256);" in source
    loop = source[source.index("for (int k_1 = 1;"):]
    take = loop.index("tvm_builtin_ptx_bar_sync_count_sync(((uint)(wgmma_warpgroup + 5)), (uint)256);")
    give = loop.index("tvm_builtin_ptx_bar_arrive_arrive(((uint)(((wgmma_warpgroup + 1) & 1) + 5)), (uint)256);")
    first_mma, last_commit = loop.index("wgmma_f16_ss"), loop.index("wgmma_commit_group", loop.index("wgmma_f16_rs"))
    assert take < first_mma and last_commit < give < loop.index("wgmma_wait_group")


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("kw", [dict(dim=128), dict(dim=64, causal=True, dtype="bfloat16"),
                                dict(dim=256, causal=True, local=True, softcap=True, alibi=True)])
def test_forward_builds_for_sm90a(kw):
    """The Hopper path: K and V by TMA (their strides from the launch), S and P V as wgmma, P from registers."""
    from tile_ops.kernels.attention_config import default_config

    dim = kw.pop("dim")
    kernel = tile_ops.compile(_program(dim, kw.pop("dtype", "float16"), cfg=default_config(dim, "sm_90a"), **kw),
                              target="sm_90a")
    assert set(kernel.meta.tensormaps) == {"K_tmap", "V_tmap"}
    assert RS_PTX.search(kernel.source)
    mix = kernel.instruction_mix()
    assert mix.get("HGMMA", 0) >= 8 and mix.get("UTMALDG", 0) >= 2, mix
    assert kernel.meta.resources.get("spills", 0) == 0, kernel.meta.resources
