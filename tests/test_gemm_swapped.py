"""The swapped decode gemm (``GemmConfig(swap_ab=True)``: C^T = B^T A^T) on the CPU: what the config accepts,
which shapes default to it, and what its sm_90a kernel is made of (wgmma m64 along N with M along its n,
TMA loads of both operands, no spills).  GPU numerics: tests/test_gemm_configs_gpu.py."""

import dataclasses
import re

import pytest

from tile_ops.compiler.meta import evaluate
from tile_ops.jit.build import _find_tool
from tile_ops.kernels import gemm_defaults, gemm_launch
from tile_ops.kernels.gemm_config import GemmConfig, shared_memory_bytes
from tile_ops.kernels.gemm_defaults import default_config
from tile_ops.kernels.gemm_launch import build_gemm
from tile_ops.kernels.gemm_space import config_space

needs_nvcc = pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None, reason="nvcc not installed")
needs_cuobjdump = pytest.mark.skipif(_find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is None, reason="no cuobjdump")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def swapped(block_M=16, block_N=64, block_K=64, stages=16, **kw):
    return GemmConfig(block_M, block_N, block_K, stages, 2 * block_N, 0, swap_ab=True, **kw)


@pytest.mark.parametrize("kw, what", [
    (dict(block_N=96, threads=192), "block_N=96 (a multiple of 64 up to 256"),
    (dict(block_N=512, threads=1024), "block_N=512 (a multiple of 64 up to 256"),
    (dict(block_M=8), "block_M=8 (a multiple of 8 from 16 to 256"), (dict(block_M=20), "block_M=20"),
    (dict(block_M=512), "block_M=512"), (dict(threads=256), "threads=256 (2 * block_N)"),
    (dict(split_k=2), "split_k=2 (the swapped kernel takes only 1)"), (dict(stream_k=2), "stream_k=2"),
    (dict(policy="full_col"), "policy='full_col'"), (dict(pingpong=True), "pingpong=True")])
def test_swapped_config_refuses_what_its_kernel_cannot_do(kw, what):
    """Each refusal names the offending field and value, and only those."""
    base = dict(block_M=16, block_N=64, block_K=64, num_stages=8, threads=128, swizzle=0, swap_ab=True)
    with pytest.raises(ValueError, match=r"GemmConfig\(swap_ab=True\)") as e:
        GemmConfig(**{**base, **kw})
    assert what in str(e.value) and str(e.value).count(";") == 0, str(e.value)
    GemmConfig(**base)  # the base itself is accepted


@pytest.mark.parametrize("shape, block_M, stages", [
    ((16, 8192, 8192), 16, 16), ((1, 4096, 4096), 16, 16), ((5, 4095, 4096), 16, 16), ((20, 8192, 8192), 32, 16),
    ((32, 8192, 28672), 32, 16), ((16, 14336, 4096), 16, 8), ((16, 128256, 4096), 16, 8)])
def test_up_to_32_rows_over_64_tiles_of_64_columns_default_to_the_swapped_kernel(shape, block_M, stages):
    """M rounds up to wgmma's n (16 or 32: a 16-column A^T tile is still a 32-byte swizzled panel); 16 stages where one CTA an SM holds them (<= 132 tiles),
    8 where two CTAs an SM share it."""
    cfg = default_config(*shape, "sm_90a")
    assert cfg == swapped(block_M, 64, 64, stages, b_evict_first=True)
    assert shared_memory_bytes(cfg, *shape) <= (227 if stages == 16 else 113) * 1024
    assert cfg in config_space(*shape, arch="sm_90a")  # the tuner measures it too


@pytest.mark.parametrize("shape", [(16, 4032, 4096), (33, 8192, 8192), (64, 8192, 8192), (16, 8192, 8192, "sm_90")])
def test_the_swapped_kernel_is_not_the_default_elsewhere(shape):
    """Fewer than 64 tiles of 64 columns (the split pair fills the SMs better), more than 32 rows, or the
    Ampere-class path."""
    *mnk, arch = shape if len(shape) == 4 else (*shape, "sm_90a")
    assert not default_config(*mnk, arch).swap_ab


def test_tuner_space_offers_swapped_tiles_that_fit_shared_memory():
    space = [c for c in config_space(16, 8192, 8192, arch="sm_90a") if c.swap_ab]
    assert {(c.block_M, c.block_N) for c in space} == {(16, 64), (16, 128)}
    assert all(shared_memory_bytes(c, 16, 8192, 8192) <= 227 * 1024 for c in space)
    assert not any(c.swap_ab for c in config_space(64, 8192, 8192, arch="sm_90a"))


@needs_nvcc
@needs_cuobjdump
def grid_at(kernel, M) -> tuple:
    """The kernel's launch grid at M (a grid of M tiles is an expression of M: the kernels take it at run time)."""
    return tuple(evaluate(g, {"M": M}) for g in kernel.meta.grid)


@pytest.mark.parametrize("shape, trans_A, trans_B, cfg, n", [
    ((16, 8192, 8192), False, True, swapped(), 16),  # nn.Linear's weight: B stored N x K, K-major for wgmma's A
    ((16, 8192, 8192), False, False, swapped(), 16),  # B stored K x N: wgmma's A read MN-major
    ((1, 1000, 200), True, False, swapped(16, 64, 64, 8), 16),  # ragged, A^T stored (its 1-wide rows padded)
    ((24, 1000, 200), True, True, swapped(32, 64, 64, 8), 32),
    ((32, 14336, 4096), False, True, swapped(32, 128, 64, 8), 32)])  # two consumer warpgroups along N
def test_swapped_kernel_is_wgmma_along_n_with_tma_loads(shape, trans_A, trans_B, cfg, n):
    M, N, K = shape
    k = build_gemm(M, N, K, 1, 1, 1, trans_A, trans_B, True, "float16", "float16", cfg, target="sm_90a")
    main = getattr(k, "main", k)  # a PaddedGemm pads A's rows first
    assert set(re.findall(r"HGMMA\.\w+", main.sass())) == {f"HGMMA.64x{n}x16"}
    mix = main.instruction_mix()
    assert mix.get("UTMALDG", 0) > 0 and mix.get("SYNCS", 0) > 0 and main.meta.resources["spill_stores"] == 0
    assert grid_at(main, M) == (-(-N // cfg.block_N), -(-M // cfg.block_M), 1)
    assert main.meta.block == (cfg.threads + 128, 1, 1)  # the consumers + the TMA producer warpgroup
    # the transposed tile is stored from registers, each element guarded (M and N need not fill it)
    assert mix.get("UTMASTG", 0) == 0 and mix.get("STG", 0) > 0


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("shape, arch", [((16, 8192, 8192), "sm_90a"), ((64, 8192, 8192), "sm_90a"),
                                         ((16, 2048, 8192), "sm_90a"), ((16, 8192, 8192), "sm_80")])
def test_decode_defaults_read_b_evict_first(shape, arch):
    """Decode's one M tile reads each of B's tiles once: every decode default (swapped, 64x64, split K) loads
    them with an L2 evict_first policy, so the weights streaming through leave the L2's other lines in
    place.  In the SASS the policy is an operand of B's loads (desc[...]: UTMALDG on sm_90a, LDGSTS on
    sm_80), of no other."""
    cfg = default_config(*shape, arch)
    if arch == "sm_80":  # not its default (unmeasured there): the same config with B hinted
        cfg = dataclasses.replace(cfg, b_evict_first=True)
    assert cfg.b_evict_first
    k = build_gemm(*shape, cfg=cfg, target=arch)
    main = getattr(k, "partial", k)
    assert "createpolicy.fractional.L2::evict_first.b64" in main.source
    load = "UTMALDG" if arch == "sm_90a" else "LDGSTS"
    loads = [line for line in main.sass().splitlines() if load in line]
    hinted = [line for line in loads if "desc[" in line]
    assert 0 < len(hinted) < len(loads), loads  # B's loads carry the policy, A's do not
    unhinted = build_gemm(*shape, cfg=dataclasses.replace(cfg, b_evict_first=False), target=arch)
    assert "desc[" not in "".join(line for line in getattr(unhinted, "partial", unhinted).sass().splitlines()
                                  if load in line)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("cluster, cluster_n, a_rows, b_rows", [(2, 1, 72, 32), (2, 2, 36, 32), (2, 4, 18, 32),
                                                               (1, 4, 18, 64)])
def test_swapped_kernel_in_clusters_multicasts_row_slices(cluster, cluster_n, a_rows, b_rows):
    """72x128 swapped tiles (cuBLAS's 1000^3 tile): grid x runs over the M tiles in clusters; B's tile is
    multicast along M and A's along N, each block loading 1/n of its rows. 72 rows split into 36 or 18:
    slices need not be whole 8-row swizzle atoms, only 128-byte aligned (TMA swizzles by address)."""
    cfg = swapped(72, 128, 64, 6, cluster=cluster, cluster_n=cluster_n, epilogue="shared")
    k = build_gemm(1000, 1000, 1000, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_90a")
    boxes = {t["tensor"]: t["box"][1] for t in k.meta.tensormaps.values() if t["tensor"] in "AB"}
    assert boxes == {"A": a_rows, "B": b_rows}
    assert grid_at(k, 1000) == (14, 8, 1) and f"__cluster_dims__({cluster}, {cluster_n}, 1)" in k.source
    mix = k.instruction_mix()
    assert set(re.findall(r"HGMMA\.\w+", k.sass())) == {"HGMMA.64x72x16"} and k.meta.resources["spill_stores"] == 0
    assert mix.get("UTMASTG", 0) > 0 and mix.get("STG", 0) == 0  # the staged epilogue: C^T written as C, TMA-stored


def test_swapped_72_row_tiles_refuse_a_stored_transposed():
    """A^T's tile is read in 16-column panels: 72 rows do not make whole panels; the error says so."""
    with pytest.raises(ValueError, match="block_M a multiple of 16"):
        build_gemm(1000, 1000, 1000, 1, 1, 1, True, False, False, "float16", "float16", swapped(72, 128, 64, 6),
                   target="sm_90a")


def test_op_refits_a_swapped_default_to_the_batch(monkeypatch):
    """Two 16x8192 matrices make 256 swapped tiles: 8 stages for two CTAs an SM, not one matrix's 16
    (the op's config_for fits one matrix)."""
    import torch

    seen = []
    monkeypatch.setattr(gemm_launch, "build_gemm", lambda *args, **kw: seen.append(kw["cfg"]))
    monkeypatch.setattr(gemm_launch, "config_for", lambda op, M, N, K, *a, **k: default_config(M, N, K, "sm_90a"))
    for module in (gemm_defaults, gemm_launch):  # whatever GPU this host has
        monkeypatch.setattr(module, "default_arch", lambda: "sm_90a")
    a, b = torch.zeros(2, 16, 8192, dtype=torch.float16), torch.zeros(2, 8192, 8192, dtype=torch.float16)
    gemm_launch.get_gemm_kernel(a[:1], b[:1], torch.zeros(1, 16, 8192, dtype=torch.float16))
    gemm_launch.get_gemm_kernel(a, b, torch.zeros(2, 16, 8192, dtype=torch.float16))
    assert seen == [swapped(16, 64, 64, 16, b_evict_first=True), swapped(16, 64, 64, 8, b_evict_first=True)]
