"""The gemm + softmax autotuner's candidates (tile_ops.autotune): ``config_space(M, N, K, dtype, arch)``."""


from dataclasses import replace

import tile_ops.lang as T

from .gemm_config import _pow2
from .gemm_softmax_config import SoftmaxConfig, _every_block_has_columns, block_columns


def config_space(M: int, N: int, K: int, dtype: str = "float16", arch: str = "sm_90a") -> list[SoftmaxConfig]:
    """The autotuner's candidates (tile_ops.autotune): row block x threads, column tile, (block_K, stages),
    warp policy.  ``arch`` is the target: sm_90a (TMA stages + wgmma) pipelines 64-wide K steps deeper,
    and adds column splits over clusters."""
    depths = ((64, 3), (64, 4), (32, 4)) if arch == "sm_90a" else ((32, 3), (64, 2))
    space = []
    for bM, threads in ((64, 128), (128, 128), (128, 256)):
        for bN in (64, 128):
            if bN > max(64, _pow2(N)):
                continue
            space += [SoftmaxConfig(bM, bN, bK, stages, threads, policy)
                      for bK, stages in depths for policy in ("square", "full_row")]
    if arch == "sm_90a":  # 64-row tiles, two warpgroups splitting the columns (wgmma along N)
        space += [SoftmaxConfig(64, bN, 64, stages, 256, "full_col") for bN in (128, 256)
                  if bN <= max(128, _pow2(N)) for stages in (2, 3)]
        # clusters: one column tile per block, or a few when the row is wider than 8 tiles
        for bM, bN, threads, stages in ((128, 256, 256, 3), (128, 128, 256, 4), (64, 256, 128, 4)):
            for split in (2, 4, 8):
                cfg = SoftmaxConfig(bM, bN, 64, stages, threads, "full_row", split)
                if _every_block_has_columns(N, cfg):
                    space += [cfg, replace(cfg, persistent=False)] if bN == 256 else [cfg]
                    if threads == 128 and block_columns(N, cfg) == bN:  # two warpgroups, alternate row blocks
                        space.append(replace(cfg, num_stages=3, pingpong=True))
        # 64-row blocks (finer over the clusters that fit), the two warpgroups splitting the columns
        space += [cfg for cfg in (SoftmaxConfig(64, 256, 64, 4, 256, "full_col", split) for split in (2, 4, 8))
                  if _every_block_has_columns(N, cfg)]
        if N % 8 == 0 and K % 8 == 0:  # rows over the whole grid, statistics through global memory
            space += [cfg for cfg in (SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True),
                                      SoftmaxConfig(128, 128, 64, 4, 256, "full_row", deferred=True))
                      if -(-N // cfg.block_N) <= T.MAX_ROW_TILES]
    return space

