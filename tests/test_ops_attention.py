"""torch.ops.tile_ops.flash_attention and flash-attn's API on the CPU: the reference against a float64 softmax
written out here, flash-attn's conventions (bottom-right causal, windows, softcap, ALiBi, LSE layout, varlen),
opcheck, torch.compile(fullgraph=True, dynamic=True), autograd of the reference path, and the errors bad
input gets (each naming the argument)."""

import math

import pytest
import torch
from torch.library import opcheck

import tile_ops
from tile_ops.ops.attention import attention_reference


def _qkv(B=2, Sq=7, Sk=11, Hq=4, Hkv=2, D=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, Hq, D, generator=gen, dtype=dtype), torch.randn(B, Sk, Hkv, D, generator=gen, dtype=dtype),
            torch.randn(B, Sk, Hkv, D, generator=gen, dtype=dtype))


def _naive(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """One (batch, head, row) at a time, as the definition reads."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = scale or D ** -0.5
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    left, right = window[0], 0 if causal else window[1]
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                s = (k[b, :, kh].double() @ q[b, i, h].double()) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                d = i + Sk - Sq
                for j in range(Sk):
                    if slopes is not None:
                        s[j] -= slopes[h] * abs(d - j)
                    if (right >= 0 and j > d + right) or (left >= 0 and j < d - left):
                        s[j] = -math.inf
                if Sk and not torch.isinf(s).all():
                    lse[b, h, i] = torch.logsumexp(s, 0)
                    out[b, i, h] = torch.softmax(s, 0) @ v[b, :, kh].double()
    return out, lse


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(3, 1)), dict(softcap=2.0, causal=True),
                                dict(slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]))],
                         ids=["plain", "causal", "window", "softcap", "alibi"])
@pytest.mark.parametrize("lengths", [(7, 11), (11, 7)], ids=["sq<sk", "sq>sk"])
def test_reference_follows_flash_attn_conventions(kw, lengths):
    q, k, v = _qkv(Sq=lengths[0], Sk=lengths[1], dtype=torch.float64)
    out, lse, probs = tile_ops.flash_attn_func(q, k, v, causal=kw.get("causal", False),
                                               window_size=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
                                               alibi_slopes=kw.get("slopes"), return_attn_probs=True)
    ref, ref_lse = _naive(q, k, v, **kw)
    assert probs is None and out.shape == q.shape and lse.shape == (2, 4, lengths[0])
    assert torch.allclose(out, ref, atol=1e-10) and torch.equal(lse.isinf(), ref_lse.isinf())
    assert torch.allclose(lse[~lse.isinf()].double(), ref_lse[~ref_lse.isinf()], atol=1e-5)


def test_rows_without_keys_are_zero_with_minus_infinite_lse():
    q, k, v = _qkv(Sq=9, Sk=4)
    out, lse, _ = tile_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5])) and bool((lse[..., :5] == -math.inf).all())
    assert not out.isnan().any()
    out, lse, _ = tile_ops.flash_attn_func(q, k[:, :0], v[:, :0], return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


def test_opcheck():
    q, k, v = _qkv()
    opcheck(torch.ops.tile_ops.flash_attention, (q, k, v, None, True, -1, -1, 0.0, None))
    opcheck(torch.ops.tile_ops.flash_attention, (q, k, v, 0.3, False, 2, 3, 5.0, torch.rand(4)))


def test_varlen_opcheck():
    """The packed ops (forward and backward): schemas, fakes and autograd registrations, an empty sequence and a
    row past the last one included."""
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(9, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    opcheck(torch.ops.tile_ops.flash_attention_varlen, (q, k, v, cu, cu, None, True, -1, -1, 0.0, None))
    opcheck(torch.ops.tile_ops.flash_attention_varlen, (q, k, v, cu, cu, 0.3, False, 2, 1, 5.0, torch.rand(3, 4)))
    q, k, v = (t.detach() for t in (q, k, v))  # (the backward op has no backward of its own)
    out, lse = torch.ops.tile_ops.flash_attention_varlen(q, k, v, cu, cu, None, True, -1, -1, 0.0, None)
    opcheck(torch.ops.tile_ops.flash_attention_varlen_backward,
            (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), cu, cu, None, True, -1, -1, 0.0, None))


def test_compiles_fullgraph_dynamic():
    f = torch.compile(lambda q, k, v: tile_ops.flash_attn_func(q, k, v, causal=True), fullgraph=True, dynamic=True)
    for Sq, Sk in ((7, 11), (5, 13)):
        q, k, v = _qkv(Sq=Sq, Sk=Sk)
        assert torch.allclose(f(q, k, v), tile_ops.flash_attn_func(q, k, v, causal=True), atol=1e-6)


GRAD_CASES = [dict(causal=True, softcap=3.0), dict(window=(3, 1)), dict(alibi=True, causal=True),
              dict(Sq=9, Sk=4, causal=True), dict(Sk=0)]


@pytest.mark.parametrize("kw", GRAD_CASES, ids=["causal-softcap", "window", "alibi", "rows-without-keys", "no-keys"])
def test_gradients_are_the_references(kw):
    """The backward op's CPU path (written out in torch, as the kernels compute it: P from the forward's LSE,
    Delta = rowsum(dO O) less the LSE's gradient) against autograd through the reference forward, GQA 4/2."""
    kw = dict(kw)
    q, k, v = _qkv(Sq=kw.pop("Sq", 7), Sk=kw.pop("Sk", 11), dtype=torch.float64)
    slopes = torch.rand(4) if kw.pop("alibi", False) else None
    window = kw.pop("window", (-1, -1))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse, _ = tile_ops.flash_attn_func(q, k, v, window_size=window, alibi_slopes=slopes, return_attn_probs=True,
                                           **kw)
    (out.square().sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref, ref_lse = attention_reference(q, k, v, window_size=window, alibi_slopes=slopes, return_lse=True, **kw)
    (ref.square().sum() + ref_lse.masked_fill(ref_lse.isinf(), 0).sum()).backward()
    for g, t in zip(grads, (q, k, v)):
        assert not g.isnan().any() and torch.allclose(g, t.grad, atol=1e-6)  # (P from the float32 LSE)


def test_gradcheck():
    """Against finite differences of the float64 output (the LSE is float32, too coarse for them: its gradient is
    checked against autograd above)."""
    q, k, v = (t[:1, :4, :, :4].clone().requires_grad_() for t in _qkv(dtype=torch.float64))
    for kw in (dict(causal=True, softcap=2.0), dict(window_size=(2, 1), alibi_slopes=torch.rand(4))):
        assert torch.autograd.gradcheck(lambda q, k, v: tile_ops.flash_attn_func(q, k, v, **kw), (q, k, v))


def test_backward_opcheck():
    q, k, v = _qkv()
    out, lse = torch.ops.tile_ops.flash_attention(q, k, v, None, True, -1, -1, 0.0, None)
    dout, glse = torch.randn_like(out), torch.randn_like(lse)
    opcheck(torch.ops.tile_ops.flash_attention_backward, (dout, q, k, v, out, lse, glse, None, True, -1, -1, 0.0, None))
    opcheck(torch.ops.tile_ops.flash_attention_backward, (dout, q, k, v, out, lse, None, 0.3, False, 2, 3, 5.0,
                                                           torch.rand(4)))


def test_training_step_compiles_fullgraph():
    """torch.compile of a loss over the op and its backward: one graph (AOTAutograd traces the backward op's fake)."""
    def loss(q, k, v):
        return tile_ops.flash_attn_func(q, k, v, causal=True).square().sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for Sq, Sk in ((7, 11), (5, 13)):
        q, k, v = (t.requires_grad_() for t in _qkv(Sq=Sq, Sk=Sk))
        compiled(q, k, v).backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        loss(q, k, v).backward()
        assert all(torch.allclose(g, t.grad, atol=1e-5) for g, t in zip(grads, (q, k, v)))


def test_varlen_gradients_match_the_reference_per_sequence():
    """Autograd through flash_attn_varlen_func (zero-length sequences and rows past the last one included) gives
    each sequence's reference gradients, and zeros where no sequence is."""
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    q, k, v = (torch.randn(10, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, deterministic=True)
    (out * torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape).cos()).sum().backward()
    w = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape).cos()
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        if e == s:
            continue
        qs, ks, vs = (t.detach()[None, s:e].clone().requires_grad_() for t in (q, k, v))
        (attention_reference(qs, ks, vs, causal=True) * w[None, s:e]).sum().backward()
        for got, ref in ((q.grad[s:e], qs.grad[0]), (k.grad[s:e], ks.grad[0]), (v.grad[s:e], vs.grad[0])):
            assert torch.allclose(got, ref, atol=1e-6)
    assert torch.equal(q.grad[9:], torch.zeros_like(q.grad[9:]))


def test_varlen_matches_per_sequence_calls():
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)  # lengths 3, 0 (empty), 5, 1
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    out, lse, _ = tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, return_attn_probs=True)
    assert out.shape == (9, 2, 16) and lse.shape == (2, 9)
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        if e > s:
            o, l_, _ = tile_ops.flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=True,
                                                return_attn_probs=True)
            assert torch.allclose(out[s:e], o[0]) and torch.allclose(lse[:, s:e], l_[0])


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: tile_ops.flash_attn_func(q.int(), k, v), "q is torch.int32"),
    (lambda q, k, v: tile_ops.flash_attn_func(q[0], k, v), "q has shape .*accepted: 4 dims"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k[..., :8], v[..., :8]), "head_dim must match"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, torch.randn(2, 11, 3, 16), torch.randn(2, 11, 3, 16)),
     "multiple of k's"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v.double()), "v is torch.float64"),
    (lambda q, k, v: tile_ops.flash_attn_func(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v),
     "contiguous last dimension"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, dropout_p=0.1), "dropout_p=0.1"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, window_size=(-2, 0)), r"window_size\[0\]=-2"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softcap=-1.0), "softcap=-1.0"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softmax_scale=math.nan), "softmax_scale=nan"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softmax_scale=-0.5), "softmax_scale=-0.5.*float > 0"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softmax_scale=0.0), "softmax_scale=0.0.*float > 0"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, alibi_slopes=torch.rand(3)), "alibi_slopes has shape"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, alibi_slopes=torch.rand(3, 4)), r"\(2, 4\)"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k[:1], v[:1]), "batch and head_dim must match"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v[:, :5]), "differ; accepted: the same shape"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v.to(torch.bfloat16)), "v is torch.bfloat16, q torch.float32"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k.to("meta"), v), "k is on meta, q on cpu"),
    (lambda q, k, v: tile_ops.flash_attn_func([q], k, v), "Expected a value of type 'Tensor' for argument 'q'"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, causal="yes"), "causal='yes'; accepted: True or False"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, deterministic=2), "deterministic=2"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, return_attn_probs=None), "return_attn_probs=None"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softcap="1"), "softcap='1'"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softcap=math.inf), "softcap=inf"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, softmax_scale="0.1"), "softmax_scale='0.1'"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, window_size=True), "window_size=True"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, window_size=(1, 2, 3)), r"window_size=\(1, 2, 3\)"),
    (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, window_size=(1.5, 0)), r"window_size\[0\]=1.5"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError, RuntimeError, NotImplementedError), match=match):
        call(*_qkv())


@pytest.mark.parametrize("cu_q, match", [
    (torch.tensor([0, 3, 9]), "int32"),
    (torch.tensor([0, 5, 3], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([1, 3, 9], dtype=torch.int32), "from 0"),
    (torch.tensor([0, 3, 12], dtype=torch.int32), "at most the tensor's 9 tokens"),
])
def test_bad_cu_seqlens_are_named(cu_q, match):
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu_k = torch.tensor([0, 3, 9], dtype=torch.int32)
    with pytest.raises((TypeError, ValueError), match=match):
        tile_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)


@pytest.mark.parametrize("max_q, max_k, match", [
    (5, 6, "max_seqlen_q=5; accepted: an int at least the longest sequence \\(6\\)"),
    (6, 5.0, "max_seqlen_k=5.0"),
    (6, True, "max_seqlen_k=True"),
])
def test_bad_max_seqlen_is_named(max_q, max_k, match):
    """A bound below the longest sequence would leave flash-attn's rows past it unwritten: refused."""
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, max_q, max_k)


def test_max_seqlen_as_a_tensor_or_larger_is_accepted():
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    a = tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, torch.tensor(6), 100)
    assert torch.equal(a, tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6))


def test_batches_past_32_bit_offsets_run_in_parts():
    """The kernel indexes with 32-bit offsets: a batch whose tensors span 2^31 elements or more is launched in
    runs of batch entries (meta tensors: no memory), the fewest that fit."""
    from tile_ops.kernels.attention_launch import batch_parts

    q = torch.empty(16, 32768, 32, 128, device="meta")  # 2^31 elements
    lse = torch.empty(16, 32, 32768, device="meta")
    assert batch_parts([q, lse]) == [(0, 15), (15, 16)]
    assert batch_parts([q[:4], lse[:4]]) == [(0, 4)]
    assert batch_parts([q.transpose(1, 2).transpose(1, 2), lse], limit=2**30) == [(0, 7), (7, 14), (14, 16)]
    with pytest.raises(ValueError, match="one batch entry spans 2,147,483,648 elements"):
        batch_parts([torch.empty(1, 2**20, 16, 128, device="meta")])


def test_packed_offsets_are_read_once_per_tensor_and_version(monkeypatch):
    """A model's layers pass the same cu_seqlens: its host copy (a device sync on CUDA) is made once, the forward
    and the backward included, and again after an in-place write."""
    q, k, v = (torch.randn(10, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    for _ in range(3):
        tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True).sum().backward()
    assert len(reads) == 1
    cu[1] = 5
    out = tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    assert len(reads) == 2
    want = attention_reference(q[None, :5], k[None, :5], v[None, :5], causal=True)[0]
    torch.testing.assert_close(out[:5], want)
