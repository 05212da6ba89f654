"""The eager fast path: a repeated call goes straight to its ready kernels, from C++.

A call through ``torch.ops.tile_ops.*`` pays for the Python custom-op machinery
(dispatcher, autograd wrapper, aliasing check) and then for the checks, layout
decisions and JIT lookup of the CUDA implementation, although for a given input
signature every one of them comes out the same.

So the CUDA implementations record a *plan* per signature (the op, the shapes,
strides, dtypes and devices of its tensor operands, and its scalar flags) in
the launcher extension (csrc/plans.cpp): the outputs to allocate, any scratch
buffers, and the kernel launches with their arguments (pointers, TMA
descriptors).  A plan is recorded only after the checked path accepted the call
and launched the kernels on the caller's own tensors (no copies), so a later
call with the same signature, checked only for pointer alignment (the one
property the signature does not fix), is served by :data:`call` in one C++
call: the dispatcher checks, the lookup, the allocation and the driver
launches.  Both the op's CUDA implementation and its Python wrapper
(``tile_ops.gemm`` ...) call it; the wrapper's call also checks that skipping
the dispatcher adds nothing (eager, no autograd graph, plain tensors, no modes
or transforms).  Anything else (no plan yet, a misaligned pointer, CPU tensors)
returns None and goes through the checked path, so every error message is the
checked path's own.

A plan's buffers, which its kernel arguments name by index: the op's tensor
operands in the order of its signature (``OpSpec.signature``), then its
outputs, then its scratch buffers.

A *family* (:func:`record_family`) is one plan for a range of a runtime size m
(a token count): its tensors' sizes and strides, its outputs, grids and kernel
arguments are expressions of m (``compiler.meta.PlanExpr``), so a call with an
unseen m is served from C++ as well, without compiling or planning anything.
"""

from __future__ import annotations

import torch

from ..compiler.meta import PlanExpr

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses: DTensor, FakeTensor, ...


def _no_plans(op, tensors, flags, check_dispatch):
    return None


# call(op, tensors, flags, check_dispatch) -> the result of the signature's plan, launched, or None.  op: the
# op's ``OpSpec.plan_id``; tensors, flags: its ``OpSpec.signature``; check_dispatch: also return None when the
# dispatcher would add something (the wrappers' call).  The extension's plans_call once a plan exists, so
# processes that never record one never load it.
call = _no_plans


def record(op: int, tensors: tuple, flags: tuple, outputs, program) -> None:
    """Record ``program`` as the plan of this call's signature; ``outputs`` are the tensors the checked path
    returned (the plan allocates their like).

    ``program`` is ``(scratch, steps)`` from the kernels (``Kernel.plan``) or a callable ``launch(*pointers)``
    for a launch that runs host code.
    """
    global call
    from ..jit.launcher import get_launcher

    lib = get_launcher()
    if call is _no_plans:
        lib.plans_configure(_PLAIN_TENSORS, getattr(torch._C, "_cuda_getCurrentRawStream", None))
    lib.plans_record(op, tensors, flags, [(list(out.shape), out.dtype) for out in outputs], program)
    call = lib.plans_call


def clear() -> None:
    """Forget every plan (the next call of each signature takes the checked path and records anew)."""
    if call is not _no_plans:
        from ..jit.launcher import get_launcher

        get_launcher().plans_clear()


def count() -> int:
    """How many signatures have a plan."""
    if call is _no_plans:
        return 0
    from ..jit.launcher import get_launcher

    return get_launcher().plans_size()


def launched_in_place(kernel_operands, caller_tensors) -> bool:
    """Whether the checked path launched on the caller's own tensors (same data pointers: no copies)."""
    return all(k.data_ptr() == t.data_ptr() for k, t in zip(kernel_operands, caller_tensors))


def record_family(op: int, tensors: tuple, flags: tuple, var: tuple, ranges, outputs, program) -> bool:
    """Record ``program`` as the plan of every call like this one at each m in ``ranges`` [(lo, hi)], m being
    tensor ``var[0]``'s dim ``var[1]``.  The tensors must be dense (``dense_layout``): their sizes and strides
    then are expressions of m.  ``outputs``: [(shape, dtype)]; ``program`` as for :func:`record`; in both, an
    integer that depends on m is a ``PlanExpr``.  False when a tensor is not dense."""
    global call
    t, d = var
    if not (0 <= t < len(tensors) and tensors[t] is not None and 0 <= d < tensors[t].dim()):
        raise ValueError(f"tile_ops: plans: a family's var is (tensor, dim) of one of its tensors, got {var}")
    layouts = [None if x is None else dense_layout(x, d if i == t else None) for i, x in enumerate(tensors)]
    if any(t is not None and lay is None for t, lay in zip(tensors, layouts)):
        return False
    from ..jit.launcher import get_launcher

    lib = get_launcher()
    if call is _no_plans:
        lib.plans_configure(_PLAIN_TENSORS, getattr(torch._C, "_cuda_getCurrentRawStream", None))
    sizes = [None if lay is None else _codes(lay[0]) for lay in layouts]
    strides = [None if lay is None else _codes(lay[1]) for lay in layouts]
    recorded = lib.plans_record_family(op, tensors, flags, var, sizes, strides, list(ranges),
                                       _codes([(list(shape), dtype) for shape, dtype in outputs]), _codes(program))
    call = lib.plans_call
    return recorded


def record_row_family(op: int, signature: tuple, a, out, dims: tuple, program_at, ranges_at) -> None:
    """The family of an op call whose token count m is the rows of its first tensor ``a`` and of its output
    ``out``, and whose kernels take M at run time (``dims``, their sizes at this call; () where they take
    none): ``program_at((M,))`` is its plan program with M a PlanExpr, ``ranges_at(fold)`` the runs of m that
    launch the same kernels, M being ``fold`` * m (a batch of rows run as one problem).  Nothing when a family
    already takes the call, or its program is host code."""
    m0 = a.shape[-2]
    if not dims or m0 < 2 or dims[0] % m0 or in_family(op, *signature):
        return
    fold, m = dims[0] // m0, PlanExpr.m()
    program = program_at((m * fold,))
    if callable(program):  # host code (stream-K's workspace per stream): per m
        return
    record_family(op, *signature, (0, a.dim() - 2), ranges_at(fold), [([*out.shape[:-2], m, out.shape[-1]], out.dtype)],
                  program)


def in_family(op: int, tensors: tuple, flags: tuple) -> bool:
    """Whether a recorded family takes this call (then there is nothing to record for it)."""
    if call is _no_plans:
        return False
    from ..jit.launcher import get_launcher

    return get_launcher().plans_in_family(op, tensors, flags)


def dense_layout(t: torch.Tensor, var_dim: int | None):
    """(sizes, strides) of ``t`` with m = ``t.shape[var_dim]`` a ``PlanExpr`` (None: no dim is m): a dense
    tensor's strides are the products of the sizes of the dims inside them (in stride order; a broadcast dim's
    is 0, a size-1 dim's whatever it is), m's among them.  None when ``t`` is not laid out that way."""
    m = t.shape[var_dim] if var_dim is not None else 0
    sizes = [PlanExpr.m() if d == var_dim else n for d, n in enumerate(t.shape)]
    strides, inner = list(t.stride()), 1
    for d in sorted((d for d in range(t.dim()) if t.stride(d) != 0), key=lambda d: (t.stride(d), t.shape[d])):
        if t.shape[d] == 1 and d != var_dim:
            continue
        if t.stride(d) != (inner.value(m) if isinstance(inner, PlanExpr) else inner):
            return None
        strides[d], inner = inner, inner * sizes[d]
    return sizes, strides


def _codes(x):
    """``x`` with each PlanExpr in it as its code (a tuple of ints: what the extension reads)."""
    if isinstance(x, PlanExpr):
        return x.code
    if isinstance(x, dict):
        return {k: _codes(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_codes(v) for v in x)
    return x
