"""``tile_ops.nn``: drop-in ``torch.nn`` modules backed by tile_ops kernels."""

from .integrations.linear import Linear, convert_linears

__all__ = ["Linear", "convert_linears"]
