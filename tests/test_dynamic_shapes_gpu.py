"""Runtime M on the GPU (auto-skipped without CUDA): the ops at 100 random token counts, each correct against
float64 with its output poisoned first, and the kernels they compiled counted: one per config chosen, none per
M; a T.dynamic program launched directly at several M."""

import os
import random

import pytest
import torch

import tile_ops
from programs import matmul_any_m

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _poison(nbytes=256 << 20):
    """Freed allocator memory filled with NaN: an output element the kernel does not write shows."""
    t = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del t


def _kernels_in_cache() -> int:
    return sum("meta.json" in files for _, _, files in os.walk(os.environ["TILE_OPS_CACHE_DIR"]))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_at_100_random_m_matches_float64_with_one_kernel_per_config(dtype, fresh_cache):
    from tile_ops.kernels.gemm_config import _epilogue_overlaid
    from tile_ops.kernels.gemm_launch import launch_config

    N, K = 1024, 768
    w = torch.randn(N, K, device="cuda").to(dtype)
    chosen = set()
    for M in random.Random(41).sample(range(1, 16385), 100):
        x = torch.randn(M, K, device="cuda").to(dtype)
        _poison()
        out = tile_ops.gemm(x, w.t())
        err = _rel_err(out, x.double() @ w.double().t())
        assert err < 1e-2, (M, err)
        cfg = launch_config(M, N, K, str(dtype)[6:], trans_A=False)
        chosen.add((cfg, _epilogue_overlaid(cfg, M, N)))
    kernels = sum(1 + (cfg.split_k > 1) for cfg, _ in chosen)
    print(f"gemm {dtype}: 100 M, {len(chosen)} configs chosen, {_kernels_in_cache()} kernels compiled")
    assert _kernels_in_cache() == kernels


def test_gemm_softmax_at_random_m_matches_float64(fresh_cache):
    N, K = 2048, 256
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    for M in random.Random(7).sample(range(1, 9000), 12):
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        _poison()
        out = tile_ops.gemm_softmax(a, b, 0.125)
        ref = torch.softmax(a.double() @ b.double() * 0.125, -1)
        assert _rel_err(out, ref) < 5e-3, M
    assert _kernels_in_cache() <= 3


@pytest.mark.parametrize("path", ["cp.async", "tma"])
def test_a_dynamic_program_launches_at_several_m(path, fresh_cache):
    """One kernel of tests/programs.py, called at M smaller than a tile, ragged, and over many waves, on both
    paths: cp.async + mma.sync built for this GPU's major arch (an sm_80 cubin does not load on Hopper), and
    TMA + wgmma."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if path == "tma" and not hopper:
        pytest.skip("the TMA path needs a Hopper GPU")
    arch = "sm_90a" if path == "tma" else "sm_90" if hopper else "sm_80"
    kernel = matmul_any_m(192, 256, block_M=128, block_N=64, block_K=64, target=arch)
    b = torch.randn(256, 192, device="cuda", dtype=torch.float16)
    for M in (1, 77, 1000, 33000):
        a = torch.randn(M, 256, device="cuda", dtype=torch.float16)
        _poison()
        c = kernel(a, b)
        assert c.shape == (M, 192) and _rel_err(c, a.double() @ b.double()) < 5e-3, M
    assert _kernels_in_cache() == 1
