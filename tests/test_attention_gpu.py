"""FlashAttention on the GPU against a float64 reference, fresh random inputs, outputs poisoned with NaN first:
the forward's features crossed with odd lengths (the LSE too), (B, H, S, D) tensors transposed as transformers
builds them (no copies: the kernel reads their strides), varlen with zero-length sequences, and one kernel per
(head dim, dtype, mask) whatever the lengths; the backward kernels' dQ, dK, dV over the same matrix against
float64 autograd of the reference."""

import itertools
import math

import pytest
import torch

import tile_ops
from tile_ops.kernels.attention_launch import (attention_problem, build_attention, launch_attention,
                                               launch_attention_backward)
from tile_ops.ops.attention import attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed, layout="bshd"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)]
    if layout == "bhsd":  # (B, H, S, D) storage seen as (B, S, H, D): transformers' layout
        return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
                for b, s, h, d in shapes]
    return [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]


def _check(out, lse, q, k, v, tol, **kw):
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), return_lse=True, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ~ref_lse.isinf()
    assert not finite.any() or (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    assert err < tol, err


CASES = [
    # (B, Hq, Hkv, Sq, Sk, D), options
    ((2, 4, 4, 257, 333, 64), dict()),
    ((1, 8, 2, 1000, 1000, 128), dict(causal=True)),
    ((2, 4, 1, 77, 300, 96), dict(causal=True)),  # Sq < Sk: bottom-right
    ((1, 2, 2, 300, 77, 128), dict(causal=True)),  # Sq > Sk: rows with no key
    ((1, 4, 4, 513, 700, 192), dict(window_size=(100, 20))),
    ((1, 2, 1, 400, 400, 256), dict(softcap=30.0, causal=True)),
    ((2, 4, 2, 129, 255, 128), dict(alibi=True)),
    ((1, 3, 3, 1, 5000, 128), dict()),  # decode-like: one query row
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape, kw", CASES, ids=[f"{'x'.join(map(str, s))}-{'-'.join(k) or 'plain'}" for s, k in CASES])
def test_forward_matches_float64(shape, kw, dtype):
    B, Hq, Hkv, Sq, Sk, D = shape
    kw = dict(kw)
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=sum(shape))
    slopes = torch.rand(Hq, device="cuda") * 0.2 if kw.pop("alibi", False) else None
    out = torch.full((B, Sq, Hq, D), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda")
    launch_attention(q, k, v, out, lse, None, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                     kw.get("softcap", 0.0), slopes)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, 2e-2 if dtype == torch.bfloat16 else 4e-3, alibi_slopes=slopes, **kw)


def test_transposed_inputs_reach_the_kernel_without_copies():
    """(B, H, S, D) storage seen as (B, S, H, D): the call allocates its two outputs and nothing else (a copy of
    q, k or v would be a third allocation), on the checked path and from its plan.  (Counted, not summed: the
    caching allocator may hand out a cached block larger than asked.)"""
    from tile_ops.ops import fastpath

    q, k, v = _inputs(2, 8, 8, 300, 300, 128, torch.bfloat16, seed=1, layout="bhsd")
    assert not q.is_contiguous()
    fastpath.clear()
    for _ in range(2):  # the checked path (which records the plan), then the plan
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        out, lse, _ = tile_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocations == 2
        _check(out, lse, q, k, v, 2e-2, causal=True)


def test_one_kernel_for_every_length_and_scale():
    problem = attention_problem(torch.empty(1, 1, 1, 128, dtype=torch.float16), causal=True)
    kernel = build_attention(problem)
    for i, (Sq, Sk, scale) in enumerate(((1, 1, None), (100, 1000, 0.05), (4097, 4097, None), (63, 65, 0.3))):
        q, k, v = _inputs(1, 2, 2, Sq, Sk, 128, torch.float16, seed=i)
        out, lse, _ = tile_ops.flash_attn_func(q, k, v, causal=True, softmax_scale=scale, return_attn_probs=True)
        _check(out, lse, q, k, v, 4e-3, causal=True, softmax_scale=scale)
        assert build_attention(attention_problem(q, causal=True)) is kernel


def test_varlen_with_empty_sequences():
    lengths = [0, 130, 1, 0, 517, 64]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    out, lse, _ = tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                  return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, total)
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        if e > s:
            ref, ref_lse = attention_reference(q[s:e][None].double(), k[s:e][None].double(), v[s:e][None].double(),
                                               causal=True, return_lse=True)
            assert (out[s:e].double() - ref[0]).abs().max() < 4e-3 * ref.abs().max()
            assert (lse[:, s:e].double() - ref_lse[0]).abs().max() < 2e-3


def test_varlen_in_one_launch_with_slopes_softcap_gqa_and_gradients():
    """Per-sequence ALiBi slopes, a softcap, GQA, K/V lengths of their own (one sequence without keys) in one
    launch, poisoned outputs, NaN in the rows past the last sequence; the gradients (the varlen backward) against
    float64, and 0 on the rows of no sequence."""
    lq, lk, Hq, Hkv, D = [300, 7, 0, 129, 1], [200, 0, 5, 129, 640], 4, 2, 128
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device="cuda") for x in (lq, lk))
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(sum(lens) + 3, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               for lens, h in ((lq, Hq), (lk, Hkv), (lk, Hkv)))
    for t, lens in ((q, lq), (k, lk), (v, lk)):  # rows of no sequence: as uninitialized memory may hold
        t[sum(lens):] = math.nan
        t.requires_grad_()
    slopes = torch.rand(len(lq), Hq, device="cuda", generator=gen) * 0.1
    torch.empty(1 << 26, device="cuda").fill_(math.nan)  # freed: the outputs reuse poisoned memory
    kw = dict(causal=True, softcap=20.0, alibi_slopes=slopes)
    out, lse, _ = tile_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **kw)
    assert torch.equal(out[sum(lq):], torch.zeros_like(out[sum(lq):])) and bool((lse[:, sum(lq):] == -math.inf).all())
    dout = torch.randn_like(out)
    out.backward(dout)
    for i, (q0, q1, k0, k1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])):
        if q1 == q0:
            continue
        qs, ks, vs = (t.detach()[None, a:b].double().requires_grad_() for t, a, b in ((q, q0, q1), (k, k0, k1),
                                                                                       (v, k0, k1)))
        _check(out[None, q0:q1], lse[None, :, q0:q1], qs.detach(), ks.detach(), vs.detach(), 2e-2,
               **dict(kw, alibi_slopes=slopes[i]))
        attention_reference(qs, ks, vs, **dict(kw, alibi_slopes=slopes[i])).backward(dout[None, q0:q1].double())
        for got, want in ((q.grad[q0:q1], qs.grad[0]), (k.grad[k0:k1], ks.grad[0]), (v.grad[k0:k1], vs.grad[0])):
            assert want.numel() == 0 or (got.double() - want).abs().max() <= 3e-2 * want.abs().max().clamp_min(1e-3)
    for t, lens in ((q, lq), (k, lk), (v, lk)):
        assert torch.equal(t.grad[sum(lens):], torch.zeros_like(t.grad[sum(lens):]))


def test_no_keys_gives_zero_and_minus_infinity():
    q = torch.randn(1, 5, 2, 64, device="cuda", dtype=torch.float16)
    k = v = torch.randn(1, 0, 2, 64, device="cuda", dtype=torch.float16)
    out, lse, _ = tile_ops.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


def test_compiled_fullgraph_dynamic_and_autograd():
    """torch.compile(fullgraph=True, dynamic=True) over the CUDA op at two lengths, and its gradients (the
    backward kernels through autograd) against float64 autograd."""
    f = torch.compile(lambda q, k, v: tile_ops.flash_attn_func(q, k, v, causal=True), fullgraph=True, dynamic=True)
    for i, (Sq, Sk) in enumerate(((100, 130), (257, 257))):
        q, k, v = _inputs(2, 4, 2, Sq, Sk, 64, torch.bfloat16, seed=10 + i)
        ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
        assert ((f(q, k, v).double() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 77, 99, 128, torch.float16, seed=5))
    tile_ops.flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_reference(q64, k64, v64, causal=True).square().sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2


BACKWARD_CASES = CASES + [
    ((1, 4, 4, 333, 257, 64), dict(window_size=(50, 10))),
    ((2, 2, 2, 200, 200, 128), dict(softcap=10.0, causal=True)),
    ((2, 4, 2, 301, 250, 256), dict(alibi=True, window_size=(90, 30))),  # the head-dim-split kernel: GQA, ragged
    ((1, 2, 2, 130, 200, 192), dict(causal=True)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape, kw", BACKWARD_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{'-'.join(k) or 'plain'}" for s, k in BACKWARD_CASES])
def test_backward_matches_float64(shape, kw, dtype):
    """dQ, dK, dV (written over NaN) and the LSE's gradient path (grad_lse) against float64 autograd."""
    B, Hq, Hkv, Sq, Sk, D = shape
    kw = dict(kw)
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=sum(shape) + 1)
    slopes = torch.rand(Hq, device="cuda") * 0.2 if kw.pop("alibi", False) else None
    causal, window, softcap = kw.get("causal", False), kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
    gen = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=gen)
    glse = torch.randn(B, Hq, Sq, device="cuda", generator=gen)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, return_lse=True, alibi_slopes=slopes, **kw)
    torch.autograd.backward([ref, ref_lse], [dout.double(), glse.double().masked_fill(ref_lse.isinf(), 0)])
    out = torch.empty(B, Sq, Hq, D, dtype=dtype, device="cuda")
    lse = torch.empty(B, Hq, Sq, device="cuda")
    launch_attention(q, k, v, out, lse, None, causal, window, softcap, slopes)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, None, causal, window, softcap, slopes, glse)
    torch.cuda.synchronize()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        assert not got.isnan().any(), name
        err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        assert err < tol, (name, err)


@pytest.mark.parametrize("dim, kw", [(128, dict(causal=True)), (128, dict(window_size=(64, 0), softcap=5.0)),
                                     (256, dict(causal=True))], ids=["causal", "window", "causal-d256"])
def test_deterministic_gradients_are_bit_identical(dim, kw):
    """``deterministic=True``: dQ from the query-block kernel (no atomics): two runs give the same bits, and they
    match float64 autograd; the default (atomic dQ) matches too."""
    q, k, v = (t.requires_grad_() for t in _inputs(2, 8, 2, 700, 900, dim, torch.bfloat16, seed=21))
    dout = torch.randn(2, 700, 8, dim, device="cuda", dtype=torch.bfloat16)
    runs = []
    for deterministic in (True, True, False):
        out = tile_ops.flash_attn_func(q, k, v, deterministic=deterministic, **kw)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_reference(q64, k64, v64, **kw), (q64, k64, v64), dout.double())
    for got in (runs[0], runs[2]):
        for g, w in zip(got, want):
            assert ((g.double() - w).abs().max() / w.abs().max()).item() < 3e-2


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(40, 8), softcap=5.0, alibi=True)],
                         ids=["causal", "window-softcap-alibi"])
def test_repeated_calls_run_from_their_plan(kw):
    """The first call of a signature records its plan, the next ones launch it from C++ (fastpath.py) on their own
    inputs: outputs over fresh allocations, against float64, the same bits as the checked path; another scale or
    layout is another signature."""
    from tile_ops.ops import fastpath

    kw = dict(kw)
    slopes = torch.rand(8, device="cuda") * 0.2 if kw.pop("alibi", False) else None
    fastpath.clear()
    results = []
    for seed in (40, 41, 41):
        q, k, v = _inputs(2, 8, 2, 333, 400, 128, torch.bfloat16, seed=seed, layout="bhsd")
        results.append(tile_ops.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **kw)[:2])
        if seed == 40:
            assert fastpath.count() == 1
    assert fastpath.count() == 1  # the later calls ran from the plan
    _check(*results[1], q, k, v, 2e-2, alibi_slopes=slopes, **kw)
    assert torch.equal(results[1][0], results[2][0]) and torch.equal(results[1][1], results[2][1])
    checked = torch.ops.tile_ops.flash_attention.default  # (the same op: served by the plan too)
    tile_ops.flash_attn_func(q, k, v, softmax_scale=0.1, alibi_slopes=slopes, **kw)
    assert fastpath.count() == 2
    fastpath.clear()
    out, lse = checked(q, k, v, None, kw.get("causal", False), *kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                       slopes)
    assert torch.equal(out, results[2][0]) and torch.equal(lse, results[2][1])


def test_torch_func_on_cuda():
    """torch.func on the CUDA op: per-sample gradients (vmap of grad: the backward kernels over the folded batch)
    and forward mode, against float64."""
    q, k, v = _inputs(1, 4, 2, 130, 150, 64, torch.float16, seed=50)
    Q = torch.randn(3, *q.shape, device="cuda", dtype=torch.float16)
    loss = lambda f: lambda q: f(q).float().square().sum()  # noqa: E731
    grads = torch.func.vmap(torch.func.grad(loss(lambda q: tile_ops.flash_attn_func(q, k, v, causal=True))))(Q)
    k64, v64 = k.double(), v.double()
    for i in range(3):
        want = torch.func.grad(loss(lambda q: attention_reference(q, k64, v64, causal=True)))(Q[i].double())
        assert ((grads[i].double() - want).abs().max() / want.abs().max()).item() < 2e-2
    t = torch.randn_like(q)
    _, tangent = torch.func.jvp(lambda q: tile_ops.flash_attn_func(q, k, v, causal=True), (q,), (t,))
    _, want = torch.func.jvp(lambda q: attention_reference(q, k64, v64, causal=True), (q.double(),), (t.double(),))
    assert ((tangent.double() - want).abs().max() / want.abs().max()).item() < 2e-2


def test_expanded_inputs_and_gradients():
    """K and V expanded over the batch and their heads (stride 0, which TMA cannot step through) are copied, as is
    the expanded gradient of a sum: against float64 autograd."""
    q, k, v = _inputs(2, 4, 1, 100, 120, 64, torch.float16, seed=60)
    k, v = (t[:1].expand(2, -1, 4, -1) for t in (k, v))
    q.requires_grad_()
    out = tile_ops.flash_attn_func(q, k, v, causal=True)
    q64 = q.detach().double().requires_grad_()
    ref = attention_reference(q64, k.double(), v.double(), causal=True)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    out.sum().backward()
    ref.sum().backward()
    assert ((q.grad.double() - q64.grad).abs().max() / q64.grad.abs().max()).item() < 2e-2
