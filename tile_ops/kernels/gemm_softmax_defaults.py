"""The gemm + softmax config launched where the autotuner has no entry: the configs fitted on each target's GPUs
(data, one line each on why), and ``default_config``, which chooses among them by the row's width.  The
measurements behind every choice are in git (benchmarks/NOTES.md)."""


from dataclasses import replace
from types import SimpleNamespace

import tile_ops.lang as T
from tile_ops.jit import default_arch

from .gemm_softmax_config import SoftmaxConfig, _widest_split

# sm_90a (TMA + wgmma): fitted on the H200 beside torch's softmax(a @ b)
SM90A = SimpleNamespace(
    narrow=SoftmaxConfig(64, 64, 64, 4, 128),  # rows of one 64-wide tile: a block per 64 rows
    # 128x256 tiles, each row in one warp; a wider row goes over the grid (deferred) or a cluster's blocks
    tiles=SoftmaxConfig(128, 256, 64, 3, 256, "full_row"),
    # rows walked in 128-wide tiles from 4 tiles of 256 a block on: half the per-row state a tile, more stages
    long_rows=SoftmaxConfig(128, 128, 64, 4, 256, "full_row"),
    deferred_min_k=512,  # the deferred store's row exchange takes a few µs a tile: a main loop of 8 k-steps hides it
)

# every other target (the cp.async + mma.sync path)
SM80 = SimpleNamespace(
    narrow=SoftmaxConfig(64, 64, threads=128),  # rows of at most 64 columns
    wide=SoftmaxConfig(64, 128, threads=128),
)


def default_config(M: int, N: int, K: int, arch: str | None = None) -> SoftmaxConfig:
    """sm_90a: 128x256 tiles; rows of more than one tile spread over the whole grid, their statistics
    exchanged through global memory (``deferred``: every SM busy, where clusters of 8 fit on 120 of
    132) when TMA can store them and K is long enough to hide the exchange; otherwise a row split over
    a cluster of up to 8 blocks (one tile each up to N = 2048, then short walks; from N = 8192 walks of
    128-wide tiles)."""
    if (arch or default_arch()) != "sm_90a":
        return SM80.narrow if N <= 64 else SM80.wide
    if N <= 64:
        return SM90A.narrow
    tiles = SM90A.tiles
    if tiles.block_N < N <= T.MAX_ROW_TILES * tiles.block_N and N % 8 == 0 and K % 8 == 0 \
            and K >= SM90A.deferred_min_k:
        return replace(tiles, deferred=True)
    if N >= 4 * T.MAX_CLUSTER * tiles.block_N:  # long walks
        tiles = SM90A.long_rows
    return replace(tiles, split=_widest_split(N, tiles))
