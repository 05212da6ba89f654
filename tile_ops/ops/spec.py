"""One ``OpSpec`` per library op, declared in its module (ops/<name>.py), and the registry of them.

``register(spec)`` makes the op what every generic part of the library iterates over: the
``torch.library`` custom op ``tile_ops::<name>`` (CPU reference, CUDA implementation behind the fast
path, fake, autograd, forward mode, batching rule, the dense-only refusal), the eager
``autograd.Function`` torch.func runs, the plan id of the fast path (fastpath.py), DTensor sharding
(sharding.py), and the autotuner's and the command line's target (tile_ops.autotune.targets).
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..autotune import targets
from . import dense_only, fastpath, forward_ad, functorch, record


@dataclass
class OpSpec:
    """One library op as its module declares it: the functions below are op-specific code (formulas, rules,
    layouts), which the generic modules call without naming the op.  An op without a derivative (a backward op)
    leaves ``setup_context``, ``backward``, ``saved`` and ``jvp`` None, one without a forward-mode formula
    ``tangent``: ``register`` fills them with refusals, so differentiating through it fails by name.  ``tuning`` is
    None for an op the autotuner and the command line do not drive on their own (a backward op: its forward's
    target precompiles its kernels)."""

    name: str  # the op is torch.ops.tile_ops.<name>; its public wrapper tile_ops.<name>
    schema: str  # the torch.library schema: "(Tensor a, ...) -> Tensor"
    reference: Callable  # the CPU implementation, in plain torch
    fake: Callable  # shapes and dtypes only (torch.compile)
    launch: Callable  # the checked CUDA path: checks, lays out, launches and records the call's plan
    signature: Callable  # (*args) -> (tensors, flags): what a call's plan is keyed on, its plan buffers first
    vmap: Callable  # the batching rule, as register_vmap takes it
    setup_context: Optional[Callable] = None  # autograd, as register_autograd takes it
    backward: Optional[Callable] = None
    saved: Optional[Callable] = None  # (inputs, output) -> what the eager autograd.Function saves, in backward's order
    jvp: Optional[Callable] = None  # (ctx, *tangents): the eager autograd.Function's forward mode, from what it saved
    tangent: Optional[Callable] = None  # (ops, args, tangents, out) -> out's tangent (forward_ad.dual)
    tuning: Optional[targets.Target] = None  # the kernel as the autotuner and the command line drive it
    sharding: Optional[Callable] = None  # DTensor strategies (register_sharding), where tensor parallelism runs it
    problem: Optional[Callable] = None  # (*args) -> the kernel problems a call launches (JSON-able dicts: record.py)
    # made by register():
    op: object = field(init=False, default=None)  # the torch.library custom op
    cuda: Callable = field(init=False, default=None)  # its CUDA implementation: the plan, else ``launch``
    function: type = field(init=False, default=None)  # the autograd.Function the wrapper applies under torch.func
    plan_id: int = field(init=False, default=-1)

    @property
    def public_name(self) -> str:
        """The name the op's errors go by."""
        return f"tile_ops.{self.name}"


SPECS: dict[str, OpSpec] = {}  # by name, in registration order


def register(spec: OpSpec) -> OpSpec:
    """Make ``spec``'s op (module docstring); returns ``spec``, its ``op``, ``cuda``, ``function`` and ``plan_id``
    filled in."""
    spec.plan_id = len(SPECS)
    spec.op = op = torch.library.custom_op(f"tile_ops::{spec.name}", _recorded(spec), mutates_args=(),
                                           device_types="cpu", schema=spec.schema)
    spec.cuda = _cuda(spec)
    op.register_kernel("cuda", spec.cuda)
    op.register_fake(spec.fake)
    if spec.backward is None:
        spec.setup_context, spec.backward, spec.saved = (lambda ctx, inputs, output: None), _refused(spec), \
            (lambda inputs, output: ())
    spec.jvp = spec.jvp or _refused(spec, forward_mode=True)
    op.register_autograd(spec.backward, setup_context=spec.setup_context)
    run, full = getattr(torch.ops.tile_ops, spec.name), with_defaults(spec.reference)
    forward_ad.register_forward_mode(op, lambda *args: forward_ad.dual(spec, run, torch.ops.tile_ops, full(args)))
    op.register_vmap(spec.vmap)
    dense_only.refuse_non_dense(spec.name, spec.public_name)
    spec.function = functorch.autograd_function(spec, op)
    SPECS[spec.name] = spec
    if spec.tuning is not None:
        targets.register(spec.name, spec.tuning)
    return spec


def _refused(spec: OpSpec, forward_mode: bool = False) -> Callable:
    """The backward (or the autograd.Function's jvp) of an op that has none: a derivative through it is refused."""

    def refuse(ctx, *grads):
        if forward_mode:
            forward_ad.refuse_forward_mode(spec.public_name)
        raise NotImplementedError(f"{spec.public_name}: a derivative of this op (a second derivative: double "
                                  f"backward, hessian, jacrev of grad) is not supported; supported: first "
                                  f"derivatives (loss.backward(), torch.func.grad, vjp, jvp)")

    return refuse


def with_defaults(fn: Callable) -> Callable:
    """``full(args)``: ``args`` with the trailing ones the dispatcher leaves out where they equal their defaults
    (those of ``fn``, which has the schema's arguments) filled in."""
    params = list(inspect.signature(fn).parameters.values())
    return lambda args: (*args, *(p.default for p in params[len(args):]))


def _cuda(spec: OpSpec) -> Callable:
    full = with_defaults(spec.reference)

    def cuda(*args):
        out = fastpath.call(spec.plan_id, *spec.signature(*args), False)
        if out is not None:
            return out
        if record.active():
            record.note(spec, full(args))
        return spec.launch(*args)

    return cuda


def _recorded(spec: OpSpec) -> Callable:
    """The CPU implementation, noting the call's kernel problem while recording (a model traced on the CPU
    lists what its CUDA run would launch)."""
    full = with_defaults(spec.reference)

    @functools.wraps(spec.reference)
    def reference(*args):
        if record.active():
            record.note(spec, full(args))
        return spec.reference(*args)

    return reference


# this package, whose attributes are the public wrappers (gemm, gemm_softmax, ...): outside the dispatcher,
# tangents are built from them
WRAPPERS = sys.modules[__package__]


def transformed(spec: OpSpec, wrapper: Callable, args: tuple, eager: bool):
    """What the public ``wrapper`` returns under forward-mode AD or a torch.func transform: eagerly the op's
    autograd.Function (torch.func carries it through every level), under torch.compile the op with its tangent
    (which dynamo traces); None where no transform is active, or no tangent reaches a traced call."""
    if not forward_ad.active():  # neither a forward level nor a torch.func transform
        return None
    if eager:
        forward_ad.refuse_nested_levels(spec.public_name)
        return spec.function.apply(*args)
    functorch.refuse_traced_grad(spec.public_name)
    return forward_ad.dual(spec, wrapper, WRAPPERS, args)
