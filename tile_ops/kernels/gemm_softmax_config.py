"""The fused gemm + softmax's config: what a ``SoftmaxConfig`` says, how a row's columns are split over a
cluster's blocks, and the shared memory it needs."""


from dataclasses import dataclass, replace

import tile_ops.lang as T
from tile_ops.compiler.targets import smem_limit
from tile_ops.jit import build_target

from .gemm_config import _ESIZE, _kib, check_config_sizes


@dataclass(frozen=True)
class SoftmaxConfig:
    block_M: int = 128
    block_N: int = 128
    block_K: int = 32
    num_stages: int = 3
    threads: int = 256
    policy: str = "square"  # T.gemm warp policy; "full_row" keeps each row in one warp (no cross-warp reduce)
    split: int = 1  # blocks sharing a row block's columns: a thread-block cluster on sm_90a
    persistent: bool = True  # False: a block (cluster) per row block even with more than one wave (sm_90a)
    pingpong: bool = False  # sm_90a, threads=128: two consumer warpgroups per CTA on alternate row blocks
    stream_k: int = 0  # >= 2 (sm_90a, one tile per block): the last wave's row blocks split along K into up to this many parts
    # sm_90a: a row's tiles spread over the grid without a cluster, every tile stored once its row's
    # statistics are in, after the block's next tile (T.row_softmax_store): all SMs, GEMM-like waves
    deferred: bool = False

    def __post_init__(self):
        check_config_sizes(self)
        if not 1 <= self.split <= T.MAX_CLUSTER:
            raise ValueError(f"SoftmaxConfig.split={self.split}: must be in [1, {T.MAX_CLUSTER}] (a cluster's blocks)")
        if self.deferred and (self.split > 1 or self.pingpong or self.stream_k or not self.persistent):
            raise ValueError("SoftmaxConfig.deferred: one tile per block over the whole grid; it takes no split, "
                             "pingpong, stream_k or persistent=False")


def block_columns(N: int, cfg: SoftmaxConfig) -> int:
    """Columns each of a row block's ``split`` blocks owns: its share of N, rounded up to whole tiles."""
    share = -(-N // cfg.split)
    return -(-share // cfg.block_N) * cfg.block_N


def _every_block_has_columns(N: int, cfg: SoftmaxConfig) -> bool:
    return (cfg.split - 1) * block_columns(N, cfg) < N


def _widest_split(N: int, cfg: SoftmaxConfig, most: int = T.MAX_CLUSTER) -> int:
    """The largest cluster (<= ``most`` blocks) over which a row of N columns splits into whole tiles, each
    block getting some: ceil(N / block_N) blocks of one tile when that is <= 8."""
    return max(s for s in range(1, most + 1) if _every_block_has_columns(N, replace(cfg, split=s)))


def _output_tile_fits(smem_bytes: int, cfg, dtype: str, out_dtype: str) -> bool:
    """Whether a kernel whose shared memory ``smem_bytes`` counts its staged (block_M, block_N) output tile in
    ``dtype`` (one per consumer warpgroup with pingpong) still fits with the tile in ``out_dtype``."""
    wider = (_ESIZE[out_dtype] - _ESIZE[dtype]) * cfg.block_M * cfg.block_N * (2 if cfg.pingpong else 1)
    return smem_bytes + max(0, wider) <= smem_limit("sm_90a")


def shared_memory_bytes(cfg: SoftmaxConfig, M: int, N: int, K: int, dtype: str = "float16",
                        one_wave: bool | None = None) -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs: pipelined A and B tiles, the staged
    output tile, with several tiles per block the per-tile running maxima (grow with N) and the final
    max/sum rows, and the cross-warp reduction scratch (none when each row stays in one warp); the
    cluster exchange buffers; with ``pingpong`` all but the pipeline twice (one per consumer warpgroup).
    ``one_wave``: a runtime-M kernel's choice of one tile per CTA (None: as M's row blocks give it)."""
    esize = _ESIZE[dtype]
    tiles = _kib(cfg.num_stages * cfg.block_M * cfg.block_K * esize) + _kib(cfg.num_stages * cfg.block_K * cfg.block_N * esize)
    scratch_cols = 0 if cfg.policy == "full_row" else cfg.threads // 32
    n_tiles = block_columns(N, cfg) // cfg.block_N
    rows = _kib(cfg.block_M * cfg.block_N * esize)
    if cfg.deferred:  # the row factors of two tiles
        rows += _kib(2 * cfg.block_M * 4)
    elif n_tiles > 1:
        rows += _kib(n_tiles * cfg.block_M * 4) + 2 * _kib(cfg.block_M * 4)
    # (max, sum) slots and their mbarriers, two tile parities
    exchange = 2 * _kib(cfg.split * cfg.block_M * 8) + 16 if cfg.split > 1 else 0
    copies = 2 if cfg.pingpong else 1
    if _output_overlaid(cfg, M, N, K, n_tiles, esize, one_wave):
        tiles, rows = max(tiles, rows), 0
    return tiles + copies * (rows + _kib(scratch_cols * cfg.block_M * 4) + exchange) + 16 * cfg.num_stages


def _output_overlaid(cfg: SoftmaxConfig, M: int, N: int, K: int, n_tiles: int, esize: int,
                     one_wave: bool | None = None) -> bool:
    """Whether the sm_90a compiler lays the staged output tile over the dead pipeline stages
    (Lowerer._epilogue_overlay): 16-byte rows of A and B (TMA loads, so a warp-specialized pipeline), a
    block's one tile, no cluster exchange, a grid within a wave unless not persistent."""
    tma_rows = (K * esize) % 16 == 0 and (N * esize) % 16 == 0
    one_tile = not (cfg.deferred or cfg.pingpong or cfg.stream_k) and cfg.split == 1 and n_tiles == 1
    if one_wave is None:
        one_wave = one_wave_of_rows(cfg, M)
    return tma_rows and one_tile and (not cfg.persistent or one_wave)


def one_wave_of_rows(cfg: SoftmaxConfig, M: int) -> bool:
    """Whether M's row blocks make at most one wave of CTAs on the GPU."""
    return 0 < -(-M // cfg.block_M) <= build_target("sm_90a").wave_ctas()

