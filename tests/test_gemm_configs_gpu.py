"""Every GEMM config a default, the autotuner's Hopper space or bench_gemm.py can pick, on the GPU against
float64: fresh random inputs, outputs poisoned with NaN, ragged and transposed operands, bias, batched
and fp32 output (a 128x256 fp32 output tile does not fit beside the stages: that config falls back to
the direct epilogue).  Covers the two-CTAs-per-SM pipelines and the shared-memory (TMA store) epilogue."""

import pytest
import torch

from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_defaults import SM90A, default_config
from tile_ops.kernels.gemm_launch import build_gemm, launch_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float32: 5e-3}
CONFIGS = [
    GemmConfig(128, 256, 64, 4, 256, 8),  # cooperative: two consumer warpgroups
    GemmConfig(128, 128, 64, 3, 128, 8),  # two CTAs per SM
    GemmConfig(128, 64, 64, 4, 128, 8),  # two CTAs per SM
    GemmConfig(64, 64, 128, 6, 128, 0, b_evict_first=True),  # decode defaults: 33-64 rows over 100-132 tiles
    GemmConfig(64, 128, 64, 8, 128, 0, b_evict_first=True),  # of 64 columns, and of 128 (B read evict_first)
    GemmConfig(64, 256, 64, 4, 256, 8, "full_col"),  # two warpgroups split N (wgmma m64n128 each)
    GemmConfig(128, 256, 64, 3, 256, 8, "full_col", epilogue="shared"),
    GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared"),
    GemmConfig(128, 256, 64, 3, 256, 4, epilogue="shared"),  # rasterized in panels of 4 column tiles
    GemmConfig(128, 128, 64, 2, 128, 8, epilogue="shared"),  # TMA store, two CTAs per SM
    GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared"),
    GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared", cluster=2),  # B multicast to pairs of M tiles
    GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2),
    GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2, cluster_n=2),  # A and B multicast
    GemmConfig(64, 128, 64, 6, 128, 8, epilogue="shared", cluster=4, cluster_n=2),
    GemmConfig(64, 128, 64, 8, 128, 8, epilogue="shared", cluster=2),  # short grids: 64-row pairs
    SM90A.half_wave_lines,  # ... unclustered: the default where rows are whole 128-byte lines
    SM90A.half_wave_k128,  # ... in 128-deep k-steps (K of 512-2048)
    SM90A.half_wave_lines_k128,
    SM90A.swapped_2x4,  # ... swapped 72x128 tiles in 2x4 clusters where rows are not whole lines
    GemmConfig(64, 256, 64, 4, 128, 8, epilogue="shared", pingpong=True),  # two warpgroups, alternate tiles
    GemmConfig(128, 128, 64, 5, 128, 8, pingpong=True),
    GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", pingpong=True),  # the tuner's ping-pong candidate
    GemmConfig(16, 64, 64, 16, 128, 0, swap_ab=True, b_evict_first=True),  # decode: C^T = B^T A^T, m64n16 along N
    GemmConfig(32, 128, 64, 8, 256, 0, swap_ab=True),  # ... two consumer warpgroups, m64n32
    GemmConfig(32, 128, 64, 8, 256, 0, swap_ab=True, epilogue="shared"),  # C^T staged as C, TMA-stored
    # swapped 72-row tiles in clusters: B multicast along M, A along N in slices of 36 or 18 rows, which are
    # not whole 8-row swizzle atoms (A stored transposed takes multiples of 16: refused, skipped)
    GemmConfig(72, 128, 64, 8, 256, 0, swap_ab=True, cluster=2, cluster_n=2, epilogue="shared"),
    GemmConfig(72, 128, 64, 6, 256, 0, swap_ab=True, cluster=2, cluster_n=4),
]
# (M, N, K): more tiles than resident CTAs (persistent), ragged everything, rows not 16-byte aligned
# (padded for TMA), decode
SHAPES = [(2048, 2048, 1024), (1000, 1000, 1000), (127, 255, 129), (16, 4096, 4096)]
VARIANTS = {  # name: (batch, trans_A, trans_B, bias, dtype, out_dtype)
    "plain": (1, False, False, False, torch.float16, torch.float16),
    "transposed+bias bf16": (1, True, True, True, torch.bfloat16, torch.bfloat16),
    "batched fp32 out": (3, False, True, False, torch.float16, torch.float32),
}


# operand layouts the three VARIANTS leave out, for the swapped kernel (whose two wgmma operands then are both
# MN-major, or A's tile is a broadcast over the batch)
MORE_VARIANTS = {
    "A^T only": (1, True, False, False, torch.float16, torch.float16),
    "batched B^T + bias": (2, False, True, True, torch.float16, torch.float16),
}


def _dt(t):
    return str(t)[6:]


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_gemm_config_on_hopper(cfg, shape, variant):
    if -(-shape[0] // cfg.block_M) % cfg.cluster or -(-shape[1] // cfg.block_N) % cfg.cluster_n:
        pytest.skip(f"cluster={cfg.cluster}x{cfg.cluster_n} does not divide the M x N tiles of this shape")
    if cfg.swap_ab and cfg.block_M % 16 and VARIANTS[variant][1]:
        with pytest.raises(ValueError, match="block_M a multiple of 16"):
            check(cfg, shape, variant, "sm_90a")
        return
    check(cfg, shape, variant, "sm_90a")


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("shape, cfg", [((1000, 700, 999), SM90A.half_wave_k128),
                                        ((1024, 1001, 1000), SM90A.half_wave_k128),
                                        ((1000, 700, 4000), SM90A.half_wave), ((1000, 1000, 200), SM90A.half_wave),
                                        ((768, 1024, 2048), SM90A.half_wave_lines_k128),
                                        ((960, 1024, 4096), SM90A.half_wave_lines)],
                         ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else None)
def test_half_wave_defaults_on_short_grids(shape, cfg, variant, pad):
    """Short grids default to 64x128 tiles (128-deep k-steps where K is 512-2048), in clustered pairs unless
    every row is whole 128-byte lines; rows that are not 16 bytes included: padded for TMA, or (pad=False)
    read by the synchronous-copy path."""
    assert default_config(*shape, "sm_90a") == cfg
    check(cfg, shape, variant, "sm_90a", pad)


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS) + list(MORE_VARIANTS))
@pytest.mark.parametrize("pad", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (1000, 1000, 4000), (1001, 1001, 512), (650, 1500, 1000),
                                   (1000, 1024, 2000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_swapped_2x4_default_on_unaligned_short_grids(shape, variant, pad):
    """Short grids whose rows are not whole lines launch cuBLAS's swapped 72x128 tiles in 2x4 clusters (each
    stage released on its 5 writers by one predicated arrive a warp); with A stored transposed (72 rows are
    not whole 16-column panels) the pairs; a batch of 2-3 refits the waves."""
    batch, ta, _, _, dtype, _ = {**VARIANTS, **MORE_VARIANTS}[variant]
    cfg = launch_config(*shape, _dt(dtype), batch, ta, arch="sm_90a")
    if batch == 1:
        assert (cfg == SM90A.swapped_2x4) == (not ta), cfg
    check(cfg, shape, variant, "sm_90a", pad)


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(2048, 2560, 1024), (2048, 2056, 1000), (1792, 2048, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_paired_128_default_over_more_than_a_wave(shape, variant):
    """More 128x128 tiles than SMs with an even M-tile count default to clustered pairs (B multicast),
    six stages, grid order; ragged N and K included."""
    assert default_config(*shape, "sm_90a") == SM90A.paired_128
    check(SM90A.paired_128, shape, variant, "sm_90a")


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(2048, 2048, 1024), (2048, 2048, 2048), (1920, 2040, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_one_wave_wide_default(shape, variant):
    """90-100 % of a wave of 128x256 tiles defaults to 4 stages, the output tile laid over them (one tile a
    CTA); a batch's grid is more than a wave, persistent, and stores directly; ragged N and K included."""
    assert default_config(*shape, "sm_90a") == SM90A.one_wave_wide
    check(SM90A.one_wave_wide, shape, variant, "sm_90a")


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape, cfg", [((1536, 2048, 2048), SM90A.wide_paired),
                                        ((1500, 2000, 2000), SM90A.wide_swapped), ((1152, 2048, 2048), SM90A.wide),
                                        ((2000, 1500, 2000), SM90A.wide_paired),
                                        ((777, 3001, 1234), SM90A.wide)],
                         ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else None)
def test_wide_default_where_it_fills_the_wave(shape, cfg, variant):
    """192-wide tiles where they fill one wave: swapped 192x128 ones where they are fewer and B's rows not whole
    lines (5 stages, the output tile laid over them), else 128x192 (in pairs where the M tiles pair up);
    777x3001x1234 also pads both operands' rows (and stores rows of 3001 without TMA)."""
    assert default_config(*shape, "sm_90a") == cfg
    check(cfg, shape, variant, "sm_90a")


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(16, 8192, 1024), (1, 4096, 4096), (5, 4095, 1000), (20, 8191, 96), (32, 14336, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_swapped_decode_default(shape, variant):
    """Up to 32 rows over >= 64 tiles of 64 columns default to the swapped kernel: rows and columns that do
    not fill its tile (stores guarded), B rows of 4095 or 8191 (padded for TMA where B is stored K x N),
    more tiles than one CTA an SM (8 stages, two an SM)."""
    cfg = default_config(*shape, "sm_90a", batch=VARIANTS[variant][0])
    assert cfg.swap_ab
    check(cfg, shape, variant, "sm_90a")


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("variant, broadcast", [("A^T only", None), ("batched B^T + bias", None),
                                                ("batched B^T + bias", "a"), ("batched B^T + bias", "b")])
@pytest.mark.parametrize("shape", [(16, 4096, 512), (24, 4104, 200)], ids=lambda s: "x".join(map(str, s)))
def test_swapped_decode_layouts_and_broadcast_operands(shape, variant, broadcast):
    """The swapped kernel with A stored transposed (both wgmma operands MN-major), and batched with one
    operand shared by the whole batch (its batch stride 0)."""
    cfg = default_config(*shape, "sm_90a", batch=MORE_VARIANTS[variant][0])
    assert cfg.swap_ab
    check(cfg, shape, variant, "sm_90a", batch_a=1 if broadcast == "a" else None,
          batch_b=1 if broadcast == "b" else None)


@pytest.mark.skipif(not HOPPER, reason="the sm_90a path needs an H100/H200")
@pytest.mark.parametrize("shape", [(127, 255, 129), (300, 1001, 777)], ids=lambda s: "x".join(map(str, s)))
def test_padded_operand_broadcast_over_the_batch(shape):
    """A batched A times one B (batch stride 0): each operand padded into a workspace of its own batch."""
    check(default_config(*shape, "sm_90a"), shape, "batched fp32 out", "sm_90a", batch_b=1)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("target", ["sm_90a", "sm_90"] if HOPPER else [None])
def test_default_configs_and_shared_epilogue_everywhere(shape, target):
    """The default config for the shape, and the shared epilogue on a non-TMA path (generic stores)."""
    check(default_config(*shape, target), shape, "plain", target)
    check(GemmConfig(128, 128, 32, 3, 128, 8, epilogue="shared"), shape, "transposed+bias bf16", target)


def check(cfg, shape, variant, target, pad=True, batch_b=None, batch_a=None):
    """``batch_b=1`` (``batch_a=1``): B (A) broadcast over the batch (one stored matrix, one padded workspace)."""
    M, N, K = shape
    batch, ta, tb, has_bias, dtype, out_dtype = {**VARIANTS, **MORE_VARIANTS}[variant]
    batch_a, batch_b = batch_a or batch, batch_b or batch
    kernel = build_gemm(M, N, K, batch, batch_a, batch_b, ta, tb, has_bias, _dt(dtype), _dt(out_dtype), cfg,
                        target=target, pad=pad)
    a = torch.randn(batch_a, *((K, M) if ta else (M, K)), device="cuda").to(dtype)
    b = torch.randn(batch_b, *((N, K) if tb else (K, N)), device="cuda").to(dtype)
    bias = (torch.randn(N, device="cuda") * K ** 0.5).to(dtype)  # as large as a @ b: a missing bias fails
    out = torch.full((batch, M, N), float("nan"), dtype=out_dtype, device="cuda")
    kernel.launch_ptrs([a.data_ptr(), b.data_ptr(), bias.data_ptr(), out.data_ptr()], a.device)
    torch.cuda.synchronize()
    a64, b64 = a.double(), b.double()
    ref = (a64.mT if ta else a64) @ (b64.mT if tb else b64) + (bias.double() if has_bias else 0)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], (cfg, shape, variant, err)
