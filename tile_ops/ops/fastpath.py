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
"""

from __future__ import annotations

import torch

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
