"""Stream-K kernels on the GPU against float64: the flags a launch leaves behind must let the next launch
(same stream, another stream, a CUDA graph's replays) wait for its own partials, never a stale count."""

import pytest
import torch

from test_gemm_configs_gpu import SHAPES, VARIANTS, check
from tile_ops.jit.kernel import FLAG_SLOTS, _workspaces
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_launch import build_gemm
from tile_ops.kernels.gemm_softmax import gemm_softmax
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

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
    output, unaligned rows padded for TMA)."""
    if -(-shape[0] // cfg.block_M) % cfg.cluster:
        pytest.skip(f"cluster={cfg.cluster} does not divide the M tiles of this shape")
    check(cfg, shape, variant, "sm_90a")


def _gemm(M, N, K):
    return build_gemm(M, N, K, 1, 1, 1, False, False, False, "float16", "float16", GEMM, target="sm_90a")


def _operands(M, N, K):
    """Fresh inputs per launch: an owner that took a stale flag would add the previous launch's partials."""
    a = torch.randn(M, K, dtype=torch.float16, device="cuda")
    b = torch.randn(K, N, dtype=torch.float16, device="cuda")
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    return a, b, out, a.double() @ b.double()


def _launch(kernel, a, b, out):
    kernel.launch_ptrs([a.data_ptr(), b.data_ptr(), out.data_ptr(), out.data_ptr()], a.device)


def _err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _flags_left_zero(stream):
    ws = _workspaces[(torch.cuda.current_device(), stream.cuda_stream)]
    return bool((ws[: FLAG_SLOTS * 4] == 0).all())


@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (1024, 512, 4096), (300, 704, 520)])  # TMA rows: 16-byte strides
def test_repeated_launches_on_two_streams(shape):
    """Launches queued back to back on two streams at once, each with its own inputs: every result right,
    and each stream's workspace left with zero flags."""
    kernel = _gemm(*shape)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    runs = []
    for _ in range(3):
        for stream in streams:
            with torch.cuda.stream(stream):
                run = _operands(*shape)
                _launch(kernel, *run[:3])
                runs.append(run)
    torch.cuda.synchronize()
    assert all(_err(out, ref) < 5e-3 for _, _, out, ref in runs)
    assert all(_flags_left_zero(s) for s in streams)


def test_cuda_graph_replays():
    """Captured on a stream that already keeps a workspace, which a bigger kernel then replaces: the graph
    has its own workspace, so its replays (on fresh inputs copied in) stay right."""
    kernel, bigger = _gemm(1000, 1000, 1000), _gemm(1024, 2048, 4096)
    a, b, out, _ = _operands(1000, 1000, 1000)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _launch(kernel, a, b, out)  # the stream's workspace exists before the capture
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        _launch(kernel, a, b, out)
        _launch(kernel, a, b, out)
    with torch.cuda.stream(side):
        _launch(bigger, *_operands(1024, 2048, 4096)[:3])  # grows (replaces) the kept workspace
    for _ in range(3):
        a2, b2, _, ref = _operands(1000, 1000, 1000)
        a.copy_(a2)
        b.copy_(b2)
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
    for _ in range(2):
        a = torch.randn(M, K, dtype=torch.float16, device="cuda")
        a[::97] *= 6
        b = torch.randn(K, N, dtype=torch.float16, device="cuda")
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
        kernel.launch(a, b, out)
        torch.cuda.synchronize()
        assert _err(out, torch.softmax(0.125 * (a.double() @ b.double()), dim=-1)) < 5e-3
    assert _flags_left_zero(torch.cuda.current_stream())
