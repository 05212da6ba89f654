"""Stream-K kernels on the GPU against float64: the flags a launch leaves behind must let the next launch
(same stream, another stream, a CUDA graph's replays) wait for its own partials, never a stale count."""

import pytest
import torch

from test_gemm_configs_gpu import SHAPES, VARIANTS, check
from tile_ops.kernels.gemm import GemmConfig, build_gemm
from tile_ops.kernels.gemm_softmax import SoftmaxConfig, gemm_softmax

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="stream-K is on the sm_90a path")]
GEMM = GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", stream_k=2)
CONFIGS = [  # 1000^3: 64 tiles in halves; decode 16x4096x4096: 32 tiles in quarters; 2048^2: whole waves
    GEMM,
    GemmConfig(128, 128, 64, 4, 128, 8, stream_k=4),  # direct epilogue
    GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared", stream_k=3),  # two consumer warpgroups
    GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=2, stream_k=3),  # clusters split alike
    GemmConfig(64, 256, 64, 4, 128, 0, stream_k=4),  # the decode tile
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_stream_k_configs(cfg, shape, variant):
    """The configs over every shape and variant of test_gemm_configs_gpu.py (batched, transposed, bias, fp32
    output, unaligned rows that fall back to synchronous copies, where stream_k does nothing)."""
    if -(-shape[0] // cfg.block_M) % cfg.cluster:
        pytest.skip(f"cluster={cfg.cluster} does not divide the M tiles of this shape")
    check(cfg, shape, variant, "sm_90a")


def _gemm(M, N, K):
    kernel = build_gemm(M, N, K, 1, 1, 1, False, False, False, "float16", "float16", GEMM, target="sm_90a")
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    ref = a.double() @ b.double()
    return kernel, a, b, ref


def _err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (1024, 512, 4096), (300, 700, 520)])
def test_repeated_launches_on_two_streams(shape):
    kernel, a, b, ref = _gemm(*shape)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            for _ in range(3):
                out = torch.full(ref.shape, float("nan"), dtype=torch.float16, device="cuda")
                kernel.launch_ptrs([a.data_ptr(), b.data_ptr(), out.data_ptr(), out.data_ptr()], a.device)
                stream.synchronize()
                assert _err(out, ref) < 5e-3


def test_cuda_graph_replays():
    kernel, a, b, ref = _gemm(1000, 1000, 1000)
    out = torch.empty(ref.shape, dtype=torch.float16, device="cuda")
    launch = lambda: kernel.launch_ptrs([a.data_ptr(), b.data_ptr(), out.data_ptr(), out.data_ptr()], a.device)  # noqa: E731
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        launch()  # warm-up outside the capture: the stream's workspace exists
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
        launch()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _err(out, ref) < 5e-3


@pytest.mark.parametrize("M", [8192, 2048, 1000])
def test_softmax_rows_split_along_k(M):
    """8192: 64 row blocks on 15 clusters (4 split in thirds); 2048: 16 (1 split); 1000: 8 row blocks, all
    split.  Rows with very different ranges: the partial sums must meet before the row max is taken."""
    N, K = 2048, 1024
    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8, stream_k=3)
    kernel = gemm_softmax(M, N, K, 0.125, "float16", "float16", cfg, target="sm_90a")
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    a[::97] *= 6
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    ref = torch.softmax(0.125 * (a.double() @ b.double()), dim=-1)
    for _ in range(2):
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
        kernel.launch(a, b, out)
        torch.cuda.synchronize()
        assert _err(out, ref) < 5e-3
