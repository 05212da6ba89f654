"""Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) for the ops: the tangent formulas, and
the wrappers' forward mode under ``torch.compile`` (eagerly the ops' autograd Functions use the same formulas,
``functorch.py``).

A ``torch.library.custom_op`` has no forward-mode formula: its result would carry a zero (``func.jvp``) or no
(``forward_ad``) tangent, silently.  So dual operands are taken apart here and the result's tangent is built
from the ops themselves: ``d(a @ b + bias) = da @ b + a @ db + dbias`` and, for ``p = softmax(s * a@b)``,
``dp = p * (dz - sum(p * dz))`` with ``dz = s * (da @ b + a @ db)``: by the wrappers under torch.compile, and by
the ops' own Autograd kernels (``register_forward_mode``) for the ops called directly (exported programs, FX
graphs).  One forward level: nested ones are refused.
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


def _split(op: str, *tensors):
    """(primals, tangents) of ``tensors`` (None passes through), or None when none of them has a tangent."""
    level = _level()
    if level is None:
        return None
    duals = [fwAD.unpack_dual(t, level=level) if isinstance(t, torch.Tensor) else None for t in tensors]
    if all(d is None or d.tangent is None for d in duals):
        return None
    refuse_nested_levels(op)
    return ([t if d is None else d.primal for t, d in zip(tensors, duals)],
            [None if d is None else d.tangent for d in duals])


def _sum(terms):
    """The sum of the terms that are not None, broadcast (with +: vectorized jacobians' vmap has no batching
    rule for broadcast_tensors)."""
    terms = [t for t in terms if t is not None]
    return functools.reduce(operator.add, terms)


def gemm_tangent(gemm, a, b, ta, tb, tbias, out_dtype, y):
    """The tangent of ``y = gemm(a, b, bias, out_dtype)``: ``ta @ b + a @ tb + tbias`` (None: no tangent)."""
    tangent = _sum([gemm(ta, b, None, out_dtype) if ta is not None else None,
                    gemm(a, tb, None, out_dtype) if tb is not None else None,
                    tbias.to(y.dtype) if tbias is not None else None])
    return tangent.expand_as(y).to(y.dtype)


def gemm_softmax_tangent(gemm, a, b, ta, tb, scale, p):
    """The tangent of ``p = gemm_softmax(a, b, scale)``, computed in the scores' precision."""
    wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    dz = scale * _sum([gemm(ta, b, None, wide) if ta is not None else None,
                       gemm(a, tb, None, wide) if tb is not None else None])
    pw = p.to(wide)
    return (pw * (dz - (pw * dz).sum(-1, keepdim=True))).to(p.dtype)


def gemm_jvp(gemm, a, b, bias, out_dtype):
    """``gemm(a, b, bias, out_dtype)`` with its tangent, or None when no operand has one."""
    split = _split("tile_ops.gemm", a, b, bias)
    if split is None:
        return None
    (pa, pb, pbias), (ta, tb, tbias) = split
    y = gemm(pa, pb, pbias, out_dtype)
    return fwAD.make_dual(y, gemm_tangent(gemm, pa, pb, ta, tb, tbias, out_dtype, y), level=_level())


def gemm_softmax_jvp(gemm, gemm_softmax, a, b, scale, out_dtype):
    """``gemm_softmax(a, b, scale, out_dtype)`` with its tangent, or None when neither operand has one."""
    split = _split("tile_ops.gemm_softmax", a, b)
    if split is None:
        return None
    (pa, pb), (ta, tb) = split
    p = gemm_softmax(pa, pb, scale, out_dtype)
    return fwAD.make_dual(p, gemm_softmax_tangent(gemm, pa, pb, ta, tb, scale, p), level=_level())


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
