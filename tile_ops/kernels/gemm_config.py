"""The gemm's config: what a ``GemmConfig`` says, which problems it cannot build, and the shared memory it needs."""


from dataclasses import dataclass

import tile_ops.lang as T
from tile_ops.jit import build_target

_ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


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


def shared_memory_bytes(cfg: GemmConfig, M: int, N: int, K: int, dtype: str = "float16", batch: int = 1,
                        out_dtype: str | None = None, tma_rows: bool = True, overlaid: bool | None = None) -> int:
    """Upper estimate of the dynamic shared memory ``cfg`` needs on sm_90a: pipelined A and B tiles, the bias
    tile, the output tile of a shared epilogue (in ``out_dtype``, the input dtype unless given) (each buffer
    starts on a 1 KiB boundary; with ``pingpong`` the bias and output tiles twice, one per consumer
    warpgroup) and the pipeline's mbarriers.  Where each CTA runs one tile the compiler lays the epilogue's
    tiles over the stages (``_epilogue_overlaid``); ``tma_rows``: A's and B's stored rows are 16-byte
    multiples (build_gemm pads them), as TMA and so the warp-specialized pipeline need; ``overlaid``: whether
    the epilogue lies over the stages (a runtime-M kernel's choice), None: as the M x N grid gives it."""
    esize, out_size = _ESIZE[dtype], _ESIZE[out_dtype or dtype]
    stages = (_kib(cfg.num_stages * cfg.block_M * cfg.block_K * esize)
              + _kib(cfg.num_stages * cfg.block_K * cfg.block_N * esize))
    epilogue = _kib(cfg.block_N * esize) + (_kib(cfg.block_M * cfg.block_N * out_size) if cfg.epilogue == "shared"
                                            else 0)
    epilogue *= 2 if cfg.pingpong else 1
    overlaid = _epilogue_overlaid(cfg, M, N, batch) if overlaid is None else overlaid and not (cfg.pingpong or
                                                                                               cfg.stream_k)
    pipelined = max(stages, epilogue) if tma_rows and overlaid else stages + epilogue
    return pipelined + 16 * cfg.num_stages


def _epilogue_overlaid(cfg: GemmConfig, M: int, N: int, batch: int = 1) -> bool:
    """Whether the sm_90a compiler lays the epilogue's shared tiles over the dead pipeline stages
    (Lowerer._epilogue_overlay): each CTA runs one tile, the grid being within a wave of resident CTAs."""
    ctas = batch * cfg.split_k * -(-M // cfg.block_M) * -(-N // cfg.block_N)
    wave = build_target("sm_90a").wave_ctas(cfg.cluster * cfg.cluster_n)
    return not (cfg.pingpong or cfg.stream_k) and 0 < ctas <= wave


def _kib(nbytes: int) -> int:
    return -(-nbytes // 1024) * 1024


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()

