"""The eager fast path: a repeated call goes straight to its ready kernel.

A call through ``torch.ops.tile_ops.*`` pays for the Python custom-op machinery
(dispatcher, autograd wrapper, aliasing check: ~16 µs) and then for the checks,
layout decisions and JIT lookup of the CUDA implementation (~38 µs; both on the
CPU of benchmarks/host_overhead_cpu.py), although for a given input signature
every one of them comes out the same.

So the CUDA implementations record a :class:`Plan` per signature (shapes,
strides, dtypes and devices of the operands, and the op's flags): the launcher
of the kernel and the output to allocate.  A plan is recorded only after the
checked path accepted the call and launched the kernel on the caller's own
tensors (no copies), so a later call with the same signature, checked only for
pointer alignment (the one property the signature does not fix), is launched
from the plan.  Both the op's CUDA implementation and the Python wrappers
(``tile_ops.gemm`` ...) look plans up; the wrappers skip the op entirely when
:func:`skips_dispatcher` says it would add nothing.  Anything else (no plan yet,
a misaligned pointer, CPU tensors) goes through the checked path, so every
error message is the checked path's own.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .checks import POINTER_ALIGNMENT

_C = torch._C
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses: DTensor, FakeTensor, ...


class Plan(NamedTuple):
    launch: Callable  # launch(a_ptr, b_ptr, out_ptr[, c_ptr]): the kernel for the recorded signature
    # (a split-K gemm's launch runs its two kernels and allocates their workspace, like the checked path)
    out_shape: tuple  # of ints, not a torch.Size: torch.empty parses ints ~1.5 µs faster
    out_dtype: torch.dtype
    device: torch.device


class PlanCache(dict):
    """Signature key -> :class:`Plan`; cleared when full, so varying shapes cannot grow it forever."""

    MAX_PLANS = 4096

    def record(self, key, plan: Plan) -> None:
        if len(self) >= self.MAX_PLANS:
            self.clear()
        self[key] = plan

    def find(self, make_key: Callable, *args):
        """The plan for ``make_key(*args)``, or None, also for arguments the key cannot take
        (unhashable scalars, tensors without strides): the op reports what is wrong with them."""
        try:
            return self.get(make_key(*args))
        except (TypeError, RuntimeError):
            return None


def plan_key(a: torch.Tensor, b: torch.Tensor, flags: tuple) -> tuple:
    """Everything the checks and the layout decisions read, for operands ``a``, ``b`` and the op's ``flags``."""
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device, flags)


def skips_dispatcher(a, b, c=None) -> bool:
    """True when calling the op on these tensors would add nothing to launching its kernel.

    That needs eager mode (no torch.compile or jit tracing to record the op in a
    graph), no autograd graph to build (grad mode off, or no input requiring
    grad), plain tensors (subclasses such as DTensor or FakeTensor dispatch on
    their own), and no torch function / dispatch modes or functorch transforms
    (vmap, grad) that intercept ops.
    """
    if torch.compiler.is_compiling():  # first: dynamo folds it to True and traces none of the rest
        return False
    if type(a) not in _PLAIN_TENSORS or type(b) not in _PLAIN_TENSORS:
        return False
    if c is not None and type(c) not in _PLAIN_TENSORS:
        return False
    if _C.is_grad_enabled() and (a.requires_grad or b.requires_grad or (c is not None and c.requires_grad)):
        return False
    return not (
        _C._len_torch_dispatch_stack()
        or _C._is_torch_function_mode_enabled()
        or _C._are_functorch_transforms_active()
        or _C._get_tracing_state()
    )


def launch(plan: Plan | None, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None):
    """Allocate the output and launch ``plan`` on inputs ``a``, ``b`` (and ``c``).

    Returns the output, or None when there is no plan or a data pointer is not
    16-byte aligned (the checked path then reports it).
    """
    if plan is None:
        return None
    pa, pb = a.data_ptr(), b.data_ptr()
    pc = 0 if c is None else c.data_ptr()
    if (pa | pb | pc) % POINTER_ALIGNMENT:
        return None
    run, shape, dtype, device = plan
    out = torch.empty(*shape, dtype=dtype, device=device)
    if c is None:
        run(pa, pb, out.data_ptr())
    else:
        run(pa, pb, out.data_ptr(), pc)
    return out


def launched_in_place(kernel_operands, caller_tensors) -> bool:
    """Whether the checked path launched on the caller's own tensors (same data pointers: no copies)."""
    return all(k.data_ptr() == t.data_ptr() for k, t in zip(kernel_operands, caller_tensors))
