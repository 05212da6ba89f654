"""Split-K gemm on the CPU: the two kernels build for both Hopper paths (sm_90a: TMA + wgmma; sm_90:
cp.async + mma.sync), their grids, parameters and instructions, the launch plumbing (with a fake
kernel pair), and that the heuristic does not split (the autotuner may).  GPU numerics: tests/test_gemm_splitk_gpu.py."""

import dataclasses
import re
import sys

import pytest
import torch

from tile_ops.compiler import compile_program
from tile_ops.jit.build import _find_tool
from tile_ops.kernels import gemm as gemm_programs
from tile_ops.kernels import gemm_defaults, gemm_launch, gemm_space
from tile_ops.kernels.gemm import gemm, split_k_tiles
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_defaults import default_config
from tile_ops.kernels.gemm_launch import PaddedGemm, SplitKGemm, build_gemm
from fake_kernels import FakeKernel, record_allocations

needs_nvcc = pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None, reason="nvcc not installed")
needs_cuobjdump = pytest.mark.skipif(_find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is None, reason="no cuobjdump")

HOPPER_CFG = GemmConfig(64, 128, 64, 6, 128, 0)  # the decode tile of default_config
AMPERE_CFG = GemmConfig(64, 128, 64, 4, 128, 0, "full_col")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _cfg(arch, split_k):
    return dataclasses.replace(HOPPER_CFG if arch == "sm_90a" else AMPERE_CFG, split_k=split_k)


def test_split_k_tiles_cover_k_and_leave_ragged_splits_short_or_empty():
    cfg = GemmConfig(64, 128, 64, split_k=3)
    assert split_k_tiles(8192, cfg) == 43  # 128 k-tiles: 43 + 43 + 42
    assert split_k_tiles(1000, cfg) == 6  # 16 k-tiles: 6 + 6 + 4
    cfg4 = dataclasses.replace(cfg, split_k=4)
    n = split_k_tiles(5 * 64, cfg4)  # 5 k-tiles over 4 splits: 2 + 2 + 1 + 0
    assert n == 2 and [max(0, min(5 - s * n, n)) for s in range(4)] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="split_k=0"):
        GemmConfig(split_k=0)


def test_split_k_1_is_the_plain_kernel():
    """split_k defaults to 1, and then the program (hence the CUDA source) is the gemm kernel of before."""
    assert GemmConfig().split_k == 1 and GemmConfig(64, 64, 64, 4, 128, 0) == GemmConfig(64, 64, 64, 4, 128, 0, "square", 1)
    c = compile_program(gemm.fn(16, 512, 512, 1, 1, 1, False, False, True, "float16", "float16", HOPPER_CFG), "sm_90a")
    assert c.meta.grid == (4, 1, 1) and [p[0] for p in c.meta.params] == ["A", "B", "Bias", "C"]
    assert c.meta.params[-1] == ("C", (1, 16, 512), "float16")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_90"])
@pytest.mark.parametrize("split_k,K", [(2, 4096), (3, 1000)])  # 1000: ragged K (16 k-tiles: 6 + 6 + 4, last partial)
def test_partial_kernel_has_the_split_grid_dim_and_writes_fp32_partials(arch, split_k, K):
    c = compile_program(gemm.fn(16, 1024, K, 1, 1, 1, False, False, True, "float16", "bfloat16", _cfg(arch, split_k)),
                        arch)
    assert c.meta.grid == (8, 1, split_k)  # N / 128 column tiles x split
    assert c.meta.params[-1] == ("W", (split_k, 1, 16, 1024), "float32") and "Bias" not in c.meta.kept  # bias: the reduction's
    src = c.source
    assert "float* __restrict__ W_ptr" in src and "*(float2*)(W_ptr + " in src  # fp32 partial tiles
    # the k loop's extent: this split's share of the k-tiles, n (even K: a constant, the compiler knows
    # blockIdx.z < split_k), or min(n, k-tiles left) clamped at zero (ragged K); it reads no memory
    n = split_k_tiles(K, _cfg(arch, split_k))
    loops = re.findall(r"for \(int k\w* = 0; k\w* < ([^;]+);", src)
    if K % (64 * split_k) == 0:
        assert loops and set(loops) == {str(n)}, loops
    else:
        assert loops and all("blockIdx.z" in e and "max(" in e and f"* {n}" in e for e in loops), (n, loops)
    assert f"blockIdx.z) * {n * 64})" in src  # the split's first k-tile: split * n * block_K
    if arch == "sm_90a":
        assert "cp.async.bulk.tensor" in src and "wgmma.mma_async" in src and c.meta.tensormaps
    else:
        assert "cp.async.cg.shared.global" in src and "mma.sync.aligned" in src


@pytest.mark.parametrize("arch", ["sm_90a", "sm_90"])
def test_reduce_kernel_sums_splits_adds_bias_and_casts(arch):
    c = compile_program(gemm_programs.gemm_splitk_reduce.fn(37, 3000, 1, 3, True, "float16", "bfloat16", 64, 64, 128),
                        arch)
    assert c.meta.grid == (47, 1, 1) and c.meta.block == (128, 1, 1)  # no producer warpgroup: nothing pipelined
    assert [p[0] for p in c.meta.params] == ["W", "Bias", "C"] and c.meta.params[0] == ("W", (3, 1, 37, 3000), "float32")
    src = c.source
    assert "*(float4*)(W_ptr + " in src and "nv_bfloat16* __restrict__ C_ptr" in src
    assert "+ 111000)" in src and "+ 222000)" in src  # splits 1 and 2: 37 * 3000 floats apart
    assert "wgmma" not in src and "mma.sync" not in src


def test_reduce_tile_gives_decode_reductions_many_ctas():
    assert gemm_programs.reduce_tile(16, 8192) == (16, 64, 128)  # 128 CTAs for 16 x 8192
    assert gemm_programs.reduce_tile(1, 4096) == (16, 64, 128)
    assert gemm_programs.reduce_tile(37, 1000) == (64, 64, 128)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("arch", ["sm_90a", "sm_90"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_gemm_builds_and_its_sass_has_the_intended_instructions(arch, split_k):
    K = 4096 if split_k == 2 else 1000
    k = build_gemm(16, 1024, K, 1, 1, 1, False, False, True, "float16", "float16", _cfg(arch, split_k), target=arch)
    k, dims = k.launchable, k.dims  # M at run time
    assert isinstance(k, SplitKGemm) and k.meta is k.partial.meta and k.cubin == k.partial.cubin
    assert k.meta.grid == (8, "((M + 63) // 64)", split_k) and k.workspace_shape(dims) == (split_k, 1, 16, 1024)
    assert k.reduce.meta.grid == (16, "((M + 15) // 16)", 1) and k.reduce.meta.params[0][1] == (split_k, 1, "M", 1024)
    mix = k.instruction_mix()
    if arch == "sm_90a":
        assert mix.get("HGMMA", 0) > 0 and mix.get("UTMALDG", 0) > 0 and mix.get("SYNCS", 0) > 0
        assert k.meta.block == (256, 1, 1)  # 128 consumers + the TMA producer warpgroup
    else:
        assert mix.get("HMMA", 0) > 0 and mix.get("LDGSTS", 0) > 0 and mix.get("HGMMA", 0) == 0
    rmix = k.reduce.instruction_mix()
    assert rmix.get("FADD", 0) > 0 and not any(op in rmix for op in ("HMMA", "HGMMA"))
    for kern in (k.partial, k.reduce):
        assert kern.meta.resources["spill_stores"] == 0 and kern.meta.arch == arch


@needs_nvcc
def test_batched_split_gemm_folds_batch_and_split_into_z():
    cfg = GemmConfig(64, 64, 64, 4, 128, 0, split_k=2)
    k = build_gemm(20, 192, 300, 3, 3, 1, True, False, False, "float16", "float16", cfg, target="sm_90a")
    assert isinstance(k, PaddedGemm) and isinstance(k.main, SplitKGemm)  # A^T's rows of 20 halves: padded, per M
    assert k.meta.grid == (3, 1, 6) and k.main.workspace_shape() == (2, 3, 20, 192)
    assert k.main.reduce.meta.grid == (3, 1, 3)
    with pytest.raises(AttributeError, match="PaddedGemm has no 'reduce'"):  # only descriptions are forwarded
        k.reduce
    with pytest.raises(AttributeError, match="SplitKGemm has no 'launch'"):  # never a partial launch
        k.main.launch
    assert build_gemm(20, 192, 300, 3, 3, 1, True, False, False, "float16", "float16",
                      dataclasses.replace(cfg, split_k=1), target="sm_90a").meta.grid == (3, 1, 3)


# ----------------------------------------------------------------------------- launching both kernels


def test_split_gemm_launches_partials_then_reduction_through_one_workspace(monkeypatch):
    log = []
    partial = FakeKernel([("A", (1, 16, 64), "float16"), ("B", (1, 64, 32), "float16"), ("Bias", (32,), "float16"),
                          ("W", (3, 1, 16, 32), "float32")], log, "partial")
    reduce = FakeKernel([("W", (3, 1, 16, 32), "float32"), ("Bias", (32,), "float16"),
                         ("C", (1, 16, 32), "float16")], log, "reduce")
    allocs = record_allocations(monkeypatch, gemm_launch)
    k = SplitKGemm(partial, reduce)
    launch = gemm_launch.gemm_launcher(k, torch.device("cpu"))
    launch(0x100, 0x200, 0x300)  # no bias: its slot gets the output pointer (unread)
    launch(0x100, 0x200, 0x300, 0x400)
    (shape, dtype, w0), (_, _, w1) = allocs
    assert shape == (3, 1, 16, 32) and dtype == torch.float32
    cpu = torch.device("cpu")
    assert log == [("partial", [0x100, 0x200, 0x300, w0], cpu), ("reduce", [w0, 0x300, 0x300], cpu),
                   ("partial", [0x100, 0x200, 0x400, w1], cpu), ("reduce", [w1, 0x400, 0x300], cpu)]
    # the reduction launches while the partials run and waits for them at its entry (Kernel.dependent);
    # after a PaddedGemm's pads, both do
    assert (k.partial.programmatic, k.reduce.programmatic) == (False, True)
    assert (k.dependent().partial.programmatic, k.dependent().reduce.programmatic) == (True, True)


def test_get_gemm_kernel_builds_the_split_pair_for_a_split_config(monkeypatch):
    built = []
    monkeypatch.setattr(gemm_launch, "gemm", lambda *args, target=None, **_: built.append(("gemm", args)) or
                        FakeKernel([("W", (args[-1].split_k, args[3], "M", args[1]), "float32")], [], "p",
                                   dims=[("M", 1)]))
    monkeypatch.setattr(gemm_launch, "gemm_splitk_reduce", lambda *args, target=None, bias_dtype=None:
                        built.append(("reduce", args)) or FakeKernel([], [], "r"))
    a, b, out = torch.zeros(1, 16, 4096, dtype=torch.float16), torch.zeros(1, 4096, 256, dtype=torch.float16), \
        torch.zeros(1, 16, 256, dtype=torch.float16)
    k, _, _ = gemm_launch.get_gemm_kernel(a, b, out, cfg=GemmConfig(64, 128, 64, 6, 128, 0, split_k=4))
    assert isinstance(k.launchable, SplitKGemm) and k.dims == (16,)  # M at run time, bound to 16
    assert k.launchable.workspace_shape(k.dims) == (4, 1, 16, 256)
    assert built[1] == ("reduce", (None, 256, 1, 4, False, "float16", "float16", 16, 64, 128))
    built.clear()
    k, _, _ = gemm_launch.get_gemm_kernel(a, b, out, cfg=GemmConfig(64, 128, 64, 6, 128, 0))
    assert isinstance(k.launchable, FakeKernel) and [b[0] for b in built] == ["gemm"]
    # a split chosen per (M, N, K) by config_for is divided by the batch count (the batch fills the grid)
    monkeypatch.setattr(gemm_launch, "config_for", lambda *a, **k: GemmConfig(64, 128, 64, 6, 128, 0, split_k=4))
    built.clear()
    gemm_launch.get_gemm_kernel(a.expand(2, 16, 4096), b.expand(2, 4096, 256), out.expand(2, 16, 256).contiguous())
    assert built[0][1][-1].split_k == 2
    built.clear()
    gemm_launch.get_gemm_kernel(a.expand(8, 16, 4096), b.expand(8, 4096, 256), out.expand(8, 16, 256).contiguous())
    assert built[0][1][-1].split_k == 1 and len(built) == 1


# ----------------------------------------------------------------------------- the heuristic and the space


@pytest.mark.parametrize("shape, split", [
    ((4096, 4096, 4096), 1), ((1000, 1000, 1000), 1), ((8192, 1024, 8192), 1), ((128, 8192, 8192), 1),
    ((48, 4096, 4096), 4), ((16, 2048, 8192), 4), ((40, 1024, 8192), 4), ((16, 256, 1024), 2), ((1, 64, 8), 1)])
def test_default_config_splits_only_short_decode_grids(shape, split):
    """Decode (M <= 64) with neither a swapped grid (<= 32 rows over >= 64 tiles of 64 columns) nor a nearly
    full wave of unsplit tiles: 64x256 tiles, K split in 2 or 4 while the grid stays within one wave of 132
    SMs and every split keeps >= 8 k-steps of 64; everything else is unsplit."""
    M, N, K = shape
    cfg = default_config(M, N, K, "sm_90a")
    assert cfg.split_k == split and (not cfg.swap_ab or M > 64)  # swapped: short grids' 2x4 clusters
    if M <= 64:
        assert (cfg.block_M, cfg.block_N) == (64, 256)
        assert -(-N // 256) * split <= 132 or split == 1
        assert K // 64 >= 8 * split or split == 1


@pytest.mark.parametrize("shape, tile", [
    ((64, 8192, 8192), (64, 64, 128, 6)), ((33, 6400, 4096), (64, 64, 128, 6)),  # 128 and 100 tiles of 64 columns
    ((64, 14336, 4096), (64, 128, 64, 8)), ((48, 12800, 4096), (64, 128, 64, 8))])  # 112 and 100 tiles of 128
def test_decode_takes_unsplit_tiles_that_make_one_wave(shape, tile):
    """33-64 rows: 64x64 or 64x128 tiles, unsplit, where they make 100-132 CTAs: no partials and no second
    kernel."""
    cfg = default_config(*shape, "sm_90a")
    assert (cfg.block_M, cfg.block_N, cfg.block_K, cfg.num_stages, cfg.split_k, cfg.swap_ab) == (*tile, 1, False)


@pytest.mark.parametrize("shape, batch, tile, split", [
    ((16, 14336, 4096), 2, (16, 64, 64, 8), 1),  # 448 swapped tiles: two CTAs an SM, 8 stages each
    ((64, 8192, 8192), 2, (64, 128, 64, 8), 1),  # 256 of 64x64, 128 of 64x128
    ((16, 8192, 8192), 2, (16, 64, 64, 8), 1),  # one matrix: 128 swapped tiles, 16 stages
    ((16, 2048, 4096), 2, (16, 64, 64, 16), 1),  # one matrix: 32 tiles of 64 columns, the split pair
    ((48, 4096, 4096), 2, (64, 64, 128, 6), 1),  # one matrix: 64 tiles of 64x64, the split pair; two: 128
    ((48, 2048, 4096), 2, (64, 256, 64, 4), 4),  # 16 tiles of 64x256, split in 4
    ((48, 1792, 4096), 8, (64, 128, 64, 8), 1)])  # 224 of 64x64, 112 of 64x128
def test_decode_tiles_count_the_batch(shape, batch, tile, split, monkeypatch):
    """The decode defaults count batch x N tiles against the wave, and the op re-derives its heuristic
    default for a batch (config_for fits one matrix)."""
    cfg = default_config(*shape, "sm_90a", batch=batch)
    assert (cfg.block_M, cfg.block_N, cfg.block_K, cfg.num_stages, cfg.split_k) == (*tile, split)
    seen = []
    monkeypatch.setattr(gemm_launch, "build_gemm", lambda *args, **kw: seen.append(kw["cfg"]))
    monkeypatch.setattr(gemm_launch, "config_for", lambda *a, **k: default_config(*shape, "sm_90a"))
    for module in (gemm_defaults, gemm_launch):
        monkeypatch.setattr(module, "default_arch", lambda: "sm_90a")
    M, N, K = shape
    a, b = torch.zeros(batch, M, K, dtype=torch.float16), torch.zeros(batch, K, N, dtype=torch.float16)
    gemm_launch.get_gemm_kernel(a, b, torch.zeros(batch, M, N, dtype=torch.float16))
    assert seen == [cfg]


@pytest.mark.parametrize("shape, default", [
    ((2048, 2048, 2048), "one_wave_wide"), ((2048, 2048, 2044), "one_wave_wide"),
    ((1920, 2048, 512), "one_wave_wide"),
    ((1024, 4096, 4096), "one_wave_wide"), ((1792, 2048, 2048), "paired_128"), ((2048, 2560, 2048), "paired_128"),
    ((1024, 2048, 4096), None), ((1536, 2048, 2048), "wide_paired"), ((1500, 2000, 2000), "wide_swapped"),
    ((1152, 2048, 2048), "wide"), ((2000, 1500, 2000), "wide_paired"), ((2000, 3000, 1000), "wide_paired"),
    ((777, 3001, 1234), "wide"), ((4096, 4096, 4096), None),
    ((1000, 1000, 1000), "swapped_2x4"), ((1000, 1000, 999), "swapped_2x4"), ((1000, 1000, 512), "swapped_2x4"),
    ((1000, 1000, 4000), "swapped_2x4"), ((1001, 1001, 2048), "swapped_2x4"), ((1000, 1000, 511), "half_wave"),
    ((1000, 1000, 256), "half_wave"), ((1000, 700, 1000), "half_wave_k128"), ((1000, 700, 2048), "half_wave_k128"),
    ((1000, 700, 2049), "half_wave"), ((1000, 700, 4000), "half_wave"), ((700, 1000, 1000), None),
    ((650, 1500, 1000), "swapped_2x4"), ((512, 2000, 1024), "half_wave_k128"), ((512, 2048, 4000), "half_wave"),
    ((1024, 1024, 4096), "half_wave_lines"), ((1024, 1024, 1024), "half_wave_lines_k128"),
    ((768, 1024, 2048), "half_wave_lines_k128"), ((1024, 1024, 256), "half_wave_lines"),
    ((1024, 1024, 4000), "half_wave"), ((1024, 1000, 1024), "half_wave_k128"),
    ((960, 1024, 1024), "half_wave_lines_k128"),
    ((900, 1024, 1024), None)])
def test_default_tiles_fit_the_waves(shape, default):
    """128x256 tiles in 4 stages where they make 90-100 % of a wave (2048^2: 128; 1792x2048: 112 do not);
    128x128 tiles in clustered pairs where there are more of them than SMs (1024x2048: 128, one wave,
    stays unclustered); 192-wide tiles where they fill one wave and 128x128 or 128x256 ones would leave
    most of a second idle (1536x2048: 132 against 192 of 128x128; 2000x3000: 256 against 192 of 128x256):
    swapped 192x128 ones where they are fewer, one wave and B's rows not whole 128-byte lines (1500x2000: 128
    against 132; not 1536x2048, whose rows are, nor 2000x1500: 132 against 128, nor 2000x3000: 264), else
    128x192 paired where the M tiles pair up (1152's 9 and 777's 7 do not); short grids in pairs of 64-row
    tiles, 128-deep k-steps where K is 512-2048, unclustered where M, N and K are multiples of 64 (every row
    whole 128-byte lines, however A and B are stored: 960's 15 row tiles too; 900's 15 do not pair, so 128x128
    tiles); elsewhere swapped 72x128 tiles in 2x4 clusters where they make 3/4 of a wave to a whole one and K >=
    512 (1000x700's 6 column tiles and 1024x1000's 15 row tiles of 72 do not divide into clusters; 700x1000
    makes 80 CTAs; 512x2000's 16 clusters of 8 are one more than an H200 holds at once, 650x1500's 15 are not);
    rows that are not 16 bytes (2044, 999, 1001) change nothing: build_gemm pads them for TMA."""
    cfg = default_config(*shape, "sm_90a")
    if default is None:
        assert cfg in gemm_defaults.SM90A.tiles
        return
    assert cfg == getattr(gemm_defaults.SM90A, default)
    if default != "wide":
        clustered = {"paired_128", "wide_paired", "swapped_2x4", "half_wave", "half_wave_k128"}
        assert (cfg.cluster, cfg.epilogue) == (2 if default in clustered else 1, "shared")
    assert cfg in gemm_space.config_space(*shape, arch="sm_90a")  # the tuner measures it too


def test_default_configs_count_waves_on_the_gpus_sms(monkeypatch):
    """The sm_90a heuristics fill the SMs of the GPU they run on: an H100 PCIe has 114, where 112 tiles of
    128x256 (1792x2048) make one nearly full wave and 128 (2048^2) more than one; with no sm_90a GPU (none, or
    an A100) they count the 132 of the H100 SXM / H200 the defaults were fitted on."""
    import types

    jit = sys.modules["tile_ops.jit"]  # the package (tile_ops.jit the attribute is the decorator)

    def gpu(arch, sms):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: arch is not None)
        monkeypatch.setattr(jit, "default_arch", lambda: arch)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(multi_processor_count=sms))

    wide = gemm_defaults.SM90A.one_wave_wide
    for arch, sms in ((None, 0), ("sm_80", 108), ("sm_90a", 132)):
        gpu(arch, sms)
        assert jit.build_target("sm_90a").sms == 132, arch
        assert default_config(2048, 2048, 2048, "sm_90a") == wide and default_config(1792, 2048, 2048, "sm_90a") != wide
    gpu("sm_90a", 114)
    assert jit.build_target("sm_90a").sms == 114
    assert default_config(2048, 2048, 2048, "sm_90a") != wide and default_config(1792, 2048, 2048, "sm_90a") == wide


def test_get_gemm_kernel_refits_wave_defaults_to_a_batch(monkeypatch):
    built = []
    monkeypatch.setattr(gemm_launch, "gemm",
                        lambda *args, target=None, **_: built.append(args[-1]) or FakeKernel([], [], "p"))
    monkeypatch.setattr(gemm_launch, "config_for", lambda op, M, N, K, *a, **k: default_config(M, N, K, "sm_90a"))
    for module in (gemm_defaults, gemm_launch):  # whatever GPU this host has
        monkeypatch.setattr(module, "default_arch", lambda: "sm_90a")
    a, b = torch.zeros(1, 1000, 1000, dtype=torch.float16), torch.zeros(1, 1000, 1000, dtype=torch.float16)
    gemm_launch.get_gemm_kernel(a, b, a)
    gemm_launch.get_gemm_kernel(a.expand(3, -1, -1), b.expand(3, -1, -1), a.expand(3, -1, -1).contiguous())
    # three 1000x1000 matrices: 192 tiles of 128x128, more than a wave, so the 128x128 pairs
    assert built[0] == gemm_defaults.SM90A.swapped_2x4 and built[1] == gemm_defaults.SM90A.paired_128
    # one 1536x2048 matrix fills a wave of 128x192 tiles; three fill 3 waves of them, or 4.4 of 128x128 pairs
    a, b = torch.zeros(3, 1536, 2048, dtype=torch.float16), torch.zeros(3, 2048, 2048, dtype=torch.float16)
    gemm_launch.get_gemm_kernel(a[:1], b[:1], torch.empty(1, 1536, 2048, dtype=torch.float16))
    gemm_launch.get_gemm_kernel(a, b, torch.empty(3, 1536, 2048, dtype=torch.float16))
    assert built[2] == gemm_defaults.SM90A.wide_paired and built[3] == gemm_defaults.SM90A.paired_128


def test_hopper_decode_space_offers_split_k():
    decode = [c for c in gemm_space.config_space(16, 8192, 8192, arch="sm_90a") if not c.swap_ab]
    assert {c.split_k for c in decode} == {1, 2, 4}
    assert len({dataclasses.replace(c, split_k=1) for c in decode}) * 3 == len(decode)
    assert {c.split_k for c in gemm_space.config_space(4096, 4096, 4096, arch="sm_90a")} == {1}
    assert {c.split_k for c in gemm_space.config_space(16, 8192, 8192, arch="sm_90")} == {1}
    assert {c.split_k for c in gemm_space.config_space(16, 256, 128, arch="sm_90a")} == {1}  # 1-2 k-tiles


def test_a_table_entry_written_before_split_k_loads_unsplit():
    from tile_ops import autotune

    old = {"block_M": 64, "block_N": 128, "block_K": 64, "num_stages": 6, "threads": 128, "swizzle": 0,
           "policy": "square"}
    assert autotune.config_from_dict("gemm", old) == HOPPER_CFG and HOPPER_CFG.split_k == 1
    split = dataclasses.replace(HOPPER_CFG, split_k=4)
    assert autotune.config_from_dict("gemm", autotune.config_to_dict(split)) == split


@needs_nvcc
def test_the_tuner_builds_and_times_split_configs_as_one_launchable(tmp_path):
    from tile_ops import autotune

    autotune.reload()
    shape, seen = (16, 1024, 4096), {}
    split = dataclasses.replace(HOPPER_CFG, split_k=2)

    def fake_measure(kernel, cfg):
        seen[cfg] = kernel
        return 1.0 if cfg == split else 2.0

    result = autotune.tune("gemm", shape, "float16", configs=[HOPPER_CFG, split], arch="sm_90a",
                           measure=fake_measure, gpu="FAKE GPU", show_progress=False)
    assert isinstance(seen[split].launchable, SplitKGemm) and seen[split].meta.grid[::2] == (8, 2)
    assert not isinstance(seen[HOPPER_CFG].launchable, SplitKGemm)
    assert result.best.config == split
    assert autotune.lookup("gemm", shape, "float16", "FAKE GPU") == split
    autotune.reload()


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_bias_is_read_in_its_own_dtype(arch, split_k):
    """A bias in the output dtype (fp32 beside fp16 inputs) is a float parameter of whichever kernel adds it:
    cast to fp16 first, 1e5 would be inf and 1000.3 would lose its fraction."""
    cfg = dataclasses.replace(default_config(16, 1024, 4096, arch), split_k=split_k)
    k = build_gemm(16, 1024, 4096, 1, 1, 1, False, False, True, "float16", "float32", cfg, target=arch,
                   bias_dtype="float32")
    adder = k.reduce if split_k > 1 else k
    assert dict((name, dt) for name, _, dt in adder.meta.params)["Bias"] == "float32"
    assert "float* __restrict__ Bias_ptr" in adder.source or "float* Bias_ptr" in adder.source
    same = build_gemm(16, 1024, 4096, 1, 1, 1, False, False, True, "float16", "float32", cfg, target=arch,
                      bias_dtype="float16")  # the input dtype, said or not: one kernel
    assert same.cubin == build_gemm(16, 1024, 4096, 1, 1, 1, False, False, True, "float16", "float32", cfg,
                                    target=arch).cubin
