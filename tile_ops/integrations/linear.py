"""``tile_ops.nn.Linear``: a drop-in replacement for ``torch.nn.Linear`` running on ``tile_ops.gemm``."""

import math

import torch
from torch.nn import Parameter, init

from .. import ops as _ops  # noqa: F401  (registers torch.ops.tile_ops.gemm)


class Linear(torch.nn.Module):
    r"""Applies ``y = x @ weight^T + bias`` with ``tile_ops.gemm``.

    Same constructor, parameters (``weight`` of shape ``(out_features,
    in_features)``, ``bias`` of shape ``(out_features,)`` or None),
    initialization and ``state_dict`` keys as :class:`torch.nn.Linear`, so
    state dicts load either way and :meth:`from_linear` converts a module in
    place of its parameters.

    The input ``(*, in_features)`` is flattened to 2-D (a view when its layout
    allows), multiplied by ``weight.t()`` (a transposed view read through the
    kernel's transpose flag, never copied) with the bias added in the kernel's
    epilogue, and reshaped to ``(*, out_features)``.  Forward and backward run
    through ``torch.ops.tile_ops.gemm``: on CUDA the parameters and input must
    be float16 or bfloat16 (all the same dtype); on CPU the reference path
    also takes float32 and float64.

    Example::

        >>> m = tile_ops.nn.Linear(20, 30)
        >>> m(torch.randn(128, 20)).shape
        torch.Size([128, 30])
        >>> fast = tile_ops.nn.Linear.from_linear(torch.nn.Linear(20, 30))
    """

    __constants__ = ["in_features", "out_features"]
    in_features: int
    out_features: int
    weight: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(torch.empty((out_features, in_features), **factory_kwargs))
        if bias:
            self.bias = Parameter(torch.empty(out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Same initialization as ``torch.nn.Linear.reset_parameters``."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, module: torch.nn.Linear, copy: bool = False) -> "Linear":
        """A ``tile_ops.nn.Linear`` computing the same function as ``module``.

        By default the new module shares ``module``'s ``weight`` and ``bias``
        Parameter objects (training either trains both); with ``copy=True`` it
        gets its own copies.
        """
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(
                f"tile_ops.nn.Linear.from_linear: expected a torch.nn.Linear, got {type(module).__name__}"
            )
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
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
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"tile_ops.nn.Linear: expected an input of shape (*, in_features) with "
                f"in_features={self.in_features}, got shape {tuple(input.shape)}"
            )
        lead = input.shape[:-1]
        x2 = input.unsqueeze(0) if input.dim() == 1 else input.flatten(0, -2)
        y = torch.ops.tile_ops.gemm(x2, self.weight.t(), self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def convert_linears(module: torch.nn.Module, copy: bool = False) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` inside ``module`` by a ``tile_ops.nn.Linear`` (in place).

    Returns ``module`` (or the converted module when ``module`` itself is a
    ``torch.nn.Linear``).  Parameters are shared unless ``copy=True``.
    """
    if isinstance(module, torch.nn.Linear):
        return Linear.from_linear(module, copy=copy)
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Linear.from_linear(child, copy=copy))
        else:
            convert_linears(child, copy=copy)
    return module
