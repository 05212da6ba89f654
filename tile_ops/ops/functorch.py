"""``torch.func`` and forward mode for the ops, eagerly: ``grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``,
``hessian``, ``vmap`` and their compositions (one forward level), and ``torch.autograd.forward_ad``.

A custom op's autograd, registered with ``register_autograd``, runs as an ``autograd.Function`` without a
``setup_context``, which ``torch.func`` refuses (pytorch#168393), and without a forward-mode formula.  So
under a transform (or a forward_ad level) the wrappers apply an ``autograd.Function`` built here from the
op's own ``setup_context`` and backward plus its tangent: functorch then carries it through every level,
each at its own (grad: backward; jvp: the tangent; vmap: the op's batching rule, ``OpSpec.vmap``, which folds
the mapped dim into one call of the op, more rows or the op's own batch, instead of a call per slice; the helpers
below are theirs).  (The ops called directly get their forward mode from ``forward_ad.register_forward_mode``.)
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


def autograd_function(spec, op) -> type:
    """An ``autograd.Function`` running ``op`` (the custom op ``spec`` describes) with the spec's
    ``setup_context``, ``backward`` and ``jvp``.  It saves ``spec.saved(inputs, output)`` for both directions:
    vmap keeps one record of what was saved, and the op's backward reads its own tensors first in that tuple."""

    def setup(ctx, inputs, output):
        spec.setup_context(ctx, inputs, output)
        tensors = spec.saved(inputs, output)
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    name = "".join(part.title() for part in spec.name.split("_")) + "Function"  # GemmFunction, ...
    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": True,
        "forward": staticmethod(op),
        "setup_context": staticmethod(setup),
        "backward": staticmethod(spec.backward),
        "jvp": staticmethod(spec.jvp),
    })


def mapped_first(x, dim):
    """``x`` with vmap's mapped dim (at ``dim``, None when unmapped) first."""
    return x if dim is None else x.movedim(dim, 0)


def batched_matmul(op, a, b, a_dim, b_dim):
    """``op(a, b)`` over vmap's mapped dim (at ``a_dim``/``b_dim``, None when unmapped) as one call of ``op``
    (a ``(..., M, K) x (..., K, N)`` matmul-like op with a 2-D operand broadcast over the other's batch);
    the result has the mapped dim first."""
    a, b = mapped_first(a, a_dim), mapped_first(b, b_dim)
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


def one_slice(x, dim):
    """A stand-in for one slice of ``x`` mapped at ``dim`` (None: unmapped, ``x`` itself) for the op's input
    checks: its shape, dtype, device and layout, without its data (a batch may be empty).  A batching rule checks
    a slice first: the folded call would take what a slice may not be (other ranks, batch sizes, dtypes) and
    report what it refuses in the folded shapes."""
    return x if dim is None or x is None else x.new_empty(()).expand(mapped_first(x, dim).shape[1:])
