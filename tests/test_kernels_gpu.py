"""The kernels on a GPU against float64 references (fresh random inputs, poisoned outputs)."""

import pytest
import torch

from programs import chained_matmul, chained_matmul_sum, matmul, softmax_stats_over_cluster
from tile_ops.kernels.gemm_softmax import gemm_softmax
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig, _every_block_has_columns, block_columns
import tile_ops.lang as T

pytestmark = pytest.mark.gpu
TOL = {"float16": 5e-3, "bfloat16": 1e-2}
# On Hopper both paths run: sm_90a (TMA + wgmma, warp-specialized) and sm_90 (cp.async + mma.sync)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TARGETS = ["sm_90a", "sm_90"] if HOPPER else [None]
BIG_TILES = dict(block_M=128, block_N=256, block_K=64, num_stages=4, threads=256)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def poisoned(kernel):
    """Run the kernel with its output pre-filled with NaN, so unwritten elements fail the check."""
    name, shape, dtype = kernel.meta.params[kernel.meta.out_idx[0]]
    return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tiles", ["example", "big"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("M,N,K", [(2048, 2048, 2048), (4096, 4096, 4096), (1000, 1000, 1000),
                                   (127, 255, 129), (1, 4096, 4096)])
def test_matmul_example(M, N, K, dtype, tiles, target):
    kernel = matmul(M, N, K, dtype=dtype, target=target, **(BIG_TILES if tiles == "big" else {}))
    a = torch.randn(M, K, dtype=getattr(torch, dtype), device="cuda")
    b = torch.randn(K, N, dtype=getattr(torch, dtype), device="cuda")
    c = poisoned(kernel)
    kernel.launch(a, b, c)
    assert rel_err(c, a.double() @ b.double()) < TOL[dtype]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("M,N,K", [(257, 136, 200), (1024, 512, 384)])
def test_matmul_transposed_fp32_out(ta, tb, M, N, K, target):
    kernel = matmul(M, N, K, transpose_A=ta, transpose_B=tb, out_dtype="float32", block_K=64, target=target)
    a = torch.randn(K if ta else M, M if ta else K, dtype=torch.float16, device="cuda")
    b = torch.randn(N if tb else K, K if tb else N, dtype=torch.float16, device="cuda")
    c = kernel(a, b)
    ref = (a.double().T if ta else a.double()) @ (b.double().T if tb else b.double())
    assert c.dtype == torch.float32 and rel_err(c, ref) < 5e-3


SOFTMAX_CONFIGS = {
    "default": None,
    "split_n": SoftmaxConfig(64, 256, 64, 3, 256, "full_col"),  # two warpgroups split a 64-row tile's columns
    "cluster_walk": SoftmaxConfig(64, 128, 64, 4, 128, "full_row", split=2),  # 2 blocks a row, each walks N/2
    # 128x256 tiles walked by pairs: every tile staged and TMA-stored, the last kept in registers
    "pair_walk": SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=2),
    "cluster_tile": SoftmaxConfig(128, 128, 64, 4, 256, "full_row", split=8),  # up to 8 blocks, one tile each
    # two consumer warpgroups per CTA on alternate row blocks (one column tile per block)
    "pingpong_cluster": SoftmaxConfig(64, 256, 64, 3, 128, "full_row", split=4, pingpong=True),
    # 64-row blocks whose two warpgroups split the columns (row statistics combined across them first)
    "cluster_full_col": SoftmaxConfig(64, 256, 64, 4, 256, "full_col", split=4),
    # the last wave's row blocks split along K over the idle clusters (one tile per block)
    "stream_k": SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8, stream_k=3),
    # a row's tiles over the whole grid, statistics through global memory (T.row_reduce_store)
    "deferred": SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True),
    "deferred_128": SoftmaxConfig(128, 128, 64, 4, 256, "full_row", deferred=True),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("M,N,K", [(256, 64, 64), (1000, 200, 96), (512, 1024, 256), (300, 4096, 128),
                                   (128, 8192, 64), (8192, 2048, 1024), (1000, 1100, 200)])
@pytest.mark.parametrize("cfg", list(SOFTMAX_CONFIGS.values()), ids=list(SOFTMAX_CONFIGS))
def test_gemm_softmax(M, N, K, dtype, target, cfg):
    """Default configs; two consumer warpgroups splitting each 64-row tile's columns (wgmma along N on
    sm_90a, so row max/sum combine across warpgroups through shared memory); rows split over the blocks
    of a cluster (sm_90a), walking several tiles each or holding one in registers."""
    if cfg is not None and cfg.split > 1 and (target == "sm_90" or not _every_block_has_columns(N, cfg)):
        pytest.skip("clusters are sm_90a only; this split leaves a block without columns at this N")
    if cfg is not None and cfg.deferred and (target == "sm_90" or N % 8 or K % 8):
        pytest.skip("T.row_reduce_store is sm_90a only, its tiles stored by TMA (N, K multiples of 8)")
    if cfg is not None and cfg.deferred and -(-N // cfg.block_N) > T.MAX_ROW_TILES:
        with pytest.raises(ValueError, match=f"at most {T.MAX_ROW_TILES} tiles"):  # refused, not run
            gemm_softmax(M, N, K, 0.125, dtype, dtype, cfg, target=target)
        return
    if cfg is not None and (cfg.pingpong or cfg.stream_k) and block_columns(N, cfg) > cfg.block_N:
        pytest.skip("pingpong and stream_k need one column tile per block")
    scale = 0.125
    kernel = gemm_softmax(M, N, K, scale, dtype, dtype, cfg, target=target) if cfg else \
        gemm_softmax(M, N, K, scale, dtype, dtype, target=target)
    a = torch.randn(M, K, dtype=getattr(torch, dtype), device="cuda")
    b = torch.randn(K, N, dtype=getattr(torch, dtype), device="cuda")
    out = poisoned(kernel)
    kernel.launch(a, b, out)
    ref = torch.softmax(scale * (a.double() @ b.double()), dim=-1)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(not HOPPER, reason="thread-block clusters: sm_90a")
@pytest.mark.parametrize("cfg", [SOFTMAX_CONFIGS["cluster_walk"], SOFTMAX_CONFIGS["cluster_tile"],
                                 SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=4),
                                 SOFTMAX_CONFIGS["pingpong_cluster"]], ids=["walk", "tile", "wide", "pingpong"])
def test_gemm_softmax_cluster_combines_rows(cfg):
    """Each block's rows see a different scale of scores (the last columns 4x larger, a few rows all
    -large): the row max and sum must come from the whole cluster, not from any one block."""
    M, N, K = 384, 1000, 128
    kernel = gemm_softmax(M, N, K, 0.25, "float16", "float16", cfg, target="sm_90a")
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    a[:7] *= 8  # rows with a wide range: exp underflows in all but one block
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    b[:, 700:] *= 4
    out = poisoned(kernel)
    kernel.launch(a, b, out)
    ref = torch.softmax(0.25 * (a.double() @ b.double()), dim=-1)
    assert rel_err(out, ref) < 5e-3
    assert torch.allclose(out.double().sum(-1), torch.ones(M, dtype=torch.float64, device="cuda"), atol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="thread-block clusters: sm_90a")
@pytest.mark.parametrize("M", [8192, 8000])
def test_gemm_softmax_pingpong_walks_many_tiles(M):
    """Ping-pong with many more tiles than CTAs (8192 rows: 128 row blocks x 4 blocks = 512 tiles over ~30
    clusters; 8000: 125 row blocks, some CTAs with an odd count): both warpgroups walk several tiles,
    exchanging through their own slots and barriers, and take the main loop in turns."""
    N, K = 1024, 256
    cfg = SOFTMAX_CONFIGS["pingpong_cluster"]
    kernel = gemm_softmax(M, N, K, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert kernel.meta.persistent_tiles == -(-M // 64) * 4
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    b[:, 512:] *= 3
    out = poisoned(kernel)
    kernel.launch(a, b, out)
    ref = torch.softmax(0.125 * (a.double() @ b.double()), dim=-1)
    assert rel_err(out, ref) < TOL["float16"]


@pytest.mark.skipif(not HOPPER, reason="thread-block clusters: sm_90a")
@pytest.mark.parametrize("M,N", [(16384, 2048), (9000, 1800)])
def test_gemm_softmax_persistent_walk(M, N):
    """More row blocks than resident pairs (128 or 71 on ~66): each pair walks several row blocks, each
    of four column tiles, so the staged tile, the per-tile maxima and the exchange are reused across
    row blocks; a ragged N leaves the last tile partly masked."""
    K = 128
    cfg = SOFTMAX_CONFIGS["pair_walk"]
    kernel = gemm_softmax(M, N, K, 0.125, "float16", "float16", cfg, target="sm_90a")
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    b[:, : N // 3] *= 3  # the row max in the first tiles: the earlier tiles' factors differ from 1
    out = poisoned(kernel)
    kernel.launch(a, b, out)
    ref = torch.softmax(0.125 * (a.double() @ b.double()), dim=-1)
    assert rel_err(out, ref) < TOL["float16"]


@pytest.mark.skipif(not HOPPER, reason="thread-block clusters: sm_90a")
@pytest.mark.parametrize("valid", [256, 150, 65])
def test_cluster_allreduce_merges_softmax_statistics(valid):
    """Every block of the cluster ends with the whole row's max and sum of 2^(s - max), including when
    a block's columns are all masked (-inf: it adds nothing) or only one block has any."""
    kernel = softmax_stats_over_cluster(valid, target="sm_90a")
    x = torch.randn(64, 64, dtype=torch.float16, device="cuda")
    w = torch.randn(64, 256, dtype=torch.float16, device="cuda")
    w[:, 128:] *= 3  # blocks see different scales
    row_max, row_sum = kernel(x, w)
    s = (x.double() @ w.double())[:, :valid]
    ref_max = s.max(dim=1).values
    ref_sum = torch.exp2(s - ref_max[:, None]).sum(dim=1)
    assert torch.allclose(row_max.double(), ref_max.expand(4, -1), rtol=1e-5, atol=1e-4)
    assert torch.allclose(row_sum.double(), ref_sum.expand(4, -1), rtol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tiles", [dict(), dict(block_M=128, threads=256)])
@pytest.mark.parametrize("M,N,K,L", [(512, 128, 64, 256), (1000, 64, 128, 320), (130, 256, 32, 200)])
def test_chained_matmul(M, N, K, L, tiles, dtype, target):
    """(A @ B) @ D with A @ B cast to ``dtype`` in registers and fed back as the A operand (wgmma's rs
    form on sm_90a, mma.sync A fragments on sm_90); a ragged L tile is zero-filled."""
    kernel = chained_matmul(M, N, K, L, dtype=dtype, target=target, **tiles)
    a, b, d = (torch.randn(*s, dtype=getattr(torch, dtype), device="cuda") for s in ((M, K), (K, L), (L, N)))
    c = poisoned(kernel)
    kernel.launch(a, b, d, c)
    assert rel_err(c, (a.double() @ b.double()) @ d.double()) < TOL[dtype]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tiles", [dict(), dict(block_M=128, threads=256)])
def test_chained_matmul_sum(tiles, target):
    """A pipelined loop of register-A gemms only (on sm_90a: wgmma groups in flight across steps)."""
    M, N, K, L, J = 300, 128, 64, 64, 5
    kernel = chained_matmul_sum(M, N, K, L, J, target=target, **tiles)
    a, b, d = (torch.randn(*s, dtype=torch.float16, device="cuda") for s in ((M, K), (K, L), (J, L, N)))
    c = poisoned(kernel)
    kernel.launch(a, b, d, c)
    assert rel_err(c, (a.double() @ b.double()) @ d.double().sum(0)) < TOL["float16"]
