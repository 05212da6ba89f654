"""The FlashAttention forward's config, and the one launched for a head dim on a target."""


from dataclasses import dataclass

from tile_ops.jit import default_arch

HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class AttentionConfig:
    block_M: int = 64  # query rows per block
    block_N: int = 64  # keys per tile of the loop
    num_stages: int = 2  # key/value tiles in flight
    threads: int = 128
    cluster: int = 1  # neighbouring query blocks that share each K/V tile's load (TMA multicast; full masks only)

    def __post_init__(self):
        for name in ("block_M", "block_N"):
            v = getattr(self, name)
            if v < 16 or v % 16:
                raise ValueError(f"AttentionConfig.{name}={v}: a multiple of 16, at least 16")
        if self.cluster not in (1, 2, 4):
            raise ValueError(f"AttentionConfig.cluster={self.cluster}: 1, 2 or 4 query blocks")
        if self.num_stages < 1 or self.threads % 128:
            raise ValueError(f"AttentionConfig: num_stages={self.num_stages} (>= 1), threads={self.threads} "
                             f"(a multiple of 128: whole warpgroups)")


def shared_memory_bytes(cfg: AttentionConfig, dim: int, esize: int = 2) -> int:
    """Q's tile and ``num_stages`` K and V tiles."""
    return esize * dim * (cfg.block_M + 2 * cfg.num_stages * cfg.block_N)


def default_config(dim: int, arch: str | None = None) -> AttentionConfig:
    """On sm_90a three stages: the deferred P V holds the previous tile's stage while the producer fills the
    next; a block of 128 query rows (two warpgroups of 64) and 128 keys a tile where the accumulator fits the
    registers beside the scores (FlashAttention-3's tile); at head dim 256 two stages of 80 keys (FA3's tile) in
    clusters of two query blocks sharing each K/V load (H100: 459 TFLOP/s against 433 for 64 x 64, three stages;
    clusters lost 5 % at head dim 128), 64 x 64 at 192.  On the mma.sync path, 64 x 64 and two stages."""
    if (arch or default_arch()) != "sm_90a":
        return AttentionConfig(64, 64, 2, 128)
    if dim <= 128:
        return AttentionConfig(128, 128, 3, 256)
    if dim == 256:
        return AttentionConfig(128, 80, 2, 256, cluster=2)
    return AttentionConfig(64, 64, 3, 128)


def config_space(seqlen: int, heads: int, dim: int, dtype: str = "float16", arch: str | None = None) -> list:
    """The forward's candidates for the autotuner: query blocks of 64 or 128 rows over one or two warpgroups,
    key tiles of 64 to 128 (FA3's 80 and 176 among them on sm_90a), two or three stages, and on sm_90a clusters of
    two query blocks sharing each K/V load; the tuner drops those whose shared memory does not fit."""
    hopper = (arch or default_arch()) == "sm_90a"
    keys = (64, 80, 128, 176) if hopper else (32, 64)
    return [AttentionConfig(bm, bn, stages, threads, cluster)
            for bm in (64, 128) for bn in keys for stages in ((2, 3) if hopper else (1, 2))
            for threads in (128, 256) if threads <= 2 * bm for cluster in ((1, 2) if hopper else (1,))]


def splits_head_dim(cfg: AttentionConfig) -> bool:
    """Whether the backward's warpgroups split the head dim (each all of the block's keys) rather than the keys:
    where the block has fewer than 64 keys a warpgroup (a wgmma's rows)."""
    return cfg.block_N < 64 * (cfg.threads // 128)


def backward_config(dim: int, arch: str | None = None) -> AttentionConfig:
    """The backward's, 64 queries a step: on sm_90a up to head dim 128, 128 keys a block over two consumer
    warpgroups (each keeps 64 keys' dK and dV in registers; dQ's product splits across them); beyond it 64 keys
    over two warpgroups that split the head dim (``splits_head_dim``: 64 keys' whole dK and dV would fill one
    warpgroup's registers).  At 96 one warpgroup of 64 keys: two of 64 spilled 268-288 bytes a thread (a
    96-wide tile is three 32-column panels).  On the mma.sync path 64 keys and one warpgroup, two above 128."""
    if dim > 128:
        return AttentionConfig(64, 64, 2, 256)
    if (arch or default_arch()) == "sm_90a" and dim != 96:
        return AttentionConfig(64, 128, 2, 256)
    return AttentionConfig(64, 64, 2, 128)


def dq_kernel_of(dim: int, deterministic: bool) -> bool:
    """Whether dQ comes from its own query-block kernel rather than the key-block kernel's adds: for the same bits
    every run, and at every head dim but 128.  Above 128 dQ's float32 tile does not fit shared memory for one
    reduce-add, and an atomic add per element costs more than the query blocks' recomputed S and dP (H100, D256
    bf16: 344 against 238 TFLOP/s); at 64 and 96 each warpgroup's half of dQ's columns starts inside a swizzle
    panel of K's tile, so the product falls back to mma.sync (H100, D64: 269 / 221 against 236 / 197)."""
    return deterministic or dim != 128


def backward_dq_config(dim: int, arch: str | None = None) -> AttentionConfig:
    """The deterministic backward's dQ kernel: 64 query rows a block over 64-key steps, one warpgroup."""
    return AttentionConfig(64, 64, 2, 128)
