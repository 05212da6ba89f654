"""Integrations of the tile_ops op library with other PyTorch code (nn modules, ...)."""

from .linear import Linear

__all__ = ["Linear"]
