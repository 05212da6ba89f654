"""Sparse, nested, quantized and MKL-DNN tensors that reach the ops through the dispatcher
(``torch.ops.tile_ops.*``) get the ops' own error, which names the argument and how to make it dense,
instead of the dispatcher's "Could not run 'tile_ops::gemm' with arguments from the 'SparseCPU' backend"
(or, for a jagged nested tensor, a bare ``NotImplementedError: tile_ops.gemm.default``)."""

import torch

from . import checks

# the dispatch keys of the tensors the ops have no kernels for (each op's kernels are dense CPU/CUDA)
NON_DENSE_KEYS = ("SparseCPU", "SparseCUDA", "SparseMeta", "SparseCsrCPU", "SparseCsrCUDA", "SparseCsrMeta",
                  "NestedTensorCPU", "NestedTensorCUDA", "NestedTensorMeta", "QuantizedCPU", "QuantizedCUDA",
                  "MkldnnCPU")
_LIB = torch.library.Library("tile_ops", "IMPL")


def _jagged_class():
    """torch's jagged nested tensor: a Python subclass, which no dispatch key above reaches (None if absent)."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor
    except ImportError:
        return None
    return NestedTensor


def refuse_non_dense(op_name: str, public_name: str) -> None:
    """Register, for ``tile_ops::op_name`` on every key of ``NON_DENSE_KEYS`` and for jagged nested tensors, a
    kernel that checks each tensor argument as the public ``public_name`` does (``checks.check_is_tensor``)."""
    names = [arg.name for arg in getattr(torch.ops.tile_ops, op_name).default._schema.arguments]

    def refuse(*args, **kwargs):
        values = list(args) + [kwargs.get(name) for name in names[len(args):]]
        for name, value in zip(names, values):
            if isinstance(value, torch.Tensor):
                checks.check_is_tensor(public_name, name, value)
        # not reached while every key above belongs to a non-dense tensor: the check has raised
        raise ValueError(f"{public_name}: takes dense (torch.strided) CPU or CUDA tensors only")

    for key in NON_DENSE_KEYS:
        _LIB.impl(op_name, refuse, key)
    if (jagged := _jagged_class()) is not None:
        torch.library.register_torch_dispatch(f"tile_ops::{op_name}", jagged,
                                              lambda cls, func, types, args, kwargs: refuse(*args, **kwargs))
