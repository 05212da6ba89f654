"""GEMM: C[b] = op(A[b]) @ op(B[b]) (+ bias), fp16/bf16 in, fp32 accumulate, any output dtype."""


import contextlib
import dataclasses
from dataclasses import dataclass

import torch

import tile_ops
import tile_ops.lang as T
from tile_ops.jit import default_arch
from tile_ops.autotune import config_for
from tile_ops.compiler.targets import Target, smem_limit

SMS = Target.of("sm_90a").sms  # an H100 SXM / H200 (the heuristics' wave sizes)
wave_ctas = Target.of("sm_90a").wave_ctas


def check_config_sizes(cfg) -> None:
    """A gemm or softmax config's block sizes, stages and threads: at least 1 (0 divides by zero, tiles nothing)."""
    sizes = {f: getattr(cfg, f) for f in ("block_M", "block_N", "block_K", "num_stages", "threads")}
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"{type(cfg).__name__}({', '.join(f'{k}={v}' for k, v in sizes.items())}): block sizes, "
                         f"stages and threads must be at least 1")


@dataclass(frozen=True)
class GemmConfig:
    block_M: int = 128
    block_N: int = 256
    block_K: int = 32
    num_stages: int = 3
    threads: int = 256
    swizzle: int = 8
    policy: str = "square"  # T.gemm warp policy: "square" | "full_row" | "full_col"
    split_k: int = 1  # > 1: K split over this many CTAs per tile, fp32 partials reduced by a second kernel
    epilogue: str = "direct"  # "direct": registers -> global; "shared": through a shared tile (TMA store on sm_90a)
    cluster: int = 1  # > 1 (sm_90a): clusters of neighbouring M tiles of one N tile, B's tile multicast to them
    cluster_n: int = 1  # > 1 (sm_90a): ... and of neighbouring N tiles of one M tile, A's tile multicast to them
    pingpong: bool = False  # sm_90a, threads=128: two consumer warpgroups per CTA on alternate tiles
    stream_k: int = 0  # >= 2 (sm_90a): the last wave's tiles split along K into up to this many parts, in-kernel
    swap_ab: bool = False  # compute C^T = B^T A^T: wgmma's 64-row slices run along N, the few rows of M (decode)
    # along its n (block_M of 16-256), so no tensor work is spent on rows A does not have
    b_evict_first: bool = False  # B's tiles read with L2 priority evict_first: where one M tile reads each once
    # (decode), the weights streaming through leave the L2's other lines (activations, dirty ones too) in place

    def __post_init__(self):
        check_config_sizes(self)
        if self.swizzle < 0:
            raise ValueError(f"GemmConfig.swizzle={self.swizzle}: accepted: swizzle 0 (off) or more grid rows")
        if min(self.cluster, self.cluster_n) < 1 or self.cluster * self.cluster_n > T.MAX_CLUSTER:
            raise ValueError(f"GemmConfig.cluster={self.cluster}, cluster_n={self.cluster_n}: each >= 1, a cluster of "
                             f"at most {T.MAX_CLUSTER} blocks in all")
        if self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k={self.split_k}: must be >= 1")
        if self.stream_k and (self.stream_k < 2 or self.split_k > 1):
            raise ValueError(f"GemmConfig.stream_k={self.stream_k}: must be 0 (off) or >= 2, and not with "
                             f"split_k={self.split_k} (two ways of splitting K)")
        if self.epilogue not in ("direct", "shared"):
            raise ValueError(f"GemmConfig.epilogue={self.epilogue!r}: must be 'direct' or 'shared'")
        if self.swap_ab:
            self._check_swapped()

    def _check_swapped(self):
        wrong = [f"{what} ({why})" for what, bad, why in (
            (f"block_N={self.block_N}", self.block_N % 64 or self.block_N > 256,
             "a multiple of 64 up to 256: one consumer warpgroup per 64 columns, a TMA box of B's rows"),
            (f"block_M={self.block_M}", self.block_M % 8 or not 16 <= self.block_M <= 256,
             "a multiple of 8 from 16 to 256: wgmma's n, and of 16 where A is stored transposed"),
            (f"threads={self.threads}", self.threads != 2 * self.block_N, "2 * block_N"))
            if bad]
        wrong += [f"{name}={value!r} (the swapped kernel takes only {default!r})"
                  for name, value, default in (("split_k", self.split_k, 1), ("stream_k", self.stream_k, 0),
                                               ("pingpong", self.pingpong, False),
                                               ("policy", self.policy, "square"))
                  if value != default]
        if wrong:
            raise ValueError(f"GemmConfig(swap_ab=True): {'; '.join(wrong)}")


# Fastest first (bench_gemm.py --configs on the H200, NOTES.md v3): the TMA-store epilogue wins everywhere;
# 128x256 tiles rasterized in panels of 4 column tiles: +0-1 % over 8, sustained at the 700 W cap (NOTES v14)
_HOPPER_TILES = [GemmConfig(128, 256, 64, 3, 256, 4, epilogue="shared"),
                 GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared"),
                 GemmConfig(128, 64, 64, 6, 128, 8), GemmConfig(64, 64, 64, 8, 128, 8)]


def default_config(M: int, N: int, K: int, arch: str | None = None, batch: int = 1,
                   trans_A: bool = False) -> GemmConfig:
    """Heuristic until the autotuner has a table entry: big tiles for big problems, small M for decode;
    ``batch`` multiplies the tiles where waves are counted (short-grid pairs, 128x192 tiles, 128x128 pairs,
    decode tiles); ``trans_A``: A stored M-contiguous, which the swapped 72-row short-grid tiles cannot read."""
    if (arch or default_arch()) == "sm_90a":  # TMA + wgmma, warp-specialized
        if M <= 64:  # decode: bandwidth-bound
            return _decode_config(M, N, K, batch)
        if 0.9 * SMS <= batch * -(-M // 128) * -(-N // 256) <= SMS:
            return _ONE_WAVE_WIDE
        for cfg, min_tiles in zip(_HOPPER_TILES, (192, 48, 100)):  # the biggest tile that fills the GPU
            if -(-M // cfg.block_M) * -(-N // cfg.block_N) >= min_tiles:
                if cfg.block_N == 128 and (short := _half_wave_config(M, N, K, batch, trans_A=trans_A)):
                    return short
                if cfg.block_N >= 128 and _waves(M, N, 192, batch) <= 0.8 * _waves(M, N, cfg.block_N, batch):
                    return _wide_config(M, N, batch)
                return _PAIRED_128 if cfg.block_N == 128 and _paired_waves(M, N, batch) else cfg
        return _HOPPER_TILES[-1]
    if M <= 64:
        return GemmConfig(64, 128, 64, 4, 128, 0)
    if M * N <= 1024 * 1024:
        return GemmConfig(128, 128, 64, 3, 256, 8)
    return GemmConfig(128, 128, 32, 3, 128, 8)  # best of bench_gemm.py --configs on the H200 (NOTES.md)


# 128x128 tiles that fill at most half the SMs (1000^3: 64): twice the CTAs in 64-row tiles, each pair of M
# tiles a cluster that multicasts their shared 16 KiB B tile; 8 stages won 4 of the 5 short grids measured
# by 10-23 % over 6 stages, and lost 1000^3 by 6 % (NOTES v9)
_HALF_WAVE = GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=2)
# ... in 128-deep k-steps (4 stages, the same shared memory) where K is 512-2048: half the k-steps and stage
# hand-offs; on the H200, 8 processes each beside cuBLAS, medians 0.88 -> 0.96 at 1000^3 and 0.86 -> 0.94 at
# 1000x1000x2000; it lost at K = 64 (+14 %) and K = 4000 (+4 %) (NOTES v19, v20, v23); in the window,
# 1000x1000x1500 (-0.6 % in µs) and 768x1024x2048 (-4 %, +4.5 % in v19) moved within the process spread
_HALF_WAVE_K128 = GemmConfig(64, 128, 128, 4, 128, 8, epilogue="shared", cluster=2)


# ... and both without a cluster where every operand row is whole 128-byte lines (M, N and K multiples of 64,
# whichever way A and B are stored), also for an odd count of M tiles (960: 15): on the H200, paired beside
# cuBLAS, 0.864 -> 0.949 at 1024x1024x4096, 0.894 -> 0.950 at 768x1024x2048, 0.957 -> 1.036 at 1024^3,
# 0.853 -> 1.082 at 960x1024x1024 (from 128x128 tiles). With B's rows 2000 bytes (1000 columns) they lose
# 12-27 % (1000x1000x4000: 0.92 -> 0.67; ncu: 181 MB of L2 reads against the pairs' 139), so unaligned rows
# keep the pairs (NOTES v26)
_HALF_WAVE_LINES = GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared")
_HALF_WAVE_LINES_K128 = GemmConfig(64, 128, 128, 4, 128, 8, epilogue="shared")


# Where rows are not whole lines, cuBLAS's tiling of such grids (nvjet 128x72 in 4x2 clusters at 1000^3 and
# 1000x1000x4000 on the H200): C^T = B^T A^T in 72 (M) x 128 (N) tiles, clusters of 2 M tiles (B multicast)
# by 4 N tiles (A multicast in 18-row slices): 90 MB of L2 reads at 1000x1000x4000 against the 64x128 pairs'
# 139. Level with the pairs while each consumer warp released a stage on its 5 writers in turn; with the
# release one predicated arrive a warp, paired beside cuBLAS on an H100: 0.99 -> 1.12 at 1000x1000x4000,
# 1.00 -> 1.11 at 1000^3 (NOTES v27)
_SWAPPED_2X4 = GemmConfig(72, 128, 64, 8, 256, 0, epilogue="shared", cluster=2, cluster_n=4, swap_ab=True)


def _half_wave_config(M: int, N: int, K: int, batch: int = 1, sms: int = SMS,
                      trans_A: bool = False) -> GemmConfig | None:
    """One wave of 64x128 tiles (at most one per SM), or None: 128-deep k-steps where K is 512-2048; unclustered
    where rows are whole lines; else cuBLAS's swapped 72x128 tiles in 2x4 clusters where they make a nearly
    full wave of resident clusters (K >= 512, A stored K-contiguous), else in pairs, which need an even count
    of M tiles (TMA loads every row: build_gemm pads rows that are not 16-byte)."""
    m_tiles = -(-M // 64)
    if batch * m_tiles * -(-N // 128) > sms:
        return None
    deep = 512 <= K <= 2048
    if M % 64 == 0 and N % 64 == 0 and K % 64 == 0:
        return _HALF_WAVE_LINES_K128 if deep else _HALF_WAVE_LINES
    if K >= 512 and not trans_A and _fills_wave(_SWAPPED_2X4, M, N, batch, sms):
        return _SWAPPED_2X4
    if m_tiles % 2:
        return None
    return _HALF_WAVE_K128 if deep else _HALF_WAVE


# CTAs the H200 holds at once by cluster size (max_active_clusters: 66 clusters of 2, 30 of 4, 15 of 8; its
# GPCs do not all take two clusters of 8, NOTES v5): a 16th cluster of 8 runs as a second wave
_RESIDENT_CLUSTER_CTAS = {1: 132, 2: 132, 4: 120, 8: 120}


def _fills_wave(cfg: GemmConfig, M: int, N: int, batch: int = 1, sms: int = SMS) -> bool:
    """``cfg``'s clusters divide the tile grid, and its CTAs make 3/4 of a wave to one that is resident at once."""
    m_tiles, n_tiles = -(-M // cfg.block_M), -(-N // cfg.block_N)
    resident = min(sms, _RESIDENT_CLUSTER_CTAS.get(cfg.cluster * cfg.cluster_n, sms))
    return not _misfit(cfg, M, N) and 0.75 * sms <= batch * m_tiles * n_tiles <= resident


# 128x128 tiles over more than one wave (2048^3: 256): pairs of M tiles multicast their B tile, six stages,
# grid order: +1-7 % over the unclustered tiles at 5 of 6 such shapes, paired beside cuBLAS; one wave of
# them (1024x2048x4096: 128 tiles) lost 4 % (NOTES v11)
_PAIRED_128 = GemmConfig(128, 128, 64, 6, 128, 0, epilogue="shared", cluster=2)


def _paired_waves(M: int, N: int, batch: int = 1, sms: int = SMS) -> bool:
    """More 128x128 tiles than SMs, in pairs of M tiles."""
    m_tiles = -(-M // 128)
    return batch * m_tiles * -(-N // 128) > sms and m_tiles % 2 == 0


# 128x192 tiles (two consumer warpgroups, TMA store) where they fill their last wave and 128x128 or 128x256
# tiles leave much of theirs idle: 1536x2048x2048 is 132 of them (one wave) against 192 of 128x128 (two
# waves, the second 45 % full): 0.86 -> 1.03x cuBLAS; pairs of M tiles (B multicast) are within 2 % or up to
# 28 % faster (2000x3000x1000), paired beside cuBLAS (NOTES v12)
_WIDE = GemmConfig(128, 192, 64, 4, 256, 8, epilogue="shared")
_WIDE_PAIRED = GemmConfig(128, 192, 64, 4, 256, 0, epilogue="shared", cluster=2)


# ... or swapped 192 (M) x 128 (N) tiles in 5 stages where they are fewer and one wave (the output tile then
# lies over the stages) and B's rows are not whole 128-byte lines: 1500x2000x2000 is 128 of them against 132
# of 128x192; paired beside cuBLAS on an H100, 0.933 -> 0.972 (bf16), 0.924 -> 0.955 (fp16).  Where rows are
# whole lines they lost 3 % (1536x2048x2048: 0.989 -> 0.958, 1152x2048x2048: 0.876 -> 0.843); where they are
# more (2000x1500x2000: 132 against 128) 11-16 % (NOTES v32)
_WIDE_SWAPPED = GemmConfig(192, 128, 64, 5, 256, 8, epilogue="shared", swap_ab=True)


def _wide_config(M: int, N: int, batch: int = 1) -> GemmConfig:
    """The 192-wide tiles' config: swapped where that pays (above), else 128x192, in pairs of M tiles
    where their count is even."""
    swapped = batch * -(-M // 192) * -(-N // 128)
    if N % 64 and swapped < batch * -(-M // 128) * -(-N // 192) and swapped <= SMS:  # (2-byte elements)
        return _WIDE_SWAPPED
    return _WIDE_PAIRED if -(-M // 128) % 2 == 0 else _WIDE


# 128x256 tiles in 4 stages where they make one nearly full wave (2048^3: 128 of them): each CTA runs one
# tile, so the compiler lays the output tile over the dead stages (Lowerer._epilogue_overlay) and a fourth
# stage fits beside it, as in cuBLAS's kernel at 2048^3.  Paired beside cuBLAS on an H100, bf16: 2048^3
# 0.943 (128x128 pairs) -> 1.012, 2048x2048x4096 0.909 -> 1.002 (raster panels: within 1 %) (NOTES v32)
_ONE_WAVE_WIDE = GemmConfig(128, 256, 64, 4, 256, 0, epilogue="shared")


def _waves(M: int, N: int, block_N: int, batch: int = 1, sms: int = SMS) -> float:
    """The time of 128 x block_N tiles, one per SM, in 128x128 tile-times: whole waves (a partly idle last
    one takes as long as a full one) times the tile's width."""
    return -(-batch * -(-M // 128) * -(-N // block_N) // sms) * block_N / 128


# Decode tiles read without a split where they make a nearly full wave (_decode_config)
_DECODE_THIN = GemmConfig(64, 64, 128, 6, 128, 0, b_evict_first=True)
_DECODE_NARROW = GemmConfig(64, 128, 64, 8, 128, 0, b_evict_first=True)


def _decode_config(M: int, N: int, K: int, batch: int = 1, sms: int = SMS) -> GemmConfig:
    """Decode on sm_90a.  Up to 32 rows over >= 64 tiles of 64 columns: C^T = B^T A^T in one kernel
    (``swap_ab``: 64 columns of N per CTA along wgmma's m, M along its n, 16 stages where one CTA an SM
    holds them all, else 8 for two an SM).  Else 64x64 tiles for 33-64 rows, or 64x128 ones, where they
    make 100-132 CTAs (``batch`` times the N tiles); else 64x256 tiles (512-byte B rows per CTA), K split
    while the grid stays within a wave (unsplit from 67 of them on).  A split's fp32 partials cost a
    second kernel and, with 64 rows, 4 x 64 x N x 4 bytes each way.  Measured (NOTES v13-v14, paired
    beside cuBLAS): 16x8192x8192 swapped 1.12 / split 1.03 (B^T stored: 1.01 / 0.95); 16x14336x4096
    1.00 / 0.93; 64x8192x8192 64x64 tiles 1.009 / split 0.878.  Each reads B, whose tiles one CTA reads
    once, with L2 evict_first: after the benchmarks' L2 flush 1.006 -> 1.08 at 16x8192x8192 on an H100
    (the flush's dirty lines stay), level with a clean L2 (NOTES v33)."""
    def tiles(block_N: int) -> int:
        return batch * -(-N // block_N)

    if M <= 32 and tiles(64) >= 64:
        return GemmConfig(max(16, _pow2(M)), 64, 64, 16 if tiles(64) <= sms else 8, 128, 0, swap_ab=True,
                          b_evict_first=True)
    if M > 32 and 100 <= tiles(64) <= sms:
        return _DECODE_THIN
    if 100 <= tiles(128) <= sms:  # (then 64x256 tiles are 50-66: split in 2)
        return _DECODE_NARROW
    return GemmConfig(64, 256, 64, 4, 128, 0, split_k=_decode_split(tiles(256), K // 64), b_evict_first=True)


def _decode_split(tiles: int, k_steps: int, sms: int = SMS) -> int:
    """Split K in 2 or 4 while the split grid still fits one wave of the H200's SMs and each split keeps
    >= 8 k-steps (16x8192x8192: 32 tiles x 4 = 128 CTAs; NOTES.md v4)."""
    split = 1
    while split < 4 and tiles * split * 2 <= sms and k_steps >= 16 * split:
        split *= 2
    return split


# (block_M, block_N, threads): at most 128 fp32 accumulators per thread
_TILES = [(64, 64, 128), (64, 128, 128), (128, 64, 128), (128, 128, 128), (128, 128, 256), (128, 256, 256),
          (256, 128, 256)]
_DECODE_TILES = [(16, 128, 128), (16, 256, 128), (32, 128, 128), (32, 256, 128), (64, 128, 128), (64, 256, 256)]
# sm_90a: wgmma needs 64 rows per consumer warpgroup; TMA stages are cheap, so pipelines are deeper
_HOPPER_SPACE = [(128, 256, 256), (256, 128, 256), (128, 192, 256), (128, 128, 256), (128, 128, 128),
                 (128, 64, 128), (64, 128, 128), (64, 64, 128)]
_HOPPER_DECODE = [(64, 32, 128), (64, 64, 128), (64, 128, 128), (64, 256, 128)]


def config_space(M: int, N: int, K: int, dtype: str = "float16", arch: str = "sm_90a") -> list[GemmConfig]:
    """The autotuner's candidates (tile_ops.autotune): tile x (block_K, stages) x rasterization, with the
    warp policy fixed per regime; tiles larger than the problem's power-of-two M or N are left out.
    ``arch`` is the target: sm_90a (TMA + wgmma) has its own tiles and depths."""
    if arch == "sm_90a":
        return _hopper_space(M, N, K)
    decode = M <= 64  # few rows: thin tiles whose warps split N ("full_col"), deeper K steps
    tiles = _DECODE_TILES if decode else _TILES
    depths = [(64, 3), (64, 4), (128, 2), (128, 3)] if decode else [(32, 3), (32, 4), (64, 2), (64, 3)]
    policy = "full_col" if decode else "square"
    space = []
    for bM, bN, threads in tiles:
        if bM > max(16, _pow2(M)) or bN > max(64, _pow2(N)):
            continue
        # a swizzle panel of 8 column blocks only reorders a grid wider than 8 with more than one row
        swizzles = (0, 8) if -(-N // bN) > 8 and -(-M // bM) > 1 else (0,)
        space += [GemmConfig(bM, bN, bK, stages, threads, sw, policy) for bK, stages in depths for sw in swizzles]
    return space


def _hopper_space(M: int, N: int, K: int) -> list[GemmConfig]:
    decode = M <= 64
    depths = [(64, 4), (64, 6), (64, 8), (128, 4), (128, 6)] if decode else [(64, 3), (64, 4), (64, 5), (128, 3)]
    space = []
    for bM, bN, threads in _HOPPER_DECODE if decode else _HOPPER_SPACE:
        if bM > max(64, _pow2(M)) or bN > max(64, _pow2(N)):
            continue
        swizzles = (0, *(p for p in (4, 8) if -(-N // bN) > p)) if -(-M // bM) > 1 else (0,)  # rasterized panels
        splits = (1, 2, 4) if decode else (1,)  # decode: split K too (the grid is short)
        epilogues = ("direct",) if decode else ("direct", "shared")
        space += [GemmConfig(bM, bN, bK, stages, threads, sw, split_k=sk, epilogue=ep, b_evict_first=decode)
                  for bK, stages in depths
                  for sw in swizzles for sk in splits for ep in epilogues
                  if sk == 1 or -(-K // bK) >= 2 * sk]  # >= 2 k-tiles a split
    if decode and M <= 32:  # C^T = B^T A^T: 64 or 128 columns of N along wgmma's m, M along its n (NOTES v14)
        space += [GemmConfig(max(16, _pow2(M)), bN, bK, stages, 2 * bN, 0, swap_ab=True, b_evict_first=True)
                  for bN in (64, 128)
                  for bK, stages in ((64, 8), (64, 16), (128, 6))
                  if bN <= max(64, _pow2(N)) and bN * bK * stages <= 64 * 64 * 16]
    if not decode and min(M, N) >= 128:  # two consumer warpgroups on alternate 128x128 tiles (NOTES v6)
        swizzles = (0, 8) if -(-N // 128) > 8 and -(-M // 128) > 1 else (0,)
        space += [GemmConfig(128, 128, 64, 4, 128, sw, epilogue="shared", pingpong=True) for sw in swizzles]
    if not decode and _pow2(N) >= 128:  # short grids: 64x128 tiles
        if -(-M // 64) % 2 == 0:  # pairs of them sharing B
            space += [GemmConfig(64, 128, 64, stages, 128, 8, epilogue="shared", cluster=2) for stages in (4, 6, 8)]
            space.append(_HALF_WAVE_K128)
        # ... and both depths without a cluster: the L2 serves concurrent reads of a line by several SMs once
        # anyway, and a multicast to one pair does not combine with the other pairs' (1024x1024x4096 on an
        # H100: 95 MB of L2 reads for 201 MB into the SMs, against the pairs' 121; NOTES v25); the default
        # where rows are whole lines, candidates elsewhere
        space += [_HALF_WAVE_LINES, _HALF_WAVE_LINES_K128]
        if not _misfit(_SWAPPED_2X4, M, N):  # cuBLAS's swapped 72x128 tiles in 2x4 clusters
            space.append(_SWAPPED_2X4)
    if not decode and _pow2(M) >= 192 and _pow2(N) >= 128:  # one wave of swapped 192x128 tiles (_wide_config)
        space.append(_WIDE_SWAPPED)
    if not decode and -(-M // 128) % 2 == 0 and _pow2(N) >= 128:  # pairs of 128x128 tiles sharing B: over a wave
        space += [GemmConfig(128, 128, 64, stages, 128, 0, epilogue="shared", cluster=2) for stages in (4, 6)]
        if _pow2(N) >= 256:  # ... and of 128x192 tiles (one wave where 128x128 would fill two, NOTES v12)
            space.append(_WIDE_PAIRED)
    return space


def shared_memory_bytes(cfg: GemmConfig, M: int, N: int, K: int, dtype: str = "float16", batch: int = 1,
                        out_dtype: str | None = None, tma_rows: bool = True) -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs on sm_90a: pipelined A and B tiles, the bias
    tile, the output tile of a shared epilogue (in ``out_dtype``, the input dtype unless given) (each buffer
    starts on a 1 KiB boundary; with ``pingpong`` the bias and output tiles twice, one per consumer
    warpgroup) and the pipeline's mbarriers.  Where each CTA runs one tile the compiler lays the epilogue's
    tiles over the stages (``_epilogue_overlaid``); ``tma_rows``: A's and B's stored rows are 16-byte
    multiples (build_gemm pads them), as TMA and so the warp-specialized pipeline need."""
    esize, out_size = _ESIZE[dtype], _ESIZE[out_dtype or dtype]
    stages = (_kib(cfg.num_stages * cfg.block_M * cfg.block_K * esize)
              + _kib(cfg.num_stages * cfg.block_K * cfg.block_N * esize))
    epilogue = _kib(cfg.block_N * esize) + (_kib(cfg.block_M * cfg.block_N * out_size) if cfg.epilogue == "shared"
                                            else 0)
    epilogue *= 2 if cfg.pingpong else 1
    pipelined = max(stages, epilogue) if tma_rows and _epilogue_overlaid(cfg, M, N, batch) else stages + epilogue
    return pipelined + 16 * cfg.num_stages


def _epilogue_overlaid(cfg: GemmConfig, M: int, N: int, batch: int = 1) -> bool:
    """Whether the sm_90a compiler lays the epilogue's shared tiles over the dead pipeline stages
    (Lowerer._epilogue_overlay): each CTA runs one tile, the grid being within a wave of resident CTAs."""
    ctas = batch * cfg.split_k * -(-M // cfg.block_M) * -(-N // cfg.block_N)
    return not (cfg.pingpong or cfg.stream_k) and 0 < ctas <= wave_ctas(cfg.cluster * cfg.cluster_n)


def _kib(nbytes: int) -> int:
    return -(-nbytes // 1024) * 1024


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_k_tiles(K: int, cfg: GemmConfig) -> int:
    """k-tiles (of ``block_K``) per split: split s covers k-tiles [s * n, min((s + 1) * n, ceil(K / bK)))."""
    k_tiles = -(-K // cfg.block_K)
    return -(-k_tiles // cfg.split_k)


@tile_ops.jit(out_idx=[-1])
def gemm(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
         dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig(), a_cols=None, b_cols=None,
         bias_dtype=None):
    """C = A @ B (+ Bias, in ``bias_dtype``: the input dtype unless given).  With ``cfg.split_k > 1`` the
    split-K partial kernel instead: grid z is (split, batch); split s sums k-tiles [s * n, (s + 1) * n) (n = ``split_k_tiles``; the last splits
    may get fewer, or none: zeros) into W[s] in fp32, without the bias; ``gemm_splitk_reduce`` adds up.
    ``a_cols``/``b_cols``: A's/B's stored row length when padded past the logical one (``PaddedGemm``)."""
    bM, bN, bK, splits = cfg.block_M, cfg.block_N, cfg.block_K, cfg.split_k
    bias_dtype = bias_dtype or dtype
    _check_problem(M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype)
    A_shape = (batch_a, K, a_cols or M) if trans_A else (batch_a, M, a_cols or K)
    B_shape = (batch_b, N, b_cols or K) if trans_B else (batch_b, K, b_cols or N)
    A_tile = (bK, bM) if trans_A else (bM, bK)
    B_tile = (bN, bK) if trans_B else (bK, bN)
    k_tiles, split_tiles = T.ceildiv(K, bK), split_k_tiles(K, cfg)
    tma_rows = A_shape[-1] * _ESIZE[dtype] % 16 == 0 and B_shape[-1] * _ESIZE[dtype] % 16 == 0
    misfit = _misfit(cfg, M, N, trans_A)
    if misfit:
        raise ValueError(f"gemm: {misfit}")

    clustered = cfg.cluster * cfg.cluster_n > 1  # grid x: M tiles, grid y: N tiles, a cfg.cluster x cluster_n rectangle
    grid = [T.ceildiv(N, bN), T.ceildiv(M, bM), batch * splits]

    def load_A(A, A_s, bz, by, k):  # A's k-th tile of block rows by, stored either way round
        za = bz if batch_a > 1 else 0
        if trans_A:
            T.copy(A[za, k * bK, by * bM], A_s)
        else:
            T.copy(A[za, by * bM, k * bK], A_s)

    def load_B(B, B_s, bz, bx, k):  # B's k-th tile of block columns bx
        zb = bz if batch_b > 1 else 0
        evict = "evict_first" if cfg.b_evict_first else None
        if trans_B:
            T.copy(B[zb, bx * bN, k * bK], B_s, eviction_policy=evict)
        else:
            T.copy(B[zb, k * bK, bx * bN], B_s, eviction_policy=evict)

    @contextlib.contextmanager
    def tiles():
        """The launch, rasterized: yields (by, bx, bz), this block's M tile, N tile and batch (and split).
        In clusters grid x runs over M tiles, so that a cluster row shares B's tile."""
        with T.Kernel(*([grid[1], grid[0]] if clustered else grid[:2]), grid[2], threads=cfg.threads,
                      cluster=(cfg.cluster, cfg.cluster_n), pingpong=cfg.pingpong, stream_k=cfg.stream_k) as ids:
            if cfg.swizzle:
                T.use_swizzle(cfg.swizzle)
            yield ids if clustered else (ids[1], ids[0], ids[2])

    def body(A, B, Bias, C):
        with tiles() as (by, bx, bz):
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared(B_tile, dtype)
            C_f = T.alloc_fragment((bM, bN), "float32")
            split, k0, steps = 0, 0, k_tiles
            if splits > 1:  # this CTA's K range
                split, bz = bz // batch, bz % batch
                k0 = split * split_tiles
                steps = T.max(T.min(k_tiles - k0, split_tiles), 0)
            T.clear(C_f)
            for k in T.Pipelined(steps, num_stages=cfg.num_stages):
                load_A(A, A_s, bz, by, k0 + k)
                load_B(B, B_s, bz, bx, k0 + k)
                T.gemm(A_s, B_s, C_f, transpose_A=trans_A, transpose_B=trans_B, policy=cfg.policy)
            if splits > 1:
                T.copy(C_f, C[split, bz, by * bM, bx * bN])
                return
            if has_bias:
                _add_bias(C_f, Bias, bx * bN, bM, bN, bias_dtype)
            # coalesced (TMA) stores of a staged tile
            if _shared_epilogue_fits(cfg, M, N, batch, dtype, out_dtype, tma_rows):
                C_s = T.alloc_shared((bM, bN), out_dtype)
                T.copy(C_f, C_s)
                T.copy(C_s, C[bz, by * bM, bx * bN])
            else:
                T.copy(C_f, C[bz, by * bM, bx * bN])

    def swapped_body(A, B, Bias, C):  # the C^T tile (bN x bM) = B^T tile @ A^T tile
        with tiles() as (by, bx, bz):
            B_s = T.alloc_shared(B_tile, dtype)
            A_s = T.alloc_shared(A_tile, dtype)
            Ct_f = T.alloc_fragment((bN, bM), "float32")
            T.clear(Ct_f)
            for k in T.Pipelined(k_tiles, num_stages=cfg.num_stages):
                load_B(B, B_s, bz, bx, k)
                load_A(A, A_s, bz, by, k)
                T.gemm(B_s, A_s, Ct_f, transpose_A=not trans_B, transpose_B=not trans_A)
            if has_bias:
                _add_bias(Ct_f, Bias, bx * bN, bN, bM, bias_dtype, along_rows=True)
            # transposed into a staged C tile, TMA-stored
            if _shared_epilogue_fits(cfg, M, N, batch, dtype, out_dtype, tma_rows):
                C_s = T.alloc_shared((bM, bN), out_dtype)
                for i, j in T.Parallel(bN, bM):
                    C_s[j, i] = Ct_f[i, j]
                T.copy(C_s, C[bz, by * bM, bx * bN])
            else:
                for i, j in T.Parallel(bN, bM):
                    C[bz, by * bM + j, bx * bN + i] = Ct_f[i, j]

    if cfg.swap_ab:
        @T.prim_func
        def gemm_swapped_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype),
                                Bias: T.Tensor((N,), bias_dtype), C: T.Tensor((batch, M, N), out_dtype)):
            swapped_body(A, B, Bias, C)

        return gemm_swapped_kernel

    if splits == 1:
        @T.prim_func
        def gemm_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), Bias: T.Tensor((N,), bias_dtype),
                        C: T.Tensor((batch, M, N), out_dtype)):
            body(A, B, Bias, C)

        return gemm_kernel

    @T.prim_func
    def gemm_splitk_kernel(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), Bias: T.Tensor((N,), bias_dtype),
                           W: T.Tensor((splits, batch, M, N), T.float32)):  # Bias: unused, the reduction adds it
        body(A, B, Bias, W)

    return gemm_splitk_kernel


def _check_problem(M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype) -> None:
    """The problem itself: sizes of at least 1 (the op answers empty problems without a kernel), operand
    batches of 1 (broadcast) or ``batch``, dtypes the kernel computes."""
    if min(M, N, K, batch) < 1 or batch_a not in (1, batch) or batch_b not in (1, batch):
        raise ValueError(f"gemm: M={M}, N={N}, K={K}, batch={batch} (batch_a={batch_a}, batch_b={batch_b}): sizes "
                         f"must be at least 1, and each operand's batch 1 (broadcast) or the batch")
    for name, dt, accepted in (("dtype", dtype, ("float16", "bfloat16")), ("out_dtype", out_dtype, tuple(_ESIZE)),
                               ("bias_dtype", bias_dtype, tuple(_ESIZE))):
        if dt not in accepted:
            raise ValueError(f"gemm: {name}={dt!r}; accepted: {', '.join(accepted)}")


def _misfit(cfg: GemmConfig, M: int, N: int, trans_A: bool = False) -> str | None:
    """Why ``cfg`` cannot build for an M x N problem with A stored this way, or None when it can."""
    m_tiles, n_tiles = -(-M // cfg.block_M), -(-N // cfg.block_N)
    if cfg.swap_ab and trans_A and cfg.block_M % 16:
        return (f"swap_ab with A stored transposed needs block_M a multiple of 16 (A's M-contiguous tile is read in "
                f"16-column swizzle panels): got {cfg.block_M}")
    if cfg.cluster * cfg.cluster_n > 1 and m_tiles % cfg.cluster:
        return f"cluster={cfg.cluster} must divide the {m_tiles} row tiles of M={M} (block_M={cfg.block_M})"
    if cfg.cluster * cfg.cluster_n > 1 and n_tiles % cfg.cluster_n:
        return f"cluster_n={cfg.cluster_n} must divide the {n_tiles} column tiles of N={N} (block_N={cfg.block_N})"
    return None


def _shared_epilogue_fits(cfg: GemmConfig, M: int, N: int, batch: int, dtype: str, out_dtype: str,
                          tma_rows: bool) -> bool:
    """``cfg.epilogue == "shared"`` unless the output tile in ``out_dtype`` would overflow shared memory
    (e.g. 128x256 fp32 beside three stages, over more than a wave): then the direct epilogue, rather than a
    compile error."""
    return (cfg.epilogue == "shared"
            and shared_memory_bytes(cfg, M, N, 0, dtype, batch, out_dtype, tma_rows) <= smem_limit("sm_90a"))


def _add_bias(acc, Bias, n0, rows: int, cols: int, dtype: str, along_rows: bool = False):
    """acc[i, j] += Bias[n0 + j] (``along_rows``: Bias[n0 + i], the swapped gemm's C^T tile), inside a
    kernel being traced (the epilogue of the gemm kernels)."""
    bias_s = T.alloc_shared((rows if along_rows else cols,), dtype)
    T.copy(Bias[n0], bias_s)
    for i, j in T.Parallel(rows, cols):
        acc[i, j] = acc[i, j] + (bias_s[i] if along_rows else bias_s[j])


def reduce_tile(M: int, N: int) -> tuple:
    """(block_M, block_N, threads) of ``gemm_splitk_reduce``: narrow column tiles, so that even a decode
    problem's reduction (few rows) has a CTA per SM or so (N / 64 of them) reading the partials."""
    return min(64, max(16, _pow2(M))), 64, 128


@tile_ops.jit(out_idx=[-1])
def gemm_splitk_reduce(M, N, batch=1, split_k=2, has_bias=False, dtype="float16", out_dtype="float16",
                       block_M=16, block_N=64, threads=128, bias_dtype=None):
    """C[b] = sum over s of W[s, b] (+ Bias, in ``bias_dtype``: ``dtype`` unless given), cast to ``out_dtype``:
    the second kernel of a split-K gemm."""
    bM, bN = block_M, block_N
    bias_dtype = bias_dtype or dtype

    @T.prim_func
    def splitk_reduce(W: T.Tensor((split_k, batch, M, N), T.float32), Bias: T.Tensor((N,), bias_dtype),
                      C: T.Tensor((batch, M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), batch, threads=threads) as (bx, by, bz):
            acc = T.alloc_fragment((bM, bN), "float32")
            part = T.alloc_fragment((bM, bN), "float32")
            T.copy(W[0, bz, by * bM, bx * bN], acc)
            for s in T.unroll(split_k - 1):
                T.copy(W[s + 1, bz, by * bM, bx * bN], part)
                for i, j in T.Parallel(bM, bN):
                    acc[i, j] = acc[i, j] + part[i, j]
            if has_bias:
                _add_bias(acc, Bias, bx * bN, bM, bN, bias_dtype)
            T.copy(acc, C[bz, by * bM, bx * bN])

    return splitk_reduce


@tile_ops.jit(out_idx=[-1])
def pad_rows(batch, rows, cols, padded, dtype="float16", block_R=16, block_C=256, threads=256):
    """Y[b, r, :cols] = X[b, r]; Y[b, r, cols:padded] = 0: a matrix re-laid with rows of ``padded``
    elements (a 16-byte multiple), so that TMA can load it (``PaddedGemm``)."""

    @T.prim_func
    def pad(X: T.Tensor((batch, rows, cols), dtype), Y: T.Tensor((batch, rows, padded), dtype)):
        # rows on grid x, which takes 2^31 - 1 blocks (y: 65535, i.e. ~1M rows)
        with T.Kernel(T.ceildiv(rows, block_R), T.ceildiv(padded, block_C), batch, threads=threads) as (bx, by, bz):
            tile = T.alloc_fragment((block_R, block_C), dtype)
            T.copy(X[bz, bx * block_R, by * block_C], tile)  # zeros past the row
            T.copy(tile, Y[bz, bx * block_R, by * block_C])

    return pad


_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _storage(x):
    """(view, transposed?, batch count): the kernel reads dense (batch, rows, cols) storage, so a 3-D view
    whose last two dims are row-major or a plain transpose is passed as is; anything else is copied."""
    batched = x.shape[0] > 1 and x.stride(0) != 0
    for trans in (False, True):
        s = x.transpose(-1, -2) if trans else x
        rows, cols = s.shape[-2:]
        if (s.stride(-1) == 1 or cols == 1) and (s.stride(-2) == cols or rows == 1) and (
                not batched or s.stride(0) == rows * cols):
            return x, trans, (x.shape[0] if batched else 1)
    return x.contiguous(), False, x.shape[0]


def _prepare(a, b):
    a, ta, ba = _storage(a)
    b, tb, bb = _storage(b)
    return a, b, ta, ba, tb, bb


class _ComposedGemm:
    """Several kernels launched like one gemm kernel: ``launch_ptrs([A, B, Bias, C], device)``, ``launcher``
    or ``plan``.  The main one's meta and its ``DESCRIBED_BY_MAIN`` attributes stand for the whole (what the
    tuner and tests report); nothing else is forwarded, so a launch method of the main kernel alone
    (``launch``, ``grid_on``, ...) is an AttributeError, not a partial launch.  Workspaces are
    caching-allocator ``torch.empty`` per launch on the current stream, which every kernel runs on (so
    freeing them right after is stream-ordered)."""

    main_attr = ""
    DESCRIBED_BY_MAIN = ("source", "cubin", "tir", "sass", "instruction_mix")

    def __getattr__(self, name):
        if name in self.DESCRIBED_BY_MAIN:
            return getattr(getattr(self, self.main_attr), name)
        raise AttributeError(f"{type(self).__name__} has no {name!r}: it launches several kernels as one "
                             f"(launch_ptrs, launcher, plan); its main kernel describes it only through "
                             f"meta, {', '.join(self.DESCRIBED_BY_MAIN)}")

    def launcher(self, device):
        return lambda ptrs: self.launch_ptrs(ptrs, device)


class SplitKGemm(_ComposedGemm):
    """A split-K gemm: the partial kernel (``gemm`` with ``cfg.split_k > 1``), the reduction kernel and the
    fp32 workspace W (split_k, batch, M, N) between them."""

    main_attr = "partial"

    def __init__(self, partial, reduce):
        self.partial, self.reduce = partial, reduce.dependent()  # launched while the partials are summed up
        self.meta = partial.meta  # the main kernel's (grid, smem, arch, ...): what the tuner reports
        self.workspace_shape = tuple(partial.meta.params[-1][1])

    def dependent(self) -> "SplitKGemm":
        """Both kernels launched programmatically (``Kernel.dependent``): the gemm after ``PaddedGemm``'s pads."""
        return SplitKGemm(self.partial.dependent(), self.reduce)

    def __repr__(self) -> str:
        return f"<tile_ops SplitKGemm {self.partial!r} + {self.reduce!r}>"

    def plan(self, device, buffers, scratch):
        """Both kernels as a plan program (``Kernel.plan``), the workspace as scratch buffer ``scratch``."""
        a, b, bias, c = buffers
        _, partial = self.partial.plan(device, [a, b, bias, scratch])
        _, reduce = self.reduce.plan(device, [scratch, bias, c])
        return [(self.workspace_shape, torch.float32)], partial + reduce

    def launch_ptrs(self, ptrs, device):
        a_ptr, b_ptr, bias_ptr, c_ptr = ptrs
        w = torch.empty(self.workspace_shape, dtype=torch.float32, device=device)
        self.partial.launch_ptrs([a_ptr, b_ptr, bias_ptr, w.data_ptr()], device)
        self.reduce.launch_ptrs([w.data_ptr(), bias_ptr, c_ptr], device)


class PaddedGemm(_ComposedGemm):
    """A gemm whose A or B rows are not 16-byte multiples, which TMA cannot load: ``pad_rows`` first copies
    each such operand into a workspace of padded rows, and the gemm (``a_cols``/``b_cols``) reads those.
    Padding along K (A's rows, or B^T's) meets the other operand's zeros past K (TMA fills them, or its own
    zero padding); padding along M (A^T's) or N (B's) makes output rows or columns that are never stored.
    ``pads``: {operand index (0: A, 1: B): its pad kernel, whose output Y is the workspace}."""

    main_attr = "main"

    def __init__(self, pads, main):
        # every step after the first launched programmatically (Kernel.dependent): it starts while the one
        # before runs and waits for it at its entry
        first = next(iter(pads))
        self.pads = {i: pad if i == first else pad.dependent() for i, pad in pads.items()}
        self.main = main.dependent()
        self.meta = main.meta

    def dependent(self) -> "PaddedGemm":
        """Every step launched programmatically, the first pad too (``Kernel.dependent``)."""
        return PaddedGemm({i: pad.dependent() for i, pad in self.pads.items()}, self.main)

    def __repr__(self) -> str:
        return f"<tile_ops PaddedGemm {list(self.pads.values())!r} + {self.main!r}>"

    def plan(self, device, buffers, scratch):
        """The pads and the gemm as one plan program, each padded operand a scratch buffer from ``scratch``
        on; where the gemm's launch runs host code (stream-K), the whole launch is the program."""
        if self.main.meta.needs_workspace:
            return lambda a, b, out, c: self.launch_ptrs([(a, b, c, out)[i] for i in buffers], device)
        padded, spaces, steps = list(buffers), [], []
        for i, pad in self.pads.items():
            spaces.append(_workspace(pad))
            steps += pad.plan(device, [buffers[i], scratch + len(spaces) - 1])[1]
            padded[i] = scratch + len(spaces) - 1
        scratch_main, steps_main = self.main.plan(device, padded, scratch + len(spaces))
        return spaces + scratch_main, steps + steps_main

    def launch_ptrs(self, ptrs, device):
        ptrs, workspaces = list(ptrs), []
        for i, pad in self.pads.items():
            shape, dtype = _workspace(pad)
            workspaces.append(torch.empty(shape, dtype=dtype, device=device))
            pad.launch_ptrs([ptrs[i], workspaces[-1].data_ptr()], device)
            ptrs[i] = workspaces[-1].data_ptr()
        self.main.launch_ptrs(ptrs, device)


def _workspace(pad) -> tuple:
    """(shape, torch dtype) of a pad kernel's output: the padded operand."""
    _, shape, dtype = pad.meta.params[-1]
    return tuple(shape), getattr(torch, dtype)


def _stored(M, N, K, batch_a, batch_b, trans_A, trans_B) -> list:
    """The stored (batch, rows, cols) of A and B."""
    return [(batch_a, *((K, M) if trans_A else (M, K))), (batch_b, *((N, K) if trans_B else (K, N)))]


def padded_cols(M, N, K, batch_a=1, batch_b=1, trans_A=False, trans_B=False, dtype="float16", target=None) -> dict:
    """``gemm``'s ``a_cols``/``b_cols`` as ``build_gemm`` gives them: for each operand whose stored rows TMA
    cannot load (sm_90a; not 16-byte multiples), the 16-byte multiple it is padded to.  {} when none."""
    if (target or default_arch()) != "sm_90a":
        return {}
    esize = _ESIZE[dtype]
    return {name: -(-cols * esize // 16) * 16 // esize
            for name, (_, _, cols) in zip(("a_cols", "b_cols"), _stored(M, N, K, batch_a, batch_b, trans_A, trans_B))
            if cols * esize % 16}


def build_gemm(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
               dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig(), target=None, pad=True,
               bias_dtype=None):
    """The launchable gemm for ``cfg``: the ``gemm`` kernel itself, a :class:`SplitKGemm` when
    ``cfg.split_k > 1``, inside a :class:`PaddedGemm` when TMA (sm_90a) cannot load A's or B's rows as
    they are (``pad=False``: the gemm's synchronous-copy path reads them).  Each takes
    ``launch_ptrs([A, B, Bias, C], device)``; Bias in ``bias_dtype`` (the input dtype unless given)."""
    bias_dtype = None if bias_dtype == dtype else bias_dtype  # one cache entry whichever way it is said
    _check_problem(M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype or dtype)
    cols = padded_cols(M, N, K, batch_a, batch_b, trans_A, trans_B, dtype, target) if pad else {}
    main = gemm(M, N, K, batch, batch_a, batch_b, trans_A, trans_B, has_bias, dtype, out_dtype, cfg, **cols,
                bias_dtype=bias_dtype, target=target)
    if cfg.split_k > 1:
        reduce = gemm_splitk_reduce(M, N, batch, cfg.split_k, has_bias, dtype, out_dtype, *reduce_tile(M, N),
                                    bias_dtype=bias_dtype, target=target)
        main = SplitKGemm(main, reduce)
    if not cols:
        return main
    stored = _stored(M, N, K, batch_a, batch_b, trans_A, trans_B)
    pads = {i: pad_rows(*stored[i], n, dtype, target=target)
            for i, name in enumerate(("a_cols", "b_cols")) if (n := cols.get(name))}
    return PaddedGemm(pads, main)


def get_gemm_kernel(a, b, out, bias=None, cfg=None):
    """(kernel, a, b): the kernel for these operands and the operand views it reads.

    ``config_for`` chooses per (M, N, K). A tuned config that cannot build here (its clusters do not divide
    this M's tiles: it was tuned for another M of the bucket; or A is stored another way) gives way to the
    default. The heuristic default, fitted to the waves of one matrix, is re-derived with the batch; a tuned
    split-K config (``split_k > 1``) is divided by the batch count (a batch already multiplies the CTAs).
    An explicit ``cfg`` is used as is."""
    Bt, M, K = a.shape
    N = b.shape[-1]
    a, b, ta, ba, tb, bb = _prepare(a, b)
    cfg = cfg or launch_config(M, N, K, _DT[a.dtype], Bt, ta, a.device)
    kernel = build_gemm(M, N, K, Bt, ba, bb, ta, tb, bias is not None, _DT[a.dtype], _DT[out.dtype], cfg,
                        bias_dtype=None if bias is None else _DT[bias.dtype])
    return kernel, a, b


def launch_config(M, N, K, dtype, batch=1, trans_A=False, device=None, arch=None) -> GemmConfig:
    """The config the op launches (and ``precompile`` builds) for this problem: see ``get_gemm_kernel``."""
    cfg = config_for("gemm", M, N, K, dtype, device, arch)
    if _misfit(cfg, M, N, trans_A):  # tuned for another M of the bucket, or another layout of A
        cfg = default_config(M, N, K, arch, trans_A=trans_A)
    if batch > 1 and cfg == default_config(M, N, K, arch, trans_A=trans_A):  # the heuristic fits one matrix's
        cfg = default_config(M, N, K, arch, batch=batch, trans_A=trans_A)  # waves: the batch's
    elif batch > 1 and cfg.split_k > 1:  # a tuned split: the batch already multiplies the CTAs
        cfg = dataclasses.replace(cfg, split_k=max(1, cfg.split_k // batch))
    return cfg


def gemm_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr, bias_ptr=0)`` for a kernel from ``get_gemm_kernel`` (0: no bias);
    a split-K gemm launches both its kernels (and allocates their workspace) per call."""

    run = kernel.launcher(device)

    def launch(a_ptr, b_ptr, out_ptr, bias_ptr=0):
        run(_gemm_params(a_ptr, b_ptr, out_ptr, bias_ptr or None))

    return launch


def gemm_plan(kernel, device, a, b, out, bias=None, scratch=None):
    """``gemm_launcher``'s launch as a plan program (``Kernel.plan``) over plan buffer indices a, b, out and
    bias (None: no bias); workspaces (a split-K gemm's partials, a PaddedGemm's padded operands) are the
    buffers from ``scratch`` on."""
    return kernel.plan(device, _gemm_params(a, b, out, bias), scratch)


def _gemm_params(a, b, out, bias):
    """The gemm kernel's parameters [A, B, Bias, C] (pointers or plan buffers); without a bias its unused
    slot takes the output's: any valid pointer."""
    return [a, b, out if bias is None else bias, out]


def launch_gemm(a, b, out, bias=None, cfg=None):
    """a (Bt, M, K), b (Bt, K, N): row-major or plain-transposed views (batch stride 0 = broadcast);
    out (Bt, M, N) contiguous; bias (N,) or None."""
    kernel, a, b = get_gemm_kernel(a, b, out, bias, cfg)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    gemm_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr(), bias_ptr)
    return out
