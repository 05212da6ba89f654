"""The gemm autotuner's candidates (tile_ops.autotune): ``config_space(M, N, K, dtype, arch)``."""


from .gemm_config import GemmConfig, _misfit, _pow2
from .gemm_defaults import SM90A

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
    if decode and M <= 32:  # C^T = B^T A^T: 64 or 128 columns of N along wgmma's m, M along its n
        space += [GemmConfig(max(16, _pow2(M)), bN, bK, stages, 2 * bN, 0, swap_ab=True, b_evict_first=True)
                  for bN in (64, 128)
                  for bK, stages in ((64, 8), (64, 16), (128, 6))
                  if bN <= max(64, _pow2(N)) and bN * bK * stages <= 64 * 64 * 16]
    if not decode and min(M, N) >= 128:  # two consumer warpgroups on alternate 128x128 tiles
        swizzles = (0, 8) if -(-N // 128) > 8 and -(-M // 128) > 1 else (0,)
        space += [GemmConfig(128, 128, 64, 4, 128, sw, epilogue="shared", pingpong=True) for sw in swizzles]
    if not decode and _pow2(N) >= 128:  # short grids: 64x128 tiles
        if -(-M // 64) % 2 == 0:  # pairs of them sharing B
            space += [GemmConfig(64, 128, 64, stages, 128, 8, epilogue="shared", cluster=2) for stages in (4, 6, 8)]
            space.append(SM90A.half_wave_k128)
        # ... and both depths without a cluster, the default where rows are whole lines: the L2 serves a line
        # read by several SMs at once anyway, and one pair's multicast does not combine with the other pairs'
        space += [SM90A.half_wave_lines, SM90A.half_wave_lines_k128]
        if not _misfit(SM90A.swapped_2x4, M, N):  # cuBLAS's swapped 72x128 tiles in 2x4 clusters
            space.append(SM90A.swapped_2x4)
    if not decode and _pow2(M) >= 192 and _pow2(N) >= 128:  # one wave of swapped 192x128 tiles
        space.append(SM90A.wide_swapped)
    if not decode and -(-M // 128) % 2 == 0 and _pow2(N) >= 128:  # pairs of 128x128 tiles sharing B: over a wave
        space += [GemmConfig(128, 128, 64, stages, 128, 0, epilogue="shared", cluster=2) for stages in (4, 6)]
        if _pow2(N) >= 256:  # ... and of 128x192 tiles (one wave where 128x128 would fill two)
            space.append(SM90A.wide_paired)
    return space

