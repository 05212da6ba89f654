"""The gemm config launched where the autotuner has no entry: the configs fitted on each target's GPUs (data,
one line each on why), and ``default_config``, which chooses among them by how the problem's tiles fill the
waves of the GPU's SMs (the current GPU's, else the count of the GPUs they were fitted on: jit.build_target).
The measurements behind every choice are in git (benchmarks/NOTES.md's history)."""


from dataclasses import replace
from types import SimpleNamespace

from tile_ops.jit import build_target, default_arch

from .gemm_config import GemmConfig, _misfit, _pow2

# sm_90a (TMA + wgmma): fitted on the H100 SXM and the H200, each config timed beside cuBLAS
SM90A = SimpleNamespace(
    # CTAs resident at once by cluster size (the driver's max_active_clusters): not every GPC takes two clusters of 8
    resident_cluster_ctas={1: 132, 2: 132, 4: 120, 8: 120},
    # the biggest tile that makes enough CTAs, fastest first; the TMA-store epilogue won everywhere, 128x256 tiles
    # in raster panels of 4 column tiles by 0-1 % over 8
    tiles=(GemmConfig(128, 256, 64, 3, 256, 4, epilogue="shared"),
           GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared"),
           GemmConfig(128, 64, 64, 6, 128, 8), GemmConfig(64, 64, 64, 8, 128, 8)),
    # one nearly full wave of 128x256 tiles: the output tile lies over the dead stages, so a fourth stage fits
    one_wave_wide=GemmConfig(128, 256, 64, 4, 256, 0, epilogue="shared"),
    # 128x128 tiles over more than a wave: each pair of M tiles multicasts its B tile (one wave of them lost)
    paired_128=GemmConfig(128, 128, 64, 6, 128, 0, epilogue="shared", cluster=2),
    # 128x192 tiles where they fill their last wave and 128x128 or 128x256 ones would leave most of theirs idle
    wide=GemmConfig(128, 192, 64, 4, 256, 8, epilogue="shared"),
    # ... in pairs of M tiles sharing B where they pair up: level or faster
    wide_paired=GemmConfig(128, 192, 64, 4, 256, 0, epilogue="shared", cluster=2),
    # ... or swapped 192 (M) x 128 (N) tiles where those are fewer, one wave, and B's rows not whole 128-byte lines
    wide_swapped=GemmConfig(192, 128, 64, 5, 256, 8, epilogue="shared", swap_ab=True),
    # grids that 128x128 tiles fill at most half of: twice the CTAs in 64-row tiles, pairs sharing their B tile
    half_wave=GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=2),
    # ... in 128-deep k-steps where K is 512-2048: half the k-steps and stage hand-offs (it lost outside)
    half_wave_k128=GemmConfig(64, 128, 128, 4, 128, 8, epilogue="shared", cluster=2),
    # ... unclustered where every operand row is whole 128-byte lines: the L2 serves the shared reads as well
    half_wave_lines=GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared"),
    half_wave_lines_k128=GemmConfig(64, 128, 128, 4, 128, 8, epilogue="shared"),
    # ... else cuBLAS's tiling of such grids, C^T in 72x128 tiles, 2x4 clusters multicasting B and A: fewer L2 reads
    swapped_2x4=GemmConfig(72, 128, 64, 8, 256, 0, epilogue="shared", cluster=2, cluster_n=4, swap_ab=True),
    # decode: 64x64 tiles for 33-64 rows where they make a nearly full wave without splitting K ...
    decode_thin=GemmConfig(64, 64, 128, 6, 128, 0, b_evict_first=True),
    # ... else 64x128 ones; each decode config reads B, every tile once, with L2 evict_first: the L2 keeps the rest
    decode_narrow=GemmConfig(64, 128, 64, 8, 128, 0, b_evict_first=True),
    # ... else 64x256 tiles (512-byte B rows a CTA), K split while the grid stays within a wave
    decode_wide=GemmConfig(64, 256, 64, 4, 128, 0, b_evict_first=True),
)

# every other target (the cp.async + mma.sync path): the best of bench_gemm.py --configs on the H200
SM80 = SimpleNamespace(
    decode=GemmConfig(64, 128, 64, 4, 128, 0),  # up to 64 rows
    small=GemmConfig(128, 128, 64, 3, 256, 8),  # outputs up to 1024x1024: deeper k-steps, more warps
    large=GemmConfig(128, 128, 32, 3, 128, 8),
)


def default_config(M: int, N: int, K: int, arch: str | None = None, batch: int = 1,
                   trans_A: bool = False) -> GemmConfig:
    """Heuristic until the autotuner has a table entry: big tiles for big problems, small M for decode;
    ``batch`` multiplies the tiles where waves are counted (short-grid pairs, 128x192 tiles, 128x128 pairs,
    decode tiles); ``trans_A``: A stored M-contiguous, which the swapped 72-row short-grid tiles cannot read."""
    if (arch or default_arch()) != "sm_90a":
        return SM80.decode if M <= 64 else SM80.small if M * N <= 1024 * 1024 else SM80.large
    sms = build_target("sm_90a").sms  # TMA + wgmma, warp-specialized
    if M <= 64:  # decode: bandwidth-bound
        return _decode_config(M, N, K, batch, sms)
    if 0.9 * sms <= batch * -(-M // 128) * -(-N // 256) <= sms:
        return SM90A.one_wave_wide
    for cfg, min_tiles in zip(SM90A.tiles, (192, 48, 100)):  # the biggest tile that fills the GPU
        if -(-M // cfg.block_M) * -(-N // cfg.block_N) >= min_tiles:
            if cfg.block_N == 128 and (short := _half_wave_config(M, N, K, batch, sms, trans_A)):
                return short
            if cfg.block_N >= 128 and _waves(M, N, 192, batch, sms) <= 0.8 * _waves(M, N, cfg.block_N, batch, sms):
                return _wide_config(M, N, batch, sms)
            return SM90A.paired_128 if cfg.block_N == 128 and _paired_waves(M, N, batch, sms) else cfg
    return SM90A.tiles[-1]


def _half_wave_config(M: int, N: int, K: int, batch: int, sms: int, trans_A: bool) -> GemmConfig | None:
    """One wave of 64x128 tiles (at most one per SM), or None: 128-deep k-steps where K is 512-2048; unclustered
    where rows are whole lines; else cuBLAS's swapped 72x128 tiles in 2x4 clusters where they make a nearly
    full wave of resident clusters (K >= 512, A stored K-contiguous), else in pairs, which need an even count
    of M tiles (TMA loads every row: build_gemm pads rows that are not 16-byte)."""
    m_tiles = -(-M // 64)
    if batch * m_tiles * -(-N // 128) > sms:
        return None
    deep = 512 <= K <= 2048
    if M % 64 == 0 and N % 64 == 0 and K % 64 == 0:
        return SM90A.half_wave_lines_k128 if deep else SM90A.half_wave_lines
    if K >= 512 and not trans_A and _fills_wave(SM90A.swapped_2x4, M, N, batch, sms):
        return SM90A.swapped_2x4
    if m_tiles % 2:
        return None
    return SM90A.half_wave_k128 if deep else SM90A.half_wave


def _fills_wave(cfg: GemmConfig, M: int, N: int, batch: int, sms: int) -> bool:
    """``cfg``'s clusters divide the tile grid, and its CTAs make 3/4 of a wave to one that is resident at once."""
    m_tiles, n_tiles = -(-M // cfg.block_M), -(-N // cfg.block_N)
    resident = min(sms, SM90A.resident_cluster_ctas.get(cfg.cluster * cfg.cluster_n, sms))
    return not _misfit(cfg, M, N) and 0.75 * sms <= batch * m_tiles * n_tiles <= resident


def _paired_waves(M: int, N: int, batch: int, sms: int) -> bool:
    """More 128x128 tiles than SMs, in pairs of M tiles."""
    m_tiles = -(-M // 128)
    return batch * m_tiles * -(-N // 128) > sms and m_tiles % 2 == 0


def _wide_config(M: int, N: int, batch: int, sms: int) -> GemmConfig:
    """The 192-wide tiles' config: swapped where that pays, else 128x192, in pairs of M tiles where their count
    is even."""
    swapped = batch * -(-M // 192) * -(-N // 128)
    if N % 64 and swapped < batch * -(-M // 128) * -(-N // 192) and swapped <= sms:  # (2-byte elements)
        return SM90A.wide_swapped
    return SM90A.wide_paired if -(-M // 128) % 2 == 0 else SM90A.wide


def _waves(M: int, N: int, block_N: int, batch: int, sms: int) -> float:
    """The time of 128 x block_N tiles, one per SM, in 128x128 tile-times: whole waves (a partly idle last
    one takes as long as a full one) times the tile's width."""
    return -(-batch * -(-M // 128) * -(-N // block_N) // sms) * block_N / 128


def _decode_config(M: int, N: int, K: int, batch: int, sms: int) -> GemmConfig:
    """Decode on sm_90a.  Up to 32 rows over >= 64 tiles of 64 columns: C^T = B^T A^T in one kernel
    (``swap_ab``: 64 columns of N per CTA along wgmma's m, M along its n, 16 stages where one CTA an SM
    holds them all, else 8 for two an SM).  Else 64x64 tiles for 33-64 rows, or 64x128 ones, where they
    make a nearly full wave (``batch`` times the N tiles); else 64x256 tiles, K split while the grid stays
    within a wave: a split's fp32 partials cost a second kernel and, with 64 rows, 4 x 64 x N x 4 bytes each
    way."""
    def tiles(block_N: int) -> int:
        return batch * -(-N // block_N)

    if M <= 32 and tiles(64) >= 64:
        return GemmConfig(max(16, _pow2(M)), 64, 64, 16 if tiles(64) <= sms else 8, 128, 0, swap_ab=True,
                          b_evict_first=True)
    if M > 32 and 100 <= tiles(64) <= sms:
        return SM90A.decode_thin
    if 100 <= tiles(128) <= sms:  # (then 64x256 tiles are 50-66: split in 2)
        return SM90A.decode_narrow
    return replace(SM90A.decode_wide, split_k=_decode_split(tiles(256), K // 64, sms))


def _decode_split(tiles: int, k_steps: int, sms: int) -> int:
    """Split K in 2 or 4 while the split grid still fits one wave of SMs and each split keeps >= 8 k-steps
    (16x8192x8192: 32 tiles x 4 = 128 CTAs)."""
    split = 1
    while split < 4 and tiles * split * 2 <= sms and k_steps >= 16 * split:
        split *= 2
    return split
