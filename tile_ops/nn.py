"""``tile_ops.nn``: drop-in ``torch.nn`` modules backed by tile_ops kernels."""

from .integrations.linear import Linear

__all__ = ["Linear"]
