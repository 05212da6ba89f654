"""``torch.ops.tile_ops.flash_attention_varlen``: FlashAttention on packed sequences (flash-attn's varlen layout),
and flash-attn 2's ``flash_attn_varlen_func`` over it.

Schema::

    tile_ops::flash_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
        float? softmax_scale=None, bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0,
        Tensor? alibi_slopes=None, bool deterministic=False) -> (Tensor out, Tensor lse)
    tile_ops::flash_attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
        Tensor? grad_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, ...same options) -> (Tensor dq, Tensor dk,
        Tensor dv)

On (total, H, D) tensors, sequence i being rows ``cu_seqlens[i]:cu_seqlens[i + 1]``, with the options of
``tile_ops::flash_attention`` (attention.py); ``lse`` (Hq, total_q).  The offsets are read on the host (checked:
int32, from 0, non-decreasing, within the tensors); on CUDA one launch of each kernel over the sequences' tiles,
on the CPU the reference per sequence; rows of no sequence get 0 (lse -inf).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.utils.weak

from . import functorch, spec
from .attention import (OP, api_options, apply, attention_backward_reference, attention_reference,
                        attention_tangent, check_cuda_layout, check_inputs, check_slopes, fold, readable,
                        refuse_slope_gradients)

# --------------------------------------------------------------------------- checks


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap,
                 alibi_slopes, strides=True):
    """check_inputs on packed (total, H, D) tensors and their offsets' dtypes and shapes (not their values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{OP}: {name} must be a packed (total, nheads, headdim) tensor, got "
                             f"{list(getattr(t, 'shape', [])) or type(t).__name__}")
    check_inputs(q[None], k[None], v[None], softmax_scale, window_left, window_right, softcap, strides=strides)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise TypeError(f"{OP}: {name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} {list(getattr(cu, 'shape', []))}")
        if cu.device != q.device:
            raise RuntimeError(f"{OP}: {name} is on {cu.device}, q on {q.device}; accepted: all on one device")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"{OP}: cu_seqlens_k has {cu_seqlens_k.numel()} offsets, cu_seqlens_q "
                         f"{cu_seqlens_q.numel()}; accepted: the same count")
    check_slopes(alibi_slopes, cu_seqlens_q.numel() - 1, q.shape[1], q.device)


# cu_seqlens tensor -> (its version, its values): a model's layers share one, read (a device sync) once
_HOST_COPIES = torch.utils.weak.WeakIdKeyDictionary()


def _host_copy(cu) -> list:
    """``cu.tolist()``, once per tensor and version (an in-place write makes a new version)."""
    seen = _HOST_COPIES.get(cu)
    if seen is not None and seen[0] == cu._version:
        return seen[1]
    values = cu.tolist()
    _HOST_COPIES[cu] = (cu._version, values)
    return values


def offsets(name, cu, total):
    """The host copy of a cu_seqlens tensor, checked: from 0, non-decreasing, ending within ``total``."""
    values = _host_copy(cu)
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > total:
        raise ValueError(f"{OP}: {name}={values[:8]}{'...' if len(values) > 8 else ''}; accepted: offsets from 0, "
                         f"non-decreasing, the last at most the tensor's {total} tokens")
    return values


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """(offsets_q, offsets_k, [(sequence index, (q0, q1), (k0, k1))] of the non-empty query sequences)."""
    oq = offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ok = offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    return oq, ok, [(i, (oq[i], oq[i + 1]), (ok[i], ok[i + 1])) for i in range(len(oq) - 1) if oq[i + 1] > oq[i]]


def _slopes_of(alibi_slopes, i):
    return alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


# --------------------------------------------------------------------------- the forward op


def _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1,
               window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    """Each sequence through the reference; rows past the last sequence: out 0, lse -inf."""
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    for i, (q0, q1), (k0, k1) in _sequences(q, k, cu_seqlens_q, cu_seqlens_k)[2]:
        o, l_ = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal,
                                    (window_left, window_right), softcap, _slopes_of(alibi_slopes, i), return_lse=True)
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse


def _fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
          softcap=0.0, alibi_slopes=None, deterministic=False):
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
          softcap=0.0, alibi_slopes=None, deterministic=False):
    """Checked and launched; no plan: the launch's tile table comes from the offsets' values."""
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    check_cuda_layout(q[None], k[None], v[None])
    q, k, v = (readable(t) for t in (q, k, v))
    oq, ok, _ = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    out[oq[-1]:].zero_()  # rows past the last sequence belong to none, as flash-attn leaves them
    lse[:, oq[-1]:].fill_(-math.inf)
    if out.numel():
        from ..kernels.attention_launch import launch_attention_varlen

        launch_attention_varlen(q, k, v, out, lse, oq, ok, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes)
    return out, lse


def _signature(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1,
               window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    return (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes), (softmax_scale, causal, window_left, window_right,
                                                                 softcap, deterministic)


def _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
             softcap=0.0, alibi_slopes=None, deterministic=False) -> list:
    from ..kernels.attention_launch import attention_problem

    if q.dtype not in (torch.float16, torch.bfloat16) or not q.numel():
        return []
    return [attention_problem(q, causal, (window_left, window_right), softcap, alibi_slopes is not None, varlen=True)]


_FORWARD_ARGS = spec.with_defaults(_reference)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, \
        deterministic = _FORWARD_ARGS(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad) + (False,) * 12
    refuse_slope_gradients(needs[10])
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = apply(FLASH_ATTENTION_VARLEN_BACKWARD, (grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q,
                                                         cu_seqlens_k, *ctx.options, alibi_slopes, ctx.deterministic))
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 9


def _tangents(q, k, v, out, lse, tq, tk, tv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window, softcap,
              alibi_slopes, t_slopes):
    """(out's, lse's) tangents, sequence by sequence (attention_tangent); 0 on rows of no sequence."""
    t_out, t_lse = torch.zeros_like(out), torch.zeros_like(lse)
    for i, (q0, q1), (k0, k1) in _sequences(q, k, cu_seqlens_q, cu_seqlens_k)[2]:
        rows = lambda t: None if t is None else t[None, q0:q1]  # noqa: E731
        keys = lambda t: None if t is None else t[None, k0:k1]  # noqa: E731
        o, l_ = attention_tangent(rows(q), keys(k), keys(v), rows(out), lse[None, :, q0:q1], rows(tq), keys(tk),
                                  keys(tv), softmax_scale, causal, window, softcap, _slopes_of(alibi_slopes, i),
                                  None if t_slopes is None else _slopes_of(t_slopes, i))
        t_out[q0:q1], t_lse[:, q0:q1] = o[0], l_[0]
    return t_out, t_lse


def _tangent(ops, args, tangents, output):
    q, k, v, cu_q, cu_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _ = args
    return _tangents(q, k, v, *output, *tangents[:3], cu_q, cu_k, softmax_scale, causal, (window_left, window_right),
                     softcap, alibi_slopes, tangents[10])


def _jvp(ctx, tq, tk, tv, *rest):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap = ctx.options
    return _tangents(q, k, v, out, lse, tq, tk, tv, cu_q, cu_k, softmax_scale, causal, (window_left, window_right),
                     softcap, alibi_slopes, rest[7] if len(rest) > 7 else None)


# --------------------------------------------------------------------------- vmap: the mapped dim as more heads


def _shared_offsets(in_dims, at):
    """vmap: one set of offsets for every slice (their tiles are read on the host)."""
    if any(in_dims[i] is not None for i in at):
        raise NotImplementedError(f"{OP}: vmap over cu_seqlens_q or cu_seqlens_k is not supported; accepted: offsets "
                                  f"that every slice shares (unmapped)")


def _fold_slopes(slopes, dim, n):
    """ALiBi slopes, (Hq,) or (B, Hq) a slice, over the slices' heads side by side: (n * Hq,) or (B, n * Hq)."""
    return None if slopes is None else fold(slopes, dim, n, into=slopes.dim() - 1 - (dim is not None))


def _vmap(info, in_dims, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_left=-1,
          window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    """Slices are independent heads over the same sequences: one call over their heads side by side (query head
    n * Hq + h then meets key head n * Hkv + h // group, its own slice's)."""
    in_dims = tuple(in_dims) + (None,) * (12 - len(in_dims))
    _shared_offsets(in_dims, (3, 4))
    one = functorch.one_slice
    q1 = one(q, in_dims[0])
    check_varlen(q1, one(k, in_dims[1]), one(v, in_dims[2]), cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left,
                 window_right, softcap, one(alibi_slopes, in_dims[10]), strides=False)
    n, Hq = info.batch_size, q1.shape[1]
    out, lse = FLASH_ATTENTION_VARLEN.op(*(fold(t, d, n, into=1) for t, d in zip((q, k, v), in_dims)), cu_seqlens_q,
                                         cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                                         _fold_slopes(alibi_slopes, in_dims[10], n), deterministic)
    return (out.unflatten(1, (n, Hq)), lse.unflatten(0, (n, Hq))), (1, 0)


FLASH_ATTENTION_VARLEN = spec.register(spec.OpSpec(
    name="flash_attention_varlen",
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float? softmax_scale=None, "
           "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
           "bool deterministic=False) -> (Tensor, Tensor)",
    reference=_reference,
    fake=_fake,
    launch=_cuda,
    signature=_signature,
    vmap=_vmap,
    setup_context=_setup_context,
    backward=_backward,
    saved=lambda inputs, output: (*inputs[:3], *output, *inputs[3:5], _FORWARD_ARGS(inputs)[10]),
    jvp=_jvp,
    tangent=_tangent,
    problem=_problem,
))


# --------------------------------------------------------------------------- the backward op


def _backward_reference(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                        causal=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                        deterministic=False):
    """Each sequence's gradients by the reference; 0 on rows of no sequence."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype) for t in (q, k, v))
    for i, (q0, q1), (k0, k1) in _sequences(q, k, cu_seqlens_q, cu_seqlens_k)[2]:
        glse = None if grad_lse is None else grad_lse[None, :, q0:q1]
        grads = attention_backward_reference(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                             out[None, q0:q1], lse[None, :, q0:q1], glse, softmax_scale, causal,
                                             (window_left, window_right), softcap, _slopes_of(alibi_slopes, i))
        for acc, g, (a, b) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
            acc[a:b] += g[0]
    return dq, dk, dv


def _backward_fake(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _backward_cuda(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    oq, ok, _ = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    from ..kernels.attention_launch import launch_attention_backward_varlen

    dout, q, k, v = (readable(t) for t in (dout, q, k, v))
    launch_attention_backward_varlen(dout, q, k, v, out, lse, dq, dk, dv, oq, ok, cu_seqlens_q.contiguous(),
                                     cu_seqlens_k.contiguous(), softmax_scale, causal, (window_left, window_right),
                                     softcap, alibi_slopes, grad_lse, deterministic)
    return dq, dk, dv


def _backward_signature(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                        causal=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                        deterministic=False):
    return (dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes), \
        (softmax_scale, causal, window_left, window_right, softcap, deterministic)


def _backward_vmap(info, in_dims, dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                   causal=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    """As the forward's: the slices' heads side by side, one call."""
    in_dims = tuple(in_dims) + (None,) * (16 - len(in_dims))
    _shared_offsets(in_dims, (7, 8))
    n = info.batch_size
    rows = [fold(t, d, n, into=1) for t, d in zip((dout, q, k, v, out), in_dims)]
    lses = [None if t is None else fold(t, d, n) for t, d in zip((lse, grad_lse), in_dims[5:7])]
    heads = [functorch.one_slice(t, d).shape[1] for t, d in zip((q, k, v), in_dims[1:4])]
    grads = FLASH_ATTENTION_VARLEN_BACKWARD.op(*rows, *lses, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                               window_left, window_right, softcap,
                                               _fold_slopes(alibi_slopes, in_dims[14], n), deterministic)
    return tuple(g.unflatten(1, (n, h)) for g, h in zip(grads, heads)), (1, 1, 1)


FLASH_ATTENTION_VARLEN_BACKWARD = spec.register(spec.OpSpec(
    name="flash_attention_varlen_backward",
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse, Tensor cu_seqlens_q, "
           "Tensor cu_seqlens_k, float? softmax_scale=None, bool causal=False, int window_left=-1, "
           "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool deterministic=False) -> "
           "(Tensor, Tensor, Tensor)",
    reference=_backward_reference,
    fake=_backward_fake,
    launch=_backward_cuda,
    signature=_backward_signature,
    vmap=_backward_vmap,
))


# --------------------------------------------------------------------------- flash-attn's API


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` on packed (total, nheads, headdim) tensors, sequence i being
    rows ``cu_seqlens[i]:cu_seqlens[i + 1]``: ``out`` (total_q, nheads, headdim), with ``return_attn_probs``
    ``(out, softmax_lse, None)``, lse (nheads, total_q); rows past the last sequence get 0 (lse -inf).  On CUDA
    one launch over every sequence's query tiles (``torch.ops.tile_ops.flash_attention_varlen``); the offsets
    are checked on the host (one copy of each), ``max_seqlen_*`` against them.  Derivatives and transforms as
    ``flash_attn_func``'s (vmap: the mapped dim as more heads, the offsets shared)."""
    options, probs = api_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                 return_attn_probs, block_table)
    scale, _, left, right, softcap, _ = options
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, left, right, softcap, alibi_slopes)
    _shared_offsets([torch._C._functorch.is_batchedtensor(cu) or None for cu in (cu_seqlens_q, cu_seqlens_k)], (0, 1))
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if isinstance(bound, torch.SymInt):  # traced: the op checks the offsets, the bound is a hint
            continue
        values = offsets(name.replace("max_seqlen", "cu_seqlens"), cu, (q if name.endswith("q") else k).shape[0])
        longest = max((b - a for a, b in zip(values, values[1:])), default=0)
        if isinstance(bound, torch.Tensor) and bound.numel() == 1 and not bound.is_floating_point():
            bound = int(bound)  # transformers may hand the longest length over as a tensor
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral) or bound < longest:
            raise ValueError(f"{OP}: {name}={bound!r}; accepted: an int at least the longest sequence ({longest}): "
                             f"flash-attn sizes its grid by it and would leave the rows past it unwritten")
    out, lse = apply(FLASH_ATTENTION_VARLEN, (q, k, v, cu_seqlens_q, cu_seqlens_k, *options[:4], softcap,
                                              alibi_slopes, options[5]))
    return (out, lse, None) if probs else out
