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
  every batch, head count, length, scale, softcap and window size; q, k and v reach it through their strides, no
  copies, where each has a contiguous last dimension and 16-byte-aligned rows (e.g. (B, H, S, D) tensors
  transposed); an expanded dim (stride 0, which TMA cannot step through) is copied.
* CPU: the reference in plain torch (float32; float64 for float64 inputs).
* Fake: shapes and dtypes, for ``torch.compile``.
* Fast path: a repeated CUDA call of a signature launches the plan its first call recorded (fastpath.py).
* Autograd: ``tile_ops::flash_attention_backward(dout, q, k, v, out, lse, grad_lse, ...same options) -> (dq, dk,
  dv)``, itself a custom op: on CUDA ``tile_ops.kernels.attention_backward``, on the CPU the reference's gradients;
  no second derivative, none in ALiBi's slopes (refused by name).
* Forward mode (``torch.func.jvp``, ``forward_ad``): the tangents of out and lse in plain torch, the scores formed.
* vmap: the mapped dim folded into the batch, one call; torch.func's grad, vjp, jacrev through flash-attn's
  functions (their autograd.Function, as for every op: spec.py).

Packed sequences (flash-attn's varlen layout) have their own pair: attention_varlen.py.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..autotune import targets
from . import checks, fastpath, functorch, spec

OP = "tile_ops.flash_attention"
HEAD_DIMS = (64, 96, 128, 192, 256)  # the CUDA kernel's (any head dim on the CPU)


# --------------------------------------------------------------------------- checks


def _check_window(window_left, window_right):
    for name, w in (("window_size[0]", window_left), ("window_size[1]", window_right)):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise ValueError(f"{OP}: {name}={w!r}; accepted: an int >= -1 (-1: unbounded)")


def check_inputs(q, k, v, softmax_scale=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                 strides=True):
    """ValueError/TypeError naming the argument unless the op can run on these inputs (shapes and dtypes, and with
    ``strides`` the last dimension's: the fake implementation runs it too)."""
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
    for name, t in (("q", q), ("k", k), ("v", v)) if strides else ():
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
    check_slopes(alibi_slopes, B, Hq, q.device)


def check_slopes(alibi_slopes, B, Hq, device):
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


def check_cuda_layout(q, k, v):
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


def _probabilities(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """(P = exp(s - lse), 0 where a query does not see a key; the scaled products before the softcap; the scale;
    the query heads per K/V head; the compute dtype) from the forward's ``lse``."""
    s, raw, visible, cdt = _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    p = torch.exp(s - lse.to(cdt).unsqueeze(-1)).masked_fill(~visible, 0.0).nan_to_num(0.0)
    return p, raw, scale, q.shape[2] // k.shape[2] if k.shape[2] else 1, cdt


def attention_backward_reference(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(dq, dk, dv) in plain torch, from the forward's ``out`` and ``lse`` as the kernels take them: P = exp(s - lse),
    dV = P^T dO, dS = P (dP - Delta) with dP = dO V^T and Delta = rowsum(dO out) - grad_lse, through the softcap's
    tanh and the scale; dQ = dS K, dK = dS^T Q; dK and dV summed over each query group."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    p, raw, scale, group, cdt = _probabilities(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes)
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


def attention_tangent(q, k, v, out, lse, tq, tk, tv, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, t_slopes=None):
    """The tangents of (out, lse) for tangents ``tq``, ``tk``, ``tv``, ``t_slopes`` (None: zero) of (B, S, H, D)
    inputs and the ALiBi slopes, in plain torch with the scores formed: with P = exp(s - lse) and ds the scores'
    tangent (through the softcap's tanh), d lse = rowsum(P ds) and d out = (P (ds - d lse)) V + P dV."""
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    p, raw, scale, group, cdt = _probabilities(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes)
    ds = torch.zeros_like(p)
    if tq is not None:
        ds = ds + tq.to(cdt).transpose(1, 2) @ _grouped(k.to(cdt), group).transpose(-1, -2)
    if tk is not None:
        ds = ds + q.to(cdt).transpose(1, 2) @ _grouped(tk.to(cdt), group).transpose(-1, -2)
    ds = ds * scale
    if softcap > 0:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    if t_slopes is not None:  # the bias -slope * |i + Sk - Sq - j|
        distance = torch.arange(Sq, device=q.device).view(-1, 1) + Sk - Sq - torch.arange(Sk, device=q.device)
        ds = ds - t_slopes.to(cdt).reshape(-1, Hq, 1, 1) * distance.abs().to(cdt)
    dlse = (p * ds).sum(-1)
    dout = (p * (ds - dlse.unsqueeze(-1))) @ _grouped(v.to(cdt), group)
    if tv is not None:
        dout = dout + p @ _grouped(tv.to(cdt), group)
    return dout.transpose(1, 2).to(out.dtype).contiguous(), dlse.to(lse.dtype)


# --------------------------------------------------------------------------- the forward op


def _flash_attention_reference(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                               softcap=0.0, alibi_slopes=None, deterministic=False):
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    out, lse = attention_reference(q, k, v, softmax_scale, causal, (window_left, window_right), softcap,
                                   alibi_slopes, return_lse=True)
    return out.contiguous(), lse.to(torch.float32).contiguous()


def _flash_attention_fake(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                          alibi_slopes=None, deterministic=False):
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    B, Sq, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def _flash_attention_cuda(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                          alibi_slopes=None, deterministic=False):
    """Checked, launched on the caller's tensors; the call's plan recorded where one launch ran it."""
    check_inputs(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    check_cuda_layout(q, k, v)
    B, Sq, Hq, D = q.shape
    out = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys: every row sees none
        return out.zero_(), lse.fill_(-math.inf)
    from ..kernels.attention_launch import launch_attention

    operands = tuple(readable(t) for t in (q, k, v))  # (aligned: checked above; an expanded dim is copied)
    program = launch_attention(*operands, out, lse, softmax_scale, causal, (window_left, window_right), softcap,
                               alibi_slopes)
    if program is not None and all(a is b for a, b in zip(operands, (q, k, v))):  # the caller's own tensors: planned
        fastpath.record(FLASH_ATTENTION.plan_id, *_signature(q, k, v, softmax_scale, causal, window_left,
                                                             window_right, softcap, alibi_slopes, deterministic),
                        (out, lse), program)
    return out, lse


def _signature(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
               alibi_slopes=None, deterministic=False):
    """(tensors, flags): what a call's plan is keyed on; the plan's buffers q, k, v, alibi_slopes, then out, lse."""
    return (q, k, v, alibi_slopes), (softmax_scale, causal, window_left, window_right, softcap, deterministic)


def _problem(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
             alibi_slopes=None, deterministic=False) -> list:
    """The kernel problem of a call (record.py), where the CUDA path launches one."""
    if q.dtype not in checks.CUDA_INPUT_DTYPES or q.shape[-1] not in HEAD_DIMS or not q.numel() or not k.shape[1]:
        return []
    from ..kernels.attention_launch import attention_problem

    return [attention_problem(q, causal, (window_left, window_right), softcap, alibi_slopes is not None)]


_FORWARD_ARGS = spec.with_defaults(_flash_attention_reference)  # the dispatcher drops trailing defaults


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = \
        _FORWARD_ARGS(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def refuse_slope_gradients(needs: bool) -> None:
    """ALiBi's slopes are an input the kernels take no derivative in: refused, never a silent zero."""
    if needs:
        raise NotImplementedError(f"{OP}: alibi_slopes requires a gradient, which is not computed; accepted: "
                                  f"slopes that need none (a buffer, or alibi_slopes.detach())")


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad) + (False,) * 10
    refuse_slope_gradients(needs[8])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = apply(FLASH_ATTENTION_BACKWARD, (grad_out, q, k, v, out, lse, grad_lse, *ctx.options, alibi_slopes,
                                                  ctx.deterministic))
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 7


def _tangent(ops, args, tangents, output):
    (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, _), t = args, tangents
    return attention_tangent(q, k, v, *output, *t[:3], softmax_scale, causal, (window_left, window_right), softcap,
                             alibi_slopes, t[8])


def _jvp(ctx, tq, tk, tv, *rest):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    softmax_scale, causal, window_left, window_right, softcap = ctx.options
    return attention_tangent(q, k, v, out, lse, tq, tk, tv, softmax_scale, causal, (window_left, window_right),
                             softcap, alibi_slopes, rest[5] if len(rest) > 5 else None)


# --------------------------------------------------------------------------- vmap: the mapped dim as more batch


def fold(x, dim, n, into=0):
    """``x`` mapped at ``dim`` (None: unmapped, the same for each of the ``n`` slices) with the mapped dim folded
    into its dim ``into``: the slices side by side, slice-major."""
    x = x.movedim(dim, into) if dim is not None else x.unsqueeze(into).expand(*x.shape[:into], n, *x.shape[into:])
    return x.flatten(into, into + 1)


def fold_slopes(slopes, dim, n, batch):
    """ALiBi slopes, (Hq,) or (B, Hq) a slice, as the folded batch's: (n * B, Hq), or (Hq,) where no slice differs."""
    if slopes is None or (dim is None and slopes.dim() == 1):
        return slopes
    slopes = functorch.mapped_first(slopes, dim) if dim is not None else slopes.expand(n, *slopes.shape)
    if slopes.dim() == 2:  # (n, Hq): a slice's slopes over its batch
        slopes = slopes.unsqueeze(1).expand(n, batch, slopes.shape[-1])
    return slopes.flatten(0, 1)


def _vmap(info, in_dims, q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
          alibi_slopes=None, deterministic=False):
    """Slices are independent batches: one call over their batches side by side (a slice checked first)."""
    in_dims = tuple(in_dims) + (None,) * (10 - len(in_dims))
    one = functorch.one_slice
    q1 = one(q, in_dims[0])
    check_inputs(q1, one(k, in_dims[1]), one(v, in_dims[2]), softmax_scale, window_left, window_right, softcap,
                 one(alibi_slopes, in_dims[8]), strides=False)  # (folding lays the slices out anew)
    n, B = info.batch_size, q1.shape[0]
    out, lse = FLASH_ATTENTION.op(*(fold(t, d, n) for t, d in zip((q, k, v), in_dims)), softmax_scale, causal,
                                  window_left, window_right, softcap,
                                  fold_slopes(alibi_slopes, in_dims[8], n, B), deterministic)
    return (out.unflatten(0, (n, B)), lse.unflatten(0, (n, B))), (0, 0)


# --------------------------------------------------------------------------- the autotuner and the command line


class FlashAttentionTarget(targets.Target):
    """The forward kernel at (seqlen, q heads, head dim), "SxHxD": tuned on plain attention with Sq = Sk = seqlen
    over ``batch(seqlen)`` sequences (a full GPU); the tuned config serves every mask kind at that head dim and
    head count, lengths bucketed as a gemm's M (autotune/table.py).  Precompile builds what a training step
    launches (forward, Delta, backward), plain and causal, padded and packed, at the default configs."""

    metavar = "SxHxD"
    speed = "TFLOP/s"
    demo = [((2048, 16, 128), "bfloat16")]
    demo_quick = [((256, 4, 64), "float16")]
    precompile = [(4096, 32, 128)]

    @staticmethod
    def batch(seqlen: int) -> int:
        return max(1, 16384 // seqlen)

    def configs(self):
        from ..kernels import attention_config as ac

        return targets.KernelConfigs(ac.AttentionConfig, ac.config_space,
                                     lambda S, H, D, arch=None: ac.default_config(D, arch),
                                     lambda cfg, S, H, D, dtype: ac.shared_memory_bytes(cfg, D))

    def problem(self, shape, dtype: str, scale: float = 1.0) -> dict:
        return dict(dim=shape[2], dtype=dtype, causal=False, local=False, softcap=False, alibi=False, varlen=False)

    def problems(self, shape, dtype: str, scale: float = 1.0) -> list:
        plain = self.problem(shape, dtype)
        return [dict(plain, causal=causal, varlen=packed) for causal in (False, True) for packed in (False, True)]

    def shape_of(self, problem: dict):
        return None  # a problem holds no sizes: its kernels serve every one

    def describe(self, problem: dict) -> str:
        kind = [name for name in ("causal", "local", "softcap", "alibi", "varlen") if problem.get(name)]
        return " ".join([f"d{problem['dim']} {problem['dtype']}", *kind])

    def compile(self, shape, dtype: str, cfg, arch: str):
        from ..kernels.attention_launch import build_attention

        return self.launchable(build_attention(self.problem(shape, dtype), cfg, arch), shape, dtype)

    def launchable(self, kernel, shape, dtype: str):
        from ..kernels.attention_launch import forward_launch

        S, H, D = shape
        return forward_launch(kernel, self.batch(S), S, H, D, getattr(torch, dtype))

    def kernel_call(self, problem: dict, arch: str):
        from ..kernels.attention import flash_attention_forward
        from ..kernels.attention_config import default_config
        from ..kernels.attention_launch import build_attention

        cfg = default_config(problem["dim"], arch)
        return (flash_attention_forward, (), dict(problem, cfg=cfg)), lambda: build_attention(problem, cfg, arch)

    def precompiled(self, problem: dict, arch: str):
        from ..kernels.attention_launch import training_kernels

        key, _ = self.launched(problem, arch)
        return key, lambda: training_kernels(problem, arch)[0]

    def inputs(self, shape, dtype: str, device):
        S, H, D = shape
        B, dt = self.batch(S), getattr(torch, dtype)
        q, k, v = (torch.randn(B, S, H, D, dtype=dt, device=device) for _ in range(3))
        return [q, k, v, torch.empty(B, H, S, device=device), torch.empty_like(q)]

    def reference(self, args, scale: float = 1.0, dtype=None):
        dtype = dtype or torch.float32  # one sequence at a time: the scores of all would not fit
        return torch.cat([attention_reference(*(t[b:b + 1].to(dtype) for t in args[:3])) for b in range(len(args[0]))])

    def torch_equivalent(self, args, scale: float):
        q, k, v = (t.transpose(1, 2) for t in args[:3])
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def flops(self, shape) -> int:  # Q K^T and P V
        S, H, D = shape
        return 4 * self.batch(S) * S * S * H * D


FLASH_ATTENTION = spec.register(spec.OpSpec(
    name="flash_attention",
    schema="(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, int window_left=-1, "
           "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool deterministic=False) -> "
           "(Tensor, Tensor)",
    reference=_flash_attention_reference,
    fake=_flash_attention_fake,
    launch=_flash_attention_cuda,
    signature=_signature,
    vmap=_vmap,
    setup_context=_setup_context,
    backward=_backward,
    saved=lambda inputs, output: (*inputs[:3], *output, _FORWARD_ARGS(inputs)[8]),  # as the backward reads them
    jvp=_jvp,
    tangent=_tangent,
    tuning=FlashAttentionTarget(),
    problem=_problem,
))


# --------------------------------------------------------------------------- the backward op


def _flash_attention_backward_reference(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                        window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                        deterministic=False):
    return attention_backward_reference(dout, q, k, v, out, lse, grad_lse, softmax_scale, causal,
                                        (window_left, window_right), softcap, alibi_slopes)


def _flash_attention_backward_fake(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                   deterministic=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def readable(t):
    """``t`` as the kernels read it (rows contiguous and 16-byte aligned, no dim of stride 0: TMA steps through
    each), copied where it is not: autograd may hand over an expanded or sliced gradient, a caller K and V expanded
    over their heads."""
    if t.stride(-1) != 1 or t.data_ptr() % checks.POINTER_ALIGNMENT or any(
            s * t.element_size() % checks.POINTER_ALIGNMENT or (s == 0 and n > 1)
            for n, s in zip(t.shape[:-1], t.stride()[:-1])):
        return t.contiguous()
    return t


def _flash_attention_backward_cuda(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                                   deterministic=False):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:  # no query or no key: no gradient flows
        return dq.zero_(), dk.zero_(), dv.zero_()
    from ..kernels.attention_launch import launch_attention_backward

    dout, q, k, v = (readable(t) for t in (dout, q, k, v))
    launch_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal,
                              (window_left, window_right), softcap, alibi_slopes, grad_lse, deterministic)
    return dq, dk, dv


def _backward_signature(dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False, window_left=-1,
                        window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    return (dout, q, k, v, out, lse, grad_lse, alibi_slopes), (softmax_scale, causal, window_left, window_right,
                                                               softcap, deterministic)


def _backward_vmap(info, in_dims, dout, q, k, v, out, lse, grad_lse=None, softmax_scale=None, causal=False,
                   window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False):
    """As the forward's: the slices' batches side by side, one call."""
    in_dims = tuple(in_dims) + (None,) * (14 - len(in_dims))
    n, B = info.batch_size, functorch.one_slice(q, in_dims[1]).shape[0]
    tensors = [None if t is None else fold(t, d, n) for t, d in zip((dout, q, k, v, out, lse, grad_lse), in_dims)]
    grads = FLASH_ATTENTION_BACKWARD.op(*tensors, softmax_scale, causal, window_left, window_right, softcap,
                                        fold_slopes(alibi_slopes, in_dims[12], n, B), deterministic)
    return tuple(g.unflatten(0, (n, B)) for g in grads), (0, 0, 0)


FLASH_ATTENTION_BACKWARD = spec.register(spec.OpSpec(
    name="flash_attention_backward",
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse=None, "
           "float? softmax_scale=None, bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
           "Tensor? alibi_slopes=None, bool deterministic=False) -> (Tensor, Tensor, Tensor)",
    reference=_flash_attention_backward_reference,
    fake=_flash_attention_backward_fake,
    launch=_flash_attention_backward_cuda,
    signature=_backward_signature,
    vmap=_backward_vmap,
))


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


def api_options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                block_table=None):
    """flash-attn's keywords checked, as the ops take them: (softmax_scale, causal, window_left, window_right,
    softcap, deterministic), return_attn_probs."""
    _refuse(dropout_p, block_table)
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"{OP}: softmax_scale={softmax_scale!r}; accepted: None (1/sqrt(head_dim)) or a finite "
                        f"float > 0")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"{OP}: window_size={window_size!r}; accepted: a pair (left, right) of ints >= -1")
    _check_window(*window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{OP}: softcap={softcap!r}; accepted: a finite float >= 0 (0: none)")
    causal, deterministic, probs = (_flag(n, x) for n, x in (("causal", causal), ("deterministic", deterministic),
                                                              ("return_attn_probs", return_attn_probs)))
    options = (softmax_scale, causal, int(window_size[0]), int(window_size[1]), float(softcap), deterministic)
    return options, probs


def apply(op_spec, args):
    """``op_spec``'s op on ``args`` (the op's arguments) as the flash-attn functions call it: under a torch.func
    transform or a forward-mode level its autograd.Function (grad, vmap, jvp), else the op."""
    eager = not torch.compiler.is_compiling()
    out = spec.transformed(op_spec, op_spec.op, args, eager)
    return out if out is not None else op_spec.op(*args)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's ``flash_attn_func`` on (batch, seqlen, nheads, headdim) tensors: ``out``, with
    ``return_attn_probs`` ``(out, softmax_lse, None)`` (lse (batch, nheads, seqlen_q), float32; the probabilities
    themselves are never formed).  ``deterministic``: bit-identical gradients run to run (dQ from its own kernel
    rather than atomic adds; the forward is deterministic either way).  Differentiable in q, k and v
    (``loss.backward()``, ``torch.func.grad``/``vjp``/``jacrev``), forward mode too (``torch.func.jvp``,
    ``forward_ad``: the scores formed in plain torch), ``torch.func.vmap`` (the mapped dim as more batch); not
    twice (no second derivative), and not in ALiBi's slopes."""
    (scale, causal, left, right, softcap, deterministic), probs = api_options(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    out, lse = apply(FLASH_ATTENTION, (q, k, v, scale, causal, left, right, softcap, alibi_slopes, deterministic))
    return (out, lse, None) if probs else out


flash_attention = torch.ops.tile_ops.flash_attention
