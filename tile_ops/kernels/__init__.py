"""The library's kernels, written in tile_ops.lang."""
