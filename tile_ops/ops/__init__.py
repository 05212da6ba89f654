"""The tile_ops operator library: ``torch.ops.tile_ops.*`` custom ops.

Each op is one module here, ending in its ``OpSpec`` (spec.py): schema, CPU reference, fake (meta)
implementation for ``torch.compile``, CUDA implementation (JIT kernels from ``tile_ops.kernels``, imported
on the first CUDA call) behind the eager fast path (fastpath.py), autograd, forward mode, batching rule,
DTensor sharding, and its kernel as the autotuner and the command line drive it.  Importing this package
registers them all under the ``tile_ops`` namespace, with the ops' own error for sparse, nested, quantized
and MKL-DNN tensors.  Shared by the ops: checks.py (input checks), matmul.py (the matmul-like ops'
shapes and layouts), forward_ad.py and functorch.py (the transforms' mechanics).

    tile_ops.gemm(a, b, bias=None, out_dtype=None)          torch.ops.tile_ops.gemm
    tile_ops.gemm_softmax(a, b, scale=1.0, out_dtype=None)  torch.ops.tile_ops.gemm_softmax
    tile_ops.flash_attn_func(q, k, v, ...)                   torch.ops.tile_ops.flash_attention
    tile_ops.flash_attn_varlen_func(q, k, v, cu_seqlens_q, ...)  torch.ops.tile_ops.flash_attention_varlen
"""

from . import sharding
from .gemm import gemm
from .gemm_softmax import gemm_softmax
from .attention import flash_attention, flash_attn_func  # noqa: I001 (registration order: the plan ids)
from .attention_varlen import flash_attn_varlen_func

sharding.register_if_in_use()  # DTensor already loaded: its sharding rules for the ops, now

__all__ = ["flash_attention", "flash_attn_func", "flash_attn_varlen_func", "gemm", "gemm_softmax"]
