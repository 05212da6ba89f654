"""``torch.func`` and forward mode for the ops, eagerly: ``grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``,
``hessian``, ``vmap`` and their compositions (one forward level), and ``torch.autograd.forward_ad``.

A custom op's autograd, registered with ``register_autograd``, runs as an ``autograd.Function`` without a
``setup_context``, which ``torch.func`` refuses (pytorch#168393), and without a forward-mode formula.  So
under a transform (or a forward_ad level) the wrappers apply an ``autograd.Function`` built here from the
op's own ``setup_context`` and backward plus its tangent: functorch then carries it through every level,
each at its own (grad: backward; jvp: the tangent; vmap: the op's batching rule).  The batching rules fold
the mapped dim into one call of the op (more rows, or the op's own batch) instead of a call per slice.  (The ops
called directly get their forward mode from ``forward_ad.register_forward_mode``.)
"""

import torch
from torch._C._functorch import CInterpreter, TransformType, peek_interpreter_stack
from torch._functorch.pyfunctorch import coerce_cinterpreter


def refuse_traced_grad(op: str) -> None:
    """Under torch.compile the op's own autograd meets torch.func.grad (dynamo does not trace the Functions
    here): torch refuses it in its words, these say what works.  The innermost level, which dynamo traces."""
    top = peek_interpreter_stack()  # (dynamo wraps a None as an object: `is not None` would hold)
    if isinstance(top, CInterpreter) and coerce_cinterpreter(top).key() == TransformType.Grad:
        raise NotImplementedError(f"{op}: torch.func.grad, vjp and jacrev inside torch.compile are not supported "
                                  f"(a custom op's autograd has no setup_context, pytorch#168393); supported: "
                                  f"those transforms eagerly, and torch.autograd (loss.backward()) when compiled")


def autograd_function(name: str, op, setup_context, backward, saved, jvp) -> type:
    """An ``autograd.Function`` running ``op`` with the op's ``setup_context`` and ``backward``, and
    ``jvp(ctx, *tangents)``.  It saves ``saved(inputs, output)`` for both directions: vmap keeps one record
    of what was saved, and the op's backward reads its own tensors first in that tuple."""

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        tensors = saved(inputs, output)
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": True,
        "forward": staticmethod(op),
        "setup_context": staticmethod(setup),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
    })


def _front(x, dim):
    return x if dim is None else x.movedim(dim, 0)


def batched_matmul(op, a, b, a_dim, b_dim):
    """``op(a, b)`` over vmap's mapped dim (at ``a_dim``/``b_dim``, None when unmapped) as one call of ``op``
    (a ``(..., M, K) x (..., K, N)`` matmul-like op with a 2-D operand broadcast over the other's batch);
    the result has the mapped dim first."""
    a, b = _front(a, a_dim), _front(b, b_dim)
    if a_dim is None and b_dim is None:  # only a bias is mapped: a mapped dim of 1 that it broadcasts over
        return op(a, b).unsqueeze(0)
    if b_dim is None and b.dim() == 2:  # every slice's rows: one taller problem (flatten: K may be 0)
        return op(a.flatten(0, -2), b).unflatten(0, a.shape[:-1])
    if a_dim is None and a.dim() == 2:  # the op broadcasts a over b's batch
        return op(a, b.flatten(0, -3)).unflatten(0, b.shape[:-2])
    size = (a if a_dim is not None else b).shape[0]
    a = a if a_dim is not None else a.expand(size, *a.shape)
    b = b if b_dim is not None else b.expand(size, *b.shape)
    rank = max(a.dim(), b.dim())  # a 2-D slice broadcast over the other's batch: a batch of 1 after the mapped dim
    a, b = (x if x.dim() == rank else x.unsqueeze(1) for x in (a, b))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])
    return op(a.flatten(0, -3), b.flatten(0, -3)).unflatten(0, batch)


def _slice(x, dim):
    """A stand-in for one slice of ``x`` mapped at ``dim`` (None: unmapped, ``x`` itself) for the op's input
    checks: its shape, dtype, device and layout, without its data (a batch may be empty)."""
    return x if dim is None or x is None else x.new_empty(()).expand(_front(x, dim).shape[1:])


def gemm_vmap_rule(gemm, compute_dtype, check):
    """The batching rule of ``gemm(a, b, bias, out_dtype)``: one gemm; a mapped bias (one per slice: model
    ensembles) is added after a float32 (float64) gemm, as the kernel adds it before rounding.  ``check``, the
    op's input checks, first sees a slice: the folded call would take what a slice may not be (other ranks,
    batch sizes, bias dtypes) and report what it refuses in the folded shapes."""

    def rule(info, in_dims, a, b, bias=None, out_dtype=None):
        a_dim, b_dim, bias_dim = (*in_dims, None)[:3]  # (no entry for an omitted bias)
        check(_slice(a, a_dim), _slice(b, b_dim), _slice(bias, bias_dim), out_dtype)
        if bias_dim is None:
            return batched_matmul(lambda x, y: gemm(x, y, bias, out_dtype), a, b, a_dim, b_dim), 0
        out = batched_matmul(lambda x, y: gemm(x, y, None, compute_dtype(a.dtype)), a, b, a_dim, b_dim)
        bias = _front(bias, bias_dim)
        bias = bias.reshape(bias.shape[0], *[1] * (out.dim() - 2), bias.shape[-1])  # over its slice's rows
        return (out + bias).to(out_dtype or a.dtype), 0

    return rule


def gemm_softmax_vmap_rule(gemm_softmax, check):
    """The batching rule of ``gemm_softmax(a, b, scale, out_dtype)``: rows are independent, so one call
    (after ``check``, as for gemm)."""

    def rule(info, in_dims, a, b, scale=1.0, out_dtype=None):
        check(_slice(a, in_dims[0]), _slice(b, in_dims[1]), scale, out_dtype)
        return batched_matmul(lambda x, y: gemm_softmax(x, y, scale, out_dtype), a, b, *in_dims[:2]), 0

    return rule
