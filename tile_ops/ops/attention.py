"""``torch.ops.tile_ops.flash_attention`` and flash-attn 2's Python API over it.

Schema::

    tile_ops::flash_attention(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False,
                              int window_left=-1, int window_right=-1, float softcap=0.0,
                              Tensor? alibi_slopes=None, bool deterministic=False) -> (Tensor out, Tensor lse)

On (B, S, H, D) tensors, as flash-attn: ``out`` (B, Sq, Hq, D) in q's dtype, ``lse`` (B, Hq, Sq) float32, the
natural log-sum-exp of each row's scores (-inf, with out 0, for a row that sees no key).  Scores are
``softcap * tanh(scale * q k / softcap)`` (just ``scale * q k`` without a softcap) plus the ALiBi bias
``-slope * |i + Sk - Sq - j|``; query i sees key j where ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
(a bound of -1: none; causal is right = 0), so masks align to the bottom-right corner as in flash-attn >= 2.1.

Implementations:

* CUDA: ``tile_ops.kernels.attention`` (fp16/bf16), one kernel per (head dim, dtype, mask kind, config) for
  every batch, head count, length, scale, softcap and window size; q, k and v reach it through their strides, no copies, where
  each has a contiguous last dimension and 16-byte-aligned rows (e.g. (B, H, S, D) tensors transposed).
* CPU: the reference in plain torch (float32; float64 for float64 inputs).
* Fake: shapes and dtypes, for ``torch.compile``.
* Autograd: ``tile_ops::flash_attention_backward(dout, q, k, v, out, lse, grad_lse, ...same options) -> (dq, dk,
  dv)``, itself a custom op: on CUDA ``tile_ops.kernels.attention_backward``, on the CPU the reference's gradients.

Packed sequences (flash-attn's varlen layout) have their own pair, with the same options::

    tile_ops::flash_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, ...)
        -> (Tensor out, Tensor lse)
    tile_ops::flash_attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
        Tensor? grad_lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, ...) -> (Tensor dq, Tensor dk, Tensor dv)

on (total, H, D) tensors, ``lse`` (Hq, total_q); the offsets are read on the host (checked: int32, from 0,
non-decreasing, within the tensors); on CUDA one launch of each kernel over the sequences' tiles, on the CPU
the reference per sequence; rows of no sequence get 0 (lse -inf).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import checks, record

OP = "tile_ops.flash_attention"
HEAD_DIMS = (64, 96, 128, 192, 256)  # the CUDA kernel's (any head dim on the CPU)


# --------------------------------------------------------------------------- checks


def _check_window(window_left, window_right):
    for name, w in (("window_size[0]", window_left), ("window_size[1]", window_right)):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise ValueError(f"{OP}: {name}={w!r}; accepted: an int >= -1 (-1: unbounded)")


def check_inputs(q, k, v, softmax_scale=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    """ValueError/TypeError naming the argument unless the op can run on these inputs (shapes and dtypes only:
    the fake implementation runs it too)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{OP}: {name} has shape {list(t.shape)}; accepted: 4 dims (batch, seqlen, heads, "
                             f"head_dim)")
    kind = checks.device_kind(q.device)
    dtypes = checks.input_dtypes(kind)
    if q.dtype not in dtypes:
        raise TypeError(f"{OP}: q is {q.dtype}; accepted on {'CUDA' if kind == 'cuda' else 'CPU'}: "
                        f"{checks.dtype_names(dtypes)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise RuntimeError(f"{OP}: {name} is on {t.device}, q on {q.device}; accepted: all on one device")
        if t.dtype != q.dtype:
            raise TypeError(f"{OP}: {name} is {t.dtype}, q {q.dtype}; accepted: q, k and v of one dtype")
    B, _, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{OP}: k {list(k.shape)} and v {list(v.shape)} differ; accepted: the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{OP}: q {list(q.shape)} and k {list(k.shape)}: batch and head_dim must match")
    Hkv = k.shape[2]
    if Hkv == 0 and Hq or Hkv and Hq % Hkv:
        raise ValueError(f"{OP}: q has {Hq} heads, k and v {Hkv}; accepted: a number of q heads that is a multiple "
                         f"of k's (MQA/GQA)")
    if kind == "cuda" and D not in HEAD_DIMS:
        raise ValueError(f"{OP}: head_dim {D}; accepted on CUDA: {', '.join(map(str, HEAD_DIMS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{OP}: {name} has strides {list(t.stride())}; accepted: a contiguous last dimension "
                             f"(stride 1), e.g. {name}.contiguous()")
    if softmax_scale is not None and (not isinstance(softmax_scale, numbers.Real) or not math.isfinite(softmax_scale)
                                      or softmax_scale <= 0):
        # the kernels take each row's maximum of the unscaled scores, as flash-attn's do
        raise ValueError(f"{OP}: softmax_scale={softmax_scale!r}; accepted: None (1/sqrt(head_dim)) or a finite "
                         f"float > 0")
    _check_window(window_left, window_right)
    if not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{OP}: softcap={softcap!r}; accepted: a finite float >= 0 (0: none)")
    _check_slopes(alibi_slopes, B, Hq, q.device)


def _check_slopes(alibi_slopes, B, Hq, device):
    """ALiBi's slopes: None, or float32 of shape (Hq,) or (B, Hq) on ``device``."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError(f"{OP}: alibi_slopes must be a float32 tensor, got "
                        f"{getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"{OP}: alibi_slopes has shape {list(alibi_slopes.shape)}; accepted: ({Hq},) or "
                         f"({B}, {Hq}) (nheads, or batch x nheads)")
    if alibi_slopes.device != device:
        raise RuntimeError(f"{OP}: alibi_slopes is on {alibi_slopes.device}, q on {device}")


def _check_cuda_layout(q, k, v):
    """The kernel reads each (B, S, H, D) tensor through its strides: rows 16-byte aligned."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() == 0:
            continue
        if t.data_ptr() % checks.POINTER_ALIGNMENT:
            raise ValueError(f"{OP}: {name}.data_ptr() is not 16-byte aligned; accepted: aligned tensors (a "
                             f"fresh tensor or {name}.contiguous() is)")
        if any(n > 1 and s * t.element_size() % checks.POINTER_ALIGNMENT for n, s in zip(t.shape[:3], t.stride()[:3])):
            raise ValueError(f"{OP}: {name} has strides {list(t.stride())}: its rows do not start 16-byte aligned; "
                             f"accepted: strides of batch, seqlen and heads that are multiples of "
                             f"{checks.POINTER_ALIGNMENT // t.element_size()} elements (e.g. {name}.contiguous())")


# --------------------------------------------------------------------------- CPU reference and fake


def _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """(scores (B, Hq, Sq, Sk) with -inf where a query does not see a key, the scaled products before the
    softcap, the visible mask, the compute dtype) of (B, S, H, D) inputs; K repeated over each query group."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    kh = k.to(cdt).transpose(1, 2).repeat_interleave(Hq // Hkv if Hkv else 1, dim=1)
    raw = q.to(cdt).transpose(1, 2) @ kh.transpose(-1, -2) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    i = torch.arange(Sq, device=q.device).view(-1, 1)
    j = torch.arange(Sk, device=q.device).view(1, -1)
    diagonal = i + Sk - Sq
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(cdt).reshape(-1, Hq, 1, 1) * (diagonal - j).abs().to(cdt)
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return s.masked_fill(~visible, -math.inf), raw, visible, cdt


def _grouped(t, group):
    """(B, Hkv, S, D) -> (B, Hq, S, D): each K/V head for its group of query heads."""
    return t.transpose(1, 2).repeat_interleave(group, dim=1)


def attention_reference(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, return_lse=False):
    """Plain-torch attention on (B, S, H, D) tensors, in float32 (float64 for float64 inputs): ``out`` in q's
    dtype, with ``return_lse`` also the (B, Hq, Sq) log-sum-exp."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    s, _, _, cdt = _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    lse = torch.logsumexp(s, dim=-1) if Sk else s.new_full((B, Hq, Sq), -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees no key: -inf - -inf
    out = (p @ _grouped(v.to(cdt), Hq // Hkv if Hkv else 1)).transpose(1, 2).to(q.dtype)
    return (out, lse.to(cdt)) if return_lse else out


def attention_backward_reference(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(dq, dk, dv) in plain torch, from the forward's ``out`` and ``lse`` as the kernels take them: P = exp(s - lse),
    dV = P^T dO, dS = P (dP - Delta) with dP = dO V^T and Delta = rowsum(dO out) - grad_lse, through the softcap's
    tanh and the scale; dQ = dS K, dK = dS^T Q; dK and dV summed over each query group."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv if Hkv else 1
    s, raw, visible, cdt = _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    p = torch.exp(s - lse.to(cdt).unsqueeze(-1)).masked_fill(~visible, 0.0).nan_to_num(0.0)
    do, qh = dout.to(cdt).transpose(1, 2), q.to(cdt).transpose(1, 2)
    delta = (do * out.to(cdt).transpose(1, 2)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cdt).masked_fill(lse.isinf(), 0.0)
    ds = p * (do @ _grouped(v.to(cdt), group).transpose(-1, -2) - delta.unsqueeze(-1)) * scale
    if softcap > 0:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = ds @ _grouped(k.to(cdt), group)

    def summed(x):  # (B, Hq, Sk, D) -> (B, Sk, Hkv, D)
        return x.reshape(B, Hkv, group, Sk, D).sum(2).transpose(1, 2)

    dk, dv = summed(ds.transpose(-1, -2) @ qh), summed(p.transpose(-1, -2) @ do)
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq.transpose(1, 2), q), (dk, k), (dv, v)))


def _note(q, softmax_scale, causal, window, softcap, alibi_slopes, varlen=False):
    """While recording (record.py): the kernel a CUDA call on these inputs launches."""
    if record.active() and q.dtype in checks.CUDA_INPUT_DTYPES and q.shape[-1] in HEAD_DIMS:
        from ..kernels.attention_launch import attention_problem

        record.add("flash_attention", attention_problem(q, causal, window, softcap, alibi_slopes is not None, varlen))


def _flash_attention_reference(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                               softcap=0.0, alibi_slopes=None, deterministic=False):
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    _note(q, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes)
    out, lse = attention_reference(q, k, v, softmax_scale, causal, (window_left, window_right), softcap,
                                   alibi_slopes, return_lse=True)
    return out.contiguous(), lse.to(torch.float32).contiguous()


def _flash_attention_fake(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                          alibi_slopes=None, deterministic=False):
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    B, Sq, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Sq), dtype=torch.float32)


# --------------------------------------------------------------------------- CUDA


def _flash_attention_cuda(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                          alibi_slopes=None, deterministic=False):
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    _check_cuda_layout(q, k, v)
    _note(q, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes)
    B, Sq, Hq, D = q.shape
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys: every row sees none
        return out.zero_(), lse.fill_(-math.inf)
    from ..kernels.attention_launch import launch_attention

    launch_attention(q, k, v, out, lse, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes)
    return out, lse


# --------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.tile_ops.flash_attention_backward(grad_out, q, k, v, out, lse, grad_lse, *ctx.options,
                                                             alibi_slopes, ctx.deterministic)
    needs = ctx.needs_input_grad[:3]
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            None, None, None, None, None, None, None)


def _flash_attention_backward_reference(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                        deterministic=False):
    return attention_backward_reference(dout, q, k, v, out, lse, grad_lse, softmax_scale, causal,
                                        (window_left, window_right), softcap, alibi_slopes)


def _flash_attention_backward_fake(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                   deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _readable(dout):
    """``dout`` as the kernels read it (rows contiguous and 16-byte aligned), copied where it is not: autograd may
    hand over an expanded or sliced gradient."""
    if dout.stride(-1) != 1 or dout.data_ptr() % checks.POINTER_ALIGNMENT or \
            any(s * dout.element_size() % checks.POINTER_ALIGNMENT for s in dout.stride()[:-1]):
        return dout.contiguous()
    return dout


def _flash_attention_backward_cuda(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                   deterministic=False):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:  # no query or no key: no gradient flows
        return dq.zero_(), dk.zero_(), dv.zero_()
    from ..kernels.attention_launch import launch_attention_backward

    dout = _readable(dout)
    launch_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, (window_left, window_right),
                              softcap, alibi_slopes, grad_lse, deterministic)
    return dq, dk, dv


_op = torch.library.custom_op(
    "tile_ops::flash_attention", _flash_attention_reference, mutates_args=(), device_types="cpu",
    schema="(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, int window_left=-1, "
           "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool deterministic=False) -> "
           "(Tensor, Tensor)")
_op.register_kernel("cuda", _flash_attention_cuda)
_op.register_fake(_flash_attention_fake)
_op.register_autograd(_backward, setup_context=_setup_context)

_backward_op = torch.library.custom_op(
    "tile_ops::flash_attention_backward", _flash_attention_backward_reference, mutates_args=(), device_types="cpu",
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse=None, "
           "float? softmax_scale=None, bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
           "Tensor? alibi_slopes=None, bool deterministic=False) -> (Tensor, Tensor, Tensor)")
_backward_op.register_kernel("cuda", _flash_attention_backward_cuda)
_backward_op.register_fake(_flash_attention_backward_fake)


# --------------------------------------------------------------------------- packed sequences (varlen)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap,
                  alibi_slopes):
    """check_inputs on packed (total, H, D) tensors and their offsets' dtypes and shapes (not their values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{OP}: {name} must be a packed (total, nheads, headdim) tensor, got "
                             f"{list(getattr(t, 'shape', [])) or type(t).__name__}")
    check_inputs(q[None], k[None], v[None], softmax_scale, window_left, window_right, softcap)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise TypeError(f"{OP}: {name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} {list(getattr(cu, 'shape', []))}")
        if cu.device != q.device:
            raise RuntimeError(f"{OP}: {name} is on {cu.device}, q on {q.device}; accepted: all on one device")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"{OP}: cu_seqlens_k has {cu_seqlens_k.numel()} offsets, cu_seqlens_q "
                         f"{cu_seqlens_q.numel()}; accepted: the same count")
    _check_slopes(alibi_slopes, cu_seqlens_q.numel() - 1, q.shape[1], q.device)


def _offsets(name, cu, total):
    """The host copy of a cu_seqlens tensor, checked: from 0, non-decreasing, ending within ``total``."""
    offsets = cu.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[-1] > total:
        raise ValueError(f"{OP}: {name}={offsets[:8]}{'...' if len(offsets) > 8 else ''}; accepted: offsets from 0, "
                         f"non-decreasing, the last at most the tensor's {total} tokens")
    return offsets


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """[(sequence index, (q0, q1), (k0, k1))] of the non-empty query sequences, offsets checked."""
    oq = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ok = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    return oq, ok, [(i, (oq[i], oq[i + 1]), (ok[i], ok[i + 1])) for i in range(len(oq) - 1) if oq[i + 1] > oq[i]]


def _slopes_of(alibi_slopes, i):
    return alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def _flash_attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                      deterministic=False):
    """Each sequence through the reference; rows past the last sequence: out 0, lse -inf."""
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    _, _, seqs = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    for i, (q0, q1), (k0, k1) in seqs:
        o, l_ = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal,
                                    (window_left, window_right), softcap, _slopes_of(alibi_slopes, i), return_lse=True)
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse


def _flash_attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                 window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _flash_attention_varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                 window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    _check_cuda_layout(q[None], k[None], v[None])
    _note(q, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes, varlen=True)
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


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, \
        deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = torch.ops.tile_ops.flash_attention_varlen_backward(
        grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, alibi_slopes,
        ctx.deterministic)
    needs = ctx.needs_input_grad[:3]
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 9


def _flash_attention_varlen_backward_reference(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k,
                                               softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                                               softcap=0.0, alibi_slopes=None, deterministic=False):
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


def _flash_attention_varlen_backward_fake(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k,
                                          softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                                          alibi_slopes=None, deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _flash_attention_varlen_backward_cuda(dout, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k,
                                          softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                                          alibi_slopes=None, deterministic=False):
    oq, ok, _ = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dout = _readable(dout)
    from ..kernels.attention_launch import launch_attention_backward_varlen

    launch_attention_backward_varlen(dout, q, k, v, out, lse, dq, dk, dv, oq, ok, cu_seqlens_q.contiguous(),
                                     cu_seqlens_k.contiguous(), softmax_scale, causal, (window_left, window_right),
                                     softcap, alibi_slopes, grad_lse, deterministic)
    return dq, dk, dv


_varlen_op = torch.library.custom_op(
    "tile_ops::flash_attention_varlen", _flash_attention_varlen_reference, mutates_args=(), device_types="cpu",
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float? softmax_scale=None, "
           "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
           "bool deterministic=False) -> (Tensor, Tensor)")
_varlen_op.register_kernel("cuda", _flash_attention_varlen_cuda)
_varlen_op.register_fake(_flash_attention_varlen_fake)
_varlen_op.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)

_varlen_backward_op = torch.library.custom_op(
    "tile_ops::flash_attention_varlen_backward", _flash_attention_varlen_backward_reference, mutates_args=(),
    device_types="cpu",
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse, Tensor cu_seqlens_q, "
           "Tensor cu_seqlens_k, float? softmax_scale=None, bool causal=False, int window_left=-1, "
           "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool deterministic=False) -> "
           "(Tensor, Tensor, Tensor)")
_varlen_backward_op.register_kernel("cuda", _flash_attention_varlen_backward_cuda)
_varlen_backward_op.register_fake(_flash_attention_varlen_backward_fake)


# --------------------------------------------------------------------------- flash-attn's API


def _refuse(dropout_p, block_table=None):
    if dropout_p:
        raise NotImplementedError(f"{OP}: dropout_p={dropout_p}; accepted: 0.0 (attention dropout is not "
                                  f"implemented: it needs a reproducible RNG in the kernel; FlashAttention-3 has "
                                  f"none either)")
    if block_table is not None:
        raise NotImplementedError(f"{OP}: block_table (a paged KV cache) is not supported; accepted: None")


def _flag(name, value) -> bool:
    """A keyword that is True or False (as flash-attn's pybind11 binding takes it): 0 and 1 too, not a string."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or \
            (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{OP}: {name}={value!r}; accepted: True or False")


def _scale(softmax_scale):
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"{OP}: softmax_scale={softmax_scale!r}; accepted: None (1/sqrt(head_dim)) or a finite "
                        f"float > 0")
    return softmax_scale


def _softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{OP}: softcap={softcap!r}; accepted: a finite float >= 0 (0: none)")
    return float(softcap)


def _window(window_size):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"{OP}: window_size={window_size!r}; accepted: a pair (left, right) of ints >= -1")
    _check_window(*window_size)
    return int(window_size[0]), int(window_size[1])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func`` on (batch, seqlen, nheads, headdim) tensors: ``out``, with
    ``return_attn_probs`` ``(out, softmax_lse, None)`` (lse (batch, nheads, seqlen_q), float32; the probabilities
    themselves are never formed).  ``deterministic``: bit-identical gradients run to run (dQ from its own kernel
    rather than atomic adds; the forward is deterministic either way)."""
    _refuse(dropout_p)
    left, right = _window(window_size)
    causal, deterministic, probs = (_flag(n, x) for n, x in (("causal", causal), ("deterministic", deterministic),
                                                              ("return_attn_probs", return_attn_probs)))
    out, lse = torch.ops.tile_ops.flash_attention(q, k, v, _scale(softmax_scale), causal, left, right,
                                                  _softcap(softcap), alibi_slopes, deterministic)
    return (out, lse, None) if probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` on packed (total, nheads, headdim) tensors, sequence i being
    rows ``cu_seqlens[i]:cu_seqlens[i + 1]``: ``out`` (total_q, nheads, headdim), with ``return_attn_probs``
    ``(out, softmax_lse, None)``, lse (nheads, total_q); rows past the last sequence get 0 (lse -inf).  On CUDA
    one launch over every sequence's query tiles (``torch.ops.tile_ops.flash_attention_varlen``); the offsets
    are checked on the host (one copy of each), ``max_seqlen_*`` against them."""
    _refuse(dropout_p, block_table)
    left, right = _window(window_size)
    causal, deterministic, probs = (_flag(n, x) for n, x in (("causal", causal), ("deterministic", deterministic),
                                                              ("return_attn_probs", return_attn_probs)))
    softcap, softmax_scale = _softcap(softcap), _scale(softmax_scale)
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, softcap, alibi_slopes)
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if isinstance(bound, torch.SymInt):  # traced: the op checks the offsets, the bound is a hint
            continue
        offsets = _offsets(name.replace("max_seqlen", "cu_seqlens"), cu, (q if name.endswith("q") else k).shape[0])
        longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
        if isinstance(bound, torch.Tensor) and bound.numel() == 1 and not bound.is_floating_point():
            bound = int(bound)  # transformers may hand the longest length over as a tensor
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral) or bound < longest:
            raise ValueError(f"{OP}: {name}={bound!r}; accepted: an int at least the longest sequence ({longest}): "
                             f"flash-attn sizes its grid by it and would leave the rows past it unwritten")
    out, lse = torch.ops.tile_ops.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                         left, right, softcap, alibi_slopes, deterministic)
    return (out, lse, None) if probs else out


flash_attention = torch.ops.tile_ops.flash_attention
