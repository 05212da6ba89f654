"""The tile_ops operator library: ``torch.ops.tile_ops.*`` custom ops.

Importing this package registers, under the ``tile_ops`` namespace, each op's
schema, CUDA implementation (JIT kernels from ``tile_ops.kernels``, imported on
first CUDA call), CPU reference implementation, fake (meta) implementation for
``torch.compile``, autograd formula, and its own error for sparse, nested, quantized and MKL-DNN
tensors.

    tile_ops.gemm(a, b, bias=None, out_dtype=None)          torch.ops.tile_ops.gemm
    tile_ops.gemm_softmax(a, b, scale=1.0, out_dtype=None)  torch.ops.tile_ops.gemm_softmax
"""

from . import sharding
from .gemm import gemm
from .gemm_softmax import gemm_softmax

sharding.register_if_in_use()  # DTensor already loaded: its sharding rules for the ops, now

__all__ = ["gemm", "gemm_softmax"]
