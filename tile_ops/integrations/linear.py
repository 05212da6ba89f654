"""``tile_ops.nn.Linear``: a drop-in replacement for ``torch.nn.Linear`` running on ``tile_ops.gemm``."""

import torch
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
        """
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(
                f"tile_ops.nn.Linear.from_linear: expected a torch.nn.Linear, got {type(module).__name__}"
            )
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


def convert_linears(module: torch.nn.Module, copy: bool = False) -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` inside ``module`` by a ``tile_ops.nn.Linear`` (in place).

    Returns ``module`` (or the converted module when ``module`` itself is a
    ``torch.nn.Linear``).  Parameters are shared unless ``copy=True``.
    """
    if isinstance(module, Linear):  # already converted (and itself a torch.nn.Linear)
        return module
    if isinstance(module, torch.nn.Linear):
        return Linear.from_linear(module, copy=copy)
    for name, child in module.named_children():
        converted = convert_linears(child, copy=copy)
        if converted is not child:
            setattr(module, name, converted)
    return module
