"""``tile_ops.nn.Linear``: a drop-in replacement for ``torch.nn.Linear`` running on ``tile_ops.gemm``."""

import sys
import warnings
from copy import deepcopy

import torch
import torch.nn.utils.parametrize
from torch.nn import Parameter

from ..ops import gemm


class Linear(torch.nn.Linear):
    r"""A :class:`torch.nn.Linear` whose forward, ``y = x @ weight^T + bias``, runs on ``tile_ops.gemm``.

    A subclass of ``torch.nn.Linear``: same constructor, parameters (``weight``
    of shape ``(out_features, in_features)``, ``bias`` of shape
    ``(out_features,)`` or None), initialization and ``state_dict`` keys, and
    accepted wherever an ``nn.Linear`` is expected (e.g. torch's tensor-parallel
    ``ColwiseParallel`` / ``RowwiseParallel``).  :meth:`from_linear` converts a
    module, sharing its parameters.

    The input ``(*, in_features)`` is flattened to 2-D (a view when its layout
    allows), multiplied by ``weight.t()`` (a transposed view read through the
    kernel's transpose flag, never copied) with the bias added in the kernel's
    epilogue, and reshaped to ``(*, out_features)``.  Forward and backward run
    through ``tile_ops.gemm``: on CUDA the parameters and input must be float16
    or bfloat16 (all the same dtype); on CPU the reference path also takes
    float32 and float64.

    Example::

        >>> m = tile_ops.nn.Linear(20, 30)
        >>> m(torch.randn(128, 20)).shape
        torch.Size([128, 30])
        >>> fast = tile_ops.nn.Linear.from_linear(torch.nn.Linear(20, 30))
    """

    @classmethod
    def from_linear(cls, module: torch.nn.Linear, copy: bool = False) -> "Linear":
        """A ``tile_ops.nn.Linear`` computing the same function as ``module``.

        By default the new module shares ``module``'s ``weight`` and ``bias``
        Parameter objects (training either trains both); with ``copy=True`` it
        gets its own copies.

        The new module is not compiled: if ``module`` was (``module.compile()``),
        a warning says so; call ``.compile()`` on the new module (or the model)
        again.  Its compiled forward is the original's, on the original's
        parameters, so it is never carried over.  For a ``torch.compile(module)``
        wrapper, convert the wrapper with :func:`convert_linears`, which keeps it
        compiled with the same options.
        """
        if not isinstance(module, torch.nn.Linear):
            hint = (" (a torch.compile wrapper: convert it with tile_ops.nn.convert_linears, which keeps it compiled)"
                    if _is_compile_wrapper(module) else "")
            raise TypeError(
                f"tile_ops.nn.Linear.from_linear: expected a torch.nn.Linear, got {type(module).__name__}{hint}"
            )
        why = _not_plain(module)
        if why:
            raise TypeError(f"tile_ops.nn.Linear.from_linear: {type(module).__name__} {why}; a converted module would "
                            f"compute x @ weight^T + bias without it (accepted: a torch.nn.Linear without hooks, "
                            f"parametrizations, buffers, submodules or a forward of its own, with initialized "
                            f"parameters)")
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)  # not Linear.__init__: it would allocate and initialize new parameters
        new.in_features = module.in_features
        new.out_features = module.out_features
        weight, bias = module.weight, module.bias
        if copy:
            weight = Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            if bias is not None:
                bias = Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        new.weight = weight
        if bias is not None:
            new.bias = bias
        else:
            new.register_parameter("bias", None)
        new.train(module.training)
        for name, value in vars(module).items():  # plain attributes set on the instance (HF's _is_hf_initialized)
            if name != "_compiled_call_impl":
                vars(new).setdefault(name, value)
        if module._compiled_call_impl is not None:
            warnings.warn(f"tile_ops.nn.Linear.from_linear: the {type(module).__name__} was compiled "
                          f"(module.compile()) and the converted module is not: call .compile() on it, or on the "
                          f"model, again", stacklevel=2)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"tile_ops.nn.Linear: expected an input of shape (*, in_features) with "
                f"in_features={self.in_features}, got shape {tuple(input.shape)}"
            )
        lead = input.shape[:-1]
        x2 = input.unsqueeze(0) if input.dim() == 1 else input.flatten(0, -2)
        y = gemm(x2, self.weight.t(), self.bias)
        return y.view(*lead, self.out_features)


def _not_plain(module: torch.nn.Linear) -> str | None:
    """Why ``module`` does more than ``x @ weight^T + bias`` (so converting it would change what it computes),
    or None."""
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in (module.weight, module.bias)):
        return "is not initialized yet (a lazy module before its first call)"
    if type(module).forward is not torch.nn.Linear.forward or "forward" in vars(module):
        return "has a forward of its own"  # the instance's too: accelerate's hooks wrap forward that way
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "has parametrizations (e.g. weight_norm)"  # before hooks: weight_norm adds a load_state_dict hook
    if any((module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
            module._state_dict_hooks, module._state_dict_pre_hooks, module._load_state_dict_pre_hooks,
            module._load_state_dict_post_hooks)):  # the state_dict ones change what checkpoints hold or load
        return "has hooks"
    if module._buffers or module._modules:  # from_linear keeps only weight and bias: its state_dict would lose them
        return "has buffers or submodules of its own"
    return None


def _is_compile_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile(module)`` wrapper (dynamo is loaded once one exists: not imported
    here, which would take a second)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def convert_linears(module: torch.nn.Module, copy: bool = False) -> torch.nn.Module:
    """Replace every plain ``torch.nn.Linear`` inside ``module`` by a ``tile_ops.nn.Linear`` (in place).

    Returns ``module`` (or the converted module when ``module`` itself is a
    ``torch.nn.Linear``).  Parameters are shared unless ``copy=True`` (then
    Linears that shared a parameter share its copy; a Linear used twice stays
    one module either way).  A Linear that does more than ``x @ weight^T + bias`` (its own forward, on
    a subclass or the instance, hooks, parametrizations, buffers or
    submodules, a lazy module not yet initialized) is left as it is, with a
    warning naming it.

    A ``torch.compile(linear)`` wrapper is kept, running the converted Linear
    with the same compile options; a Linear compiled in place
    (``linear.compile()``) is replaced by one that is not compiled, with a
    warning (see :meth:`Linear.from_linear`).
    """
    skipped = []
    converted = _convert(module, "", copy, skipped, {}, {})
    if skipped:
        warnings.warn("tile_ops.convert_linears: left as they are, converting them would change what they "
                      "compute: " + "; ".join(skipped))
    return converted


def _convert(module: torch.nn.Module, name: str, copy: bool, skipped: list, done: dict,
             copies: dict) -> torch.nn.Module:
    """``done`` maps a module already seen to what replaced it, so a module used twice stays one module;
    ``copies`` is deepcopy's memo, so Linears that shared a parameter share its copy."""
    if id(module) not in done:
        done[id(module)] = _convert_one(module, name, copy, skipped, done, copies)
    return done[id(module)]


def _convert_one(module, name, copy, skipped, done, copies):
    if isinstance(module, Linear):  # already converted (and itself a torch.nn.Linear)
        return module
    if isinstance(module, torch.nn.Linear):
        why = _not_plain(module)
        if why:
            skipped.append(f"{name or 'the module'} ({type(module).__name__}) {why}")
            return module
        return Linear.from_linear(deepcopy(module, copies) if copy else module)
    for child_name, child in module._modules.items():  # not named_children(): it skips a repeated module
        if child is None:
            continue
        converted = _convert(child, f"{name}.{child_name}" if name else child_name, copy, skipped, done, copies)
        if converted is not child:
            setattr(module, child_name, converted)
            if _is_compile_wrapper(module):  # its forward is bound to the old module's __call__
                module._initialize()
    return module
