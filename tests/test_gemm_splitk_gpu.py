"""Split-K gemm on the GPU against float64 (fresh random inputs; outputs and the allocator's free memory,
where the workspace comes from, poisoned with NaN): through the kernels directly, on both Hopper paths,
and through the op ``tile_ops.gemm`` (checked path, then the recorded plan's fast path)."""

import dataclasses

import pytest
import torch

import tile_ops
from tile_ops.kernels import gemm_launch
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_launch import SplitKGemm, build_gemm, launch_gemm
from tile_ops.ops import fastpath

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

F16, BF16 = torch.float16, torch.bfloat16
TOL = {F16: 5e-3, BF16: 1e-2}
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TARGETS = ["sm_90a", "sm_90"] if HOPPER else [None]
TILE = {"sm_90a": GemmConfig(64, 128, 64, 6, 128, 0), "sm_90": GemmConfig(64, 128, 64, 4, 128, 0, "full_col"),
        None: GemmConfig(64, 128, 64, 3, 128, 0, "full_col")}
# (M, N, K): decode, one row, ragged everything; (16, 256, 320) has 5 k-tiles, so split 4 leaves one split empty
SHAPES = [(16, 8192, 8192), (1, 4096, 4096), (37, 1000, 3000), (16, 256, 320)]


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def poison(nbytes=256 << 20):
    t = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del t


def rnd(*shape, dtype=F16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def operands(M, N, K, dtype, bias):
    a, b = rnd(M, K, dtype=dtype), rnd(K, N, dtype=dtype)
    c = rnd(N, dtype=dtype, scale=K ** 0.5) if bias else None  # as large as a @ b: a missing bias fails
    ref = a.double() @ b.double() + (0 if c is None else c.double())
    return a, b, c, ref


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_split_k_kernels(M, N, K, split_k, bias, dtype, target):
    cfg = dataclasses.replace(TILE[target], split_k=split_k)
    dt = str(dtype)[6:]
    kernel = build_gemm(M, N, K, 1, 1, 1, False, False, bias, dt, dt, cfg, target=target)
    assert isinstance(kernel.launchable, SplitKGemm) and kernel.dims == (M,)  # M bound at launch
    a, b, c, ref = operands(M, N, K, dtype, bias)
    out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    poison()
    kernel.launch_ptrs([a.data_ptr(), b.data_ptr(), (out if c is None else c).data_ptr(), out.data_ptr()], a.device)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_batched_transposed_fp32_out(split_k, dtype):
    """launch_gemm with an explicit split config: batch folded into the grid with the splits, A transposed."""
    B, M, N, K = 3, 40, 192, 1000
    a = rnd(B, K, M, dtype=dtype).mT
    b = rnd(N, K, dtype=dtype).t().expand(B, K, N)
    bias = rnd(N, dtype=dtype, scale=K ** 0.5)
    out = torch.full((B, M, N), float("nan"), dtype=torch.float32, device="cuda")
    poison()
    launch_gemm(a, b, out, bias, cfg=GemmConfig(64, 64, 64, 4, 128, 0, split_k=split_k))
    assert rel_err(out, a.double() @ b.double() + bias.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_split_k_through_the_op(M, N, K, split_k, bias, dtype, monkeypatch):
    cfg = dataclasses.replace(TILE["sm_90a" if HOPPER else None], split_k=split_k)
    monkeypatch.setattr(gemm_launch, "config_for", lambda *args, **kw: cfg)
    fastpath.clear()
    for _ in range(2):  # the checked path (records the plan), then the fast path
        a, b, c, ref = operands(M, N, K, dtype, bias)
        poison()
        out = tile_ops.gemm(a, b, c)
        assert out.shape == (M, N) and out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype]


def test_default_decode_config_is_correct():
    a, b, c, ref = operands(16, 8192, 8192, F16, True)
    poison()
    assert rel_err(tile_ops.gemm(a, b, c), ref) < TOL[F16]
