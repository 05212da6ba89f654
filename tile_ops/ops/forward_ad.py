"""Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) for the ops: dual operands taken apart and
the result's tangent built by the op's own formula (``OpSpec.tangent``).

A ``torch.library.custom_op`` has no forward-mode formula: its result would carry a zero (``func.jvp``) or no
(``forward_ad``) tangent, silently.  So :func:`dual` splits the operands into primals and tangents, runs the op
and attaches the tangent its spec computes from the ops themselves (e.g. ``d(a @ b + bias) = da @ b + a @ db +
dbias``): by the public wrappers under torch.compile (``spec.transformed``), and by the ops' own Autograd kernels
(:func:`register_forward_mode`) for the ops called directly (exported programs, FX graphs).  Eagerly the ops'
autograd Functions use the same formulas (``functorch.py``).  One forward level: nested ones are refused.
"""

import functools
import operator
from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch._C._functorch import CInterpreter, TransformType, peek_interpreter_stack
from torch._functorch import eager_transforms
from torch._functorch.pyfunctorch import coerce_cinterpreter
from torch._library.autograd import make_autograd_impl

_LIB = torch.library.Library("tile_ops", "IMPL")  # the ops' forward-mode Autograd kernels


def active() -> bool:
    """Whether a tangent could be attached to anything: a forward_ad dual level or a functorch transform."""
    return fwAD._current_level >= 0 or peek_interpreter_stack() is not None


def plain_operands_may_be_dual() -> bool:
    """The fast path's gate: a plan serves only plain tensors, and functorch's are wrapped (never plain), so
    only forward_ad's dual level can hide a tangent on one.  A module attribute, not a C call."""
    return fwAD._current_level >= 0


def _forward_levels() -> int:
    """How many forward levels are open.  Python globals only, so that dynamo traces it: functorch counts its
    jvps in ``JVP_NESTING`` (the outermost holds forward_ad's one dual level), forward_ad its own level."""
    return max(eager_transforms.JVP_NESTING, fwAD._current_level + 1)


def refuse_nested_levels(op: str) -> None:
    """A tangent built here, or by the ops' autograd Functions (from tensors saved at the inner level), is the
    innermost level's only: an outer level would miss the mixed terms.  Refused, not wrong."""
    if _forward_levels() > 1:
        raise NotImplementedError(f"{op}: nested forward-mode AD (jvp of jvp, jacfwd of jacfwd) is not supported; "
                                  f"supported: one forward level (torch.func.jvp, jacfwd, hessian, forward_ad)")


def _level() -> Optional[int]:
    """The dual level of the tangents: forward_ad's, else 0 under torch.func.jvp's interpreter (a compiled graph
    enters jvp without forward_ad's Python state); None when there is none."""
    if fwAD._current_level >= 0:
        return fwAD._current_level
    top = peek_interpreter_stack()
    return 0 if isinstance(top, CInterpreter) and coerce_cinterpreter(top).key() == TransformType.Jvp else None


def _split(op: str, *args):
    """(primals, tangents) of ``args`` (anything but a tensor passes through, its tangent None), or None when no
    tensor among them has a tangent."""
    level = _level()
    if level is None:
        return None
    duals = [fwAD.unpack_dual(t, level=level) if isinstance(t, torch.Tensor) else None for t in args]
    if all(d is None or d.tangent is None for d in duals):
        return None
    refuse_nested_levels(op)
    return ([t if d is None else d.primal for t, d in zip(args, duals)],
            [None if d is None else d.tangent for d in duals])


def sum_terms(terms):
    """The sum of the terms that are not None, broadcast (with +: vectorized jacobians' vmap has no batching
    rule for broadcast_tensors)."""
    terms = [t for t in terms if t is not None]
    return functools.reduce(operator.add, terms)


def refuse_forward_mode(op: str) -> None:
    """An op without a forward-mode formula (a backward op): a tangent through it is refused by name."""
    raise NotImplementedError(f"{op}: forward-mode AD through this op (torch.func.jvp, jacfwd, forward_ad; a second "
                              f"derivative through a backward op) is not supported; supported: reverse mode "
                              f"(loss.backward(), torch.func.grad, vjp)")


def dual(spec, run, ops, args):
    """``run(*args)`` (the op ``spec`` describes, or its public wrapper) with its tangent,
    ``spec.tangent(ops, primals, tangents, out)``; None when no tensor argument has a tangent.  ``ops``: the
    namespace the tangent's own ops come from (``torch.ops.tile_ops`` inside the dispatcher, else the wrappers)."""
    split = _split(spec.public_name, *args)
    if split is None:
        return None
    if spec.tangent is None:
        refuse_forward_mode(spec.public_name)
    primals, tangents = split
    out = run(*primals)
    tangent = spec.tangent(ops, primals, tangents, out)
    if isinstance(out, tuple):  # an op of several outputs: a tangent each
        return tuple(fwAD.make_dual(o, t, level=_level()) for o, t in zip(out, tangent))
    return fwAD.make_dual(out, tangent, level=_level())


def register_forward_mode(op, jvp) -> None:
    """Forward mode for the custom op ``op`` called directly: its Autograd kernel (which cannot be registered
    again) is overridden for CPU and CUDA tensors (the per-backend keys win over the alias) by one returning
    ``jvp(*args)`` when an operand has a tangent (``op`` with its tangent, or None), else running the op's
    registered autograd as before.  ``jvp`` runs inside the dispatcher, so torch.func's jvp level sees it as it
    sees a built-in op's formula (its ops on the primals and tangents are the ops themselves, not the wrappers,
    whose autograd.Functions cannot be applied there)."""
    registered = make_autograd_impl(op._opoverload, op)

    def autograd_kernel(keyset, *args):
        if active():
            dual = jvp(*args)
            if dual is not None:
                return dual
        return registered(keyset, *args)

    for key in ("AutogradCPU", "AutogradCUDA"):
        _LIB.impl(op._name, autograd_kernel, key, with_keyset=True)
