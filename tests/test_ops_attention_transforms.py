"""The attention ops under torch.func and forward-mode AD on the CPU, against the plain-torch reference run through
the same transform: grad, vjp, jacrev, jvp, jacfwd, forward_ad (through flash-attn's functions and the ops
themselves), vmap (the mapped dim as more batch, or more heads on packed sequences) and vmap of grad; and what is
refused by name: a second derivative, gradients in ALiBi's slopes, vmap over the packed offsets."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import tile_ops
from tile_ops.ops.attention import attention_reference

OPTIONS = [dict(), dict(causal=True, softcap=3.0), dict(window_size=(2, 1)), dict(causal=True, alibi=True)]
CU = torch.tensor([0, 3, 8, 8, 12], dtype=torch.int32)  # an empty sequence among them


def _qkv(B=2, Sq=6, Sk=7, Hq=4, Hkv=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
                 for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))


def _pair(kw):
    """(ours, the reference) as functions of q, k, v with the options ``kw``."""
    kw = dict(kw)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4]) if kw.pop("alibi", False) else None
    ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                  softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)
    if slopes is not None:  # float32 slopes take float32 inputs
        return (lambda q, k, v: tile_ops.flash_attn_func(q.float(), k.float(), v.float(), alibi_slopes=slopes, **kw),
                lambda q, k, v: attention_reference(q.float(), k.float(), v.float(), **ref_kw))
    return (lambda q, k, v: tile_ops.flash_attn_func(q, k, v, **kw), lambda q, k, v: attention_reference(q, k, v,
                                                                                                       **ref_kw))


def _close(got, want):
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g.double(), w.double(), atol=2e-5, rtol=2e-5)  # lse is float32, as flash-attn's


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_reverse_mode_transforms(kw):
    ours, ref = _pair(kw)
    q, k, v = _qkv()
    loss = lambda f: lambda *a: f(*a).square().sum()  # noqa: E731
    grads = [torch.func.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (ours, ref)]
    _close(*grads)
    _close(torch.func.jacrev(lambda k: ours(q, k, v))(k), torch.func.jacrev(lambda k: ref(q, k, v))(k))
    cot = torch.randn(q.shape, dtype=torch.float64)
    _close(torch.func.vjp(ours, q, k, v)[1](cot.to(ours(q, k, v).dtype)),
           torch.func.vjp(ref, q, k, v)[1](cot.to(ref(q, k, v).dtype)))


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_forward_mode_transforms(kw):
    ours, ref = _pair(kw)
    q, k, v = _qkv()
    tangents = _qkv(seed=1)
    _close(torch.func.jvp(ours, (q, k, v), tangents), torch.func.jvp(ref, (q, k, v), tangents))
    _close(torch.func.jacfwd(lambda v: ours(q, k, v))(v), torch.func.jacrev(lambda v: ref(q, k, v))(v))
    want = torch.func.jvp(lambda q: ref(q, k, v), (q,), tangents[:1])[1]
    with fwAD.dual_level():  # forward_ad, through flash-attn's function and through the op itself
        _close(fwAD.unpack_dual(ours(fwAD.make_dual(q, tangents[0]), k, v)).tangent, want)
        if "alibi" not in kw:
            out, lse = torch.ops.tile_ops.flash_attention(fwAD.make_dual(q, tangents[0]), k, v, None,
                                                          kw.get("causal", False), *kw.get("window_size", (-1, -1)),
                                                          kw.get("softcap", 0.0))
            _close(fwAD.unpack_dual(out).tangent, want)
            assert fwAD.unpack_dual(lse).tangent is not None


def test_lse_tangent_is_the_softmax_weighted_score_tangent():
    q, k, v = _qkv()
    tq = _qkv(seed=2)[0]
    lse_of = lambda q: tile_ops.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[1]  # noqa: E731
    eps = 1e-3  # (lse is float32)
    numeric = (lse_of(q + eps * tq) - lse_of(q - eps * tq)).double() / (2 * eps)
    torch.testing.assert_close(torch.func.jvp(lse_of, (q,), (tq,))[1].double(), numeric, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_vmap_and_per_sample_gradients(kw):
    ours, ref = _pair(kw)
    q, k, v = _qkv()
    Q, K = torch.randn(3, *q.shape, dtype=torch.float64), torch.randn(*k.shape, 3, dtype=torch.float64)
    got = torch.func.vmap(ours, in_dims=(0, 4, None))(Q, K, v)
    _close(got, torch.stack([ref(Q[i], K[..., i], v) for i in range(3)]))
    grads = torch.func.vmap(torch.func.grad(lambda q, k: ours(q, k, v).square().sum(), argnums=(0, 1)),
                            in_dims=(0, 4))(Q, K)
    want = [torch.func.grad(lambda q, k: ref(q, k, v).square().sum(), argnums=(0, 1))(Q[i], K[..., i])
            for i in range(3)]
    _close(grads, tuple(torch.stack(g) for g in zip(*want)))


def test_forward_mode_in_alibi_slopes():
    q, k, v = (t.float() for t in _qkv())
    slopes, t = torch.rand(2, 4), torch.randn(2, 4)
    ours = lambda s: tile_ops.flash_attn_func(q, k, v, causal=True, alibi_slopes=s, return_attn_probs=True)[:2]  # noqa
    ref = lambda s: attention_reference(q, k, v, causal=True, alibi_slopes=s, return_lse=True)  # noqa: E731
    _close(torch.func.jvp(ours, (slopes,), (t,)), torch.func.jvp(ref, (slopes,), (t,)))
    qp, kp, vp = (x.float() for x in _packed())
    _close(torch.func.jvp(lambda s: _varlen(qp, kp, vp, s), (slopes[0],), (t[0],)),
           torch.func.jvp(lambda s: _varlen_reference(qp, kp, vp, s), (slopes[0],), (t[0],)))


def test_vmap_over_alibi_slopes_per_batch():
    q, k, v = (t.float() for t in _qkv())
    slopes = torch.rand(3, 2, 4)
    f = lambda q, s: tile_ops.flash_attn_func(q, k, v, alibi_slopes=s)  # noqa: E731
    Q = torch.randn(3, *q.shape)
    _close(torch.func.vmap(f)(Q, slopes), torch.stack([f(Q[i], slopes[i]) for i in range(3)]))
    _close(torch.func.vmap(f, in_dims=(0, None))(Q, slopes[0]), torch.stack([f(Q[i], slopes[0]) for i in range(3)]))


def _packed(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(12, H, 8, generator=gen, dtype=torch.float64) for H in (4, 2, 2))


def _varlen(q, k, v, slopes=None):
    return tile_ops.flash_attn_varlen_func(q, k, v, CU, CU, 5, 5, causal=True, alibi_slopes=slopes)


def _varlen_reference(q, k, v, slopes=None):
    offsets = CU.tolist()
    rows = [attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, alibi_slopes=slopes)[0]
            for a, b in zip(offsets, offsets[1:])]
    return torch.cat(rows)


def test_packed_sequences_under_the_transforms():
    q, k, v = _packed()
    loss = lambda f: lambda *a: f(*a).square().sum()  # noqa: E731
    _close(torch.func.grad(loss(_varlen), argnums=(0, 1, 2))(q, k, v),
           torch.func.grad(loss(_varlen_reference), argnums=(0, 1, 2))(q, k, v))
    tangents = _packed(seed=1)
    _close(torch.func.jvp(_varlen, (q, k, v), tangents), torch.func.jvp(_varlen_reference, (q, k, v), tangents))
    Q, K = torch.randn(3, *q.shape, dtype=torch.float64), torch.randn(*k.shape[:2], 3, 8, dtype=torch.float64)
    _close(torch.func.vmap(_varlen, in_dims=(0, 2, None))(Q, K, v),
           torch.stack([_varlen_reference(Q[i], K[:, :, i], v) for i in range(3)]))
    grads = torch.func.vmap(torch.func.grad(lambda q, k: _varlen(q, k, v).square().sum(), argnums=(0, 1)))(
        Q, K.movedim(2, 0))
    want = [torch.func.grad(lambda q, k: _varlen_reference(q, k, v).square().sum(), argnums=(0, 1))(Q[i], K[:, :, i])
            for i in range(3)]
    _close(grads, tuple(torch.stack(g) for g in zip(*want)))


@pytest.mark.parametrize("shape", [(4,), (4, 4)], ids=["per-head", "per-sequence"])
def test_packed_sequences_vmap_over_alibi_slopes(shape):
    q, k, v = (t.float() for t in _packed())
    slopes = torch.rand(3, *shape)
    Q = torch.randn(3, *q.shape)
    f = lambda q, s: _varlen(q, k, v, s)  # noqa: E731
    _close(torch.func.vmap(f)(Q, slopes), torch.stack([f(Q[i], slopes[i]) for i in range(3)]))
    _close(torch.func.vmap(f, in_dims=(0, None))(Q, slopes[0]), torch.stack([f(Q[i], slopes[0]) for i in range(3)]))


def test_what_is_refused_is_named():
    q, k, v = _qkv()
    f = lambda q: tile_ops.flash_attn_func(q, k, v).square().sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="flash_attention_backward: forward-mode AD"):
        torch.func.hessian(f)(q)
    qg = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(qg), qg, create_graph=True)
    with pytest.raises(NotImplementedError, match="flash_attention_backward: a derivative of this op"):
        g.sum().backward()
    slopes = torch.rand(4, requires_grad=True)
    out = tile_ops.flash_attn_func(q.float(), k.float(), v.float(), alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="alibi_slopes requires a gradient"):
        out.sum().backward()
    qp, kp, vp = _packed()
    with pytest.raises(NotImplementedError, match="vmap over cu_seqlens_q or cu_seqlens_k"):
        torch.func.vmap(lambda cu: tile_ops.flash_attn_varlen_func(qp, kp, vp, cu, cu, 5, 5))(CU.expand(2, -1))


def test_vmap_checks_a_slice_in_its_words():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q has shape"):
        torch.func.vmap(lambda q: tile_ops.flash_attn_func(q, k, v))(q[0])  # a slice of 3 dims
    with pytest.raises(ValueError, match="batch and head_dim must match"):
        torch.func.vmap(lambda q: tile_ops.flash_attn_func(q, k, v))(q[..., :4].unsqueeze(0).expand(2, *q.shape[:3], 4))
