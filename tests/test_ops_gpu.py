"""GPU tests of the tile_ops ops (run on the H200; auto-skipped without CUDA).

Fresh random inputs every test, freed memory poisoned with NaN before each op
call (the op's output comes from the caching allocator), results compared with
a float64 reference by relative Frobenius error.
"""

import importlib

import pytest
import torch

import tile_ops
import tile_ops.nn

gemm_mod = importlib.import_module("tile_ops.ops.gemm")
softmax_mod = importlib.import_module("tile_ops.ops.gemm_softmax")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOL = {F16: 5e-3, BF16: 1e-2}
DTYPES = [F16, BF16]
SHAPES = [(127, 255, 129), (256, 256, 256), (1, 64, 8), (333, 96, 200), (64, 1000, 72)]  # (M, K, N)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def poison(nbytes=64 << 20):
    """Fill freed allocator memory with NaN so an unwritten output element shows up."""
    t = torch.full((nbytes // 4,), float("nan"), device="cuda", dtype=F32)
    del t


def rnd(*shape, dtype=F16, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=F32) * scale).to(dtype)


def ref_gemm(a, b, bias=None):
    out = torch.matmul(a.double(), b.double())
    return out if bias is None else out + bias.double()


def ref_gemm_softmax(a, b, scale):
    return torch.softmax(torch.matmul(a.double(), b.double()) * scale, -1)


def _operands(kind, M, K, N, dtype, B=3):
    if kind == "2d":
        return rnd(M, K, dtype=dtype), rnd(K, N, dtype=dtype)
    if kind == "batched":
        return rnd(B, M, K, dtype=dtype), rnd(B, K, N, dtype=dtype)
    if kind == "batched_a_2d_b":
        return rnd(B, M, K, dtype=dtype), rnd(K, N, dtype=dtype)
    if kind == "a_t":
        return rnd(K, M, dtype=dtype).t(), rnd(K, N, dtype=dtype)
    if kind == "b_t":
        return rnd(M, K, dtype=dtype), rnd(N, K, dtype=dtype).t()
    if kind == "both_t_batched":
        return rnd(B, K, M, dtype=dtype).mT, rnd(B, N, K, dtype=dtype).mT
    if kind == "strided":
        return rnd(M, 2 * K, dtype=dtype)[:, ::2], rnd(K, N, dtype=dtype)
    raise ValueError(kind)


KINDS = ["2d", "batched", "batched_a_2d_b", "a_t", "b_t", "both_t_batched", "strided"]


# --------------------------------------------------------------------------- gemm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_gemm_vs_float64(dtype, shape, kind):
    M, K, N = shape
    a, b = _operands(kind, M, K, N, dtype)
    poison()
    out = tile_ops.gemm(a, b)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.is_contiguous() and torch.isfinite(out).all()
    assert rel_err(out, ref_gemm(a, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, F32])
@pytest.mark.parametrize("kind", ["2d", "batched_a_2d_b", "b_t"])
def test_gemm_bias_and_out_dtype(dtype, out_dtype, kind):
    M, K, N = 127, 255, 129
    a, b = _operands(kind, M, K, N, dtype)
    bias = rnd(N, dtype=dtype)
    poison()
    out = tile_ops.gemm(a, b, bias, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or dtype) and torch.isfinite(out).all()
    assert rel_err(out, ref_gemm(a, b, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype, out_dtype", [(F16, F32), (BF16, F32), (F16, BF16)])
@pytest.mark.parametrize("kind", ["2d", "b_t"])
def test_gemm_bias_in_the_output_dtype(dtype, out_dtype, kind):
    """A bias in the output dtype reaches the epilogue in that dtype: 1e5 would overflow fp16, and bf16 bits
    read as fp16 would be other numbers."""
    M, K, N = 127, 255, 129
    a, b = _operands(kind, M, K, N, dtype)
    bias = (rnd(N, dtype=F32) * 100 + (1e5 if out_dtype == F32 else 0)).to(out_dtype)
    poison()
    out = tile_ops.gemm(a, b, bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and torch.isfinite(out).all()
    if out_dtype == F32:  # the product itself to the inputs' tolerance, under the large bias
        assert rel_err(out - bias.double(), ref_gemm(a, b)) < TOL[dtype]
    else:
        assert rel_err(out, ref_gemm(a, b, bias)) < TOL[BF16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_grads_vs_float64(dtype):
    M, K, N = 127, 255, 129
    a = rnd(2, M, K, dtype=dtype).requires_grad_()
    b = rnd(N, K, dtype=dtype).t().detach().requires_grad_()  # a transposed leaf
    bias = rnd(N, dtype=dtype).requires_grad_()
    g = rnd(2, M, N, dtype=dtype)
    tile_ops.gemm(a, b, bias).backward(g)
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref_gemm(a64, b64, bias64).backward(g.double())
    for t, r in ((a, a64), (b, b64), (bias, bias64)):
        assert t.grad.dtype == dtype
        assert rel_err(t.grad, r.grad) < TOL[dtype]


def test_gemm_empty_and_k_zero():
    assert tile_ops.gemm(rnd(0, 64), rnd(64, 32)).shape == (0, 32)
    assert tile_ops.gemm(rnd(16, 64), rnd(64, 0)).shape == (16, 0)
    bias = rnd(32)
    out = tile_ops.gemm(rnd(16, 0), rnd(0, 32), bias, out_dtype=F32)
    torch.testing.assert_close(out, bias.float().expand(16, 32))


def test_gemm_cuda_input_errors():
    a, b = rnd(64, 64), rnd(64, 64)
    with pytest.raises(TypeError, match=r"accepted on CUDA: float16 or bfloat16"):
        tile_ops.gemm(a.float(), b.float())
    with pytest.raises(TypeError, match=r"same dtype"):
        tile_ops.gemm(a, b.bfloat16())
    with pytest.raises(RuntimeError, match=r"same device"):
        tile_ops.gemm(a, b.cpu())
    with pytest.raises(ValueError, match=r"inner dimensions do not match"):
        tile_ops.gemm(a, rnd(32, 64))


def test_gemm_misaligned_pointer_error():
    buf = rnd(1 + 64 * 64)
    a = buf[1:].view(64, 64)  # storage offset of one element: 2 bytes off 16-byte alignment
    with pytest.raises(ValueError, match=r"not 16-byte aligned.*a\.clone\(\)"):
        tile_ops.gemm(a, rnd(64, 32))
    out = tile_ops.gemm(a.clone(), rnd(64, 32))  # the suggested fix works
    assert out.shape == (64, 32)


# --------------------------------------------------------------------------- gemm_softmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["2d", "batched", "batched_a_2d_b", "b_t", "strided"])
def test_gemm_softmax_vs_float64(dtype, shape, kind):
    M, K, N = shape
    a, b = _operands(kind, M, K, N, dtype)
    scale = K ** -0.5
    poison()
    out = tile_ops.gemm_softmax(a, b, scale)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.is_contiguous() and torch.isfinite(out).all()
    assert rel_err(out, ref_gemm_softmax(a, b, scale)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(127, 255, 129), (1000, 1000, 4096)], ids=["small", "deferred_default"])
def test_gemm_softmax_out_dtype_f32(dtype, shape):
    """(1000, 1000, 4096) defaults to the deferred config, whose float32 output falls back to a cluster split
    (it raised before 55127d1); autocast asks for a float32 result too."""
    M, K, N = shape
    a, b = rnd(M, K, dtype=dtype), rnd(K, N, dtype=dtype)
    out = tile_ops.gemm_softmax(a, b, 0.1, out_dtype=F32)
    assert out.dtype == F32
    assert rel_err(out, ref_gemm_softmax(a, b, 0.1)) < 2e-3
    with torch.autocast("cuda", dtype=dtype):
        assert rel_err(tile_ops.gemm_softmax(a, b, 0.1), ref_gemm_softmax(a, b, 0.1)) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_func_on_cuda_vs_float64(dtype):
    """Per-sample gradients (vmap of grad) and a vmapped gemm_softmax: the batching rules' one launch and the
    autograd Functions, on the kernels."""
    from torch.func import grad, vmap

    w, x = rnd(255, 129, dtype=dtype), rnd(6, 127, 255, dtype=dtype)
    got = vmap(grad(lambda w, xi: tile_ops.gemm(xi, w, out_dtype=F32).square().sum()), in_dims=(None, 0))(w, x)
    want = vmap(grad(lambda w, xi: (xi @ w).square().sum()), in_dims=(None, 0))(w.double(), x.double())
    assert rel_err(got, want) < TOL[dtype]
    scale = 255 ** -0.5
    got = vmap(lambda xi: tile_ops.gemm_softmax(xi, w, scale))(x)
    assert rel_err(got, ref_gemm_softmax(x, w, scale)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_softmax_grads_vs_float64(dtype):
    M, K, N = 127, 255, 129
    a = rnd(2, M, K, dtype=dtype).requires_grad_()
    b = rnd(2, K, N, dtype=dtype).requires_grad_()
    g = rnd(2, M, N, dtype=dtype)
    scale = K ** -0.5
    tile_ops.gemm_softmax(a, b, scale).backward(g)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ref_gemm_softmax(a64, b64, scale).backward(g.double())
    for t, r in ((a, a64), (b, b64)):
        assert t.grad.dtype == dtype
        assert rel_err(t.grad, r.grad) < TOL[dtype]


def test_gemm_softmax_errors_and_edge_cases():
    a, b = rnd(64, 64), rnd(64, 32)
    with pytest.raises(ValueError, match=r"scale must be a finite float"):
        tile_ops.gemm_softmax(a, b, float("inf"))
    with pytest.raises(TypeError, match=r"accepted on CUDA"):
        tile_ops.gemm_softmax(a.double(), b.double())
    buf = rnd(1 + 64 * 64)
    with pytest.raises(ValueError, match=r"16-byte aligned"):
        tile_ops.gemm_softmax(buf[1:].view(64, 64), b)
    torch.testing.assert_close(
        tile_ops.gemm_softmax(rnd(8, 0), rnd(0, 4)), torch.full((8, 4), 0.25, device="cuda", dtype=F16)
    )


# --------------------------------------------------------------------------- eager fast path


@pytest.fixture
def op_calls(monkeypatch):
    """How many calls reached each op's CUDA implementation through the dispatcher."""
    calls = {"gemm": 0, "gemm_softmax": 0}

    def counting(name, impl):
        def counted(*args, **kwargs):
            calls[name] += 1
            return impl(*args, **kwargs)

        return counted

    monkeypatch.setitem(gemm_mod.GEMM.op._backend_fns, "cuda", counting("gemm", gemm_mod.GEMM.cuda))
    monkeypatch.setitem(softmax_mod.GEMM_SOFTMAX.op._backend_fns, "cuda",
                        counting("gemm_softmax", softmax_mod.GEMM_SOFTMAX.cuda))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_matches_op_path(op_calls, dtype, with_bias, kind):
    M, K, N = 127, 255, 129
    a, b = _operands(kind, M, K, N, dtype)
    bias = rnd(N, dtype=dtype) if with_bias else None
    via_op = torch.ops.tile_ops.gemm(a, b, bias)  # plans the signature (unless the kernel needs a copy)
    poison()
    fast = tile_ops.gemm(a, b, bias)
    assert op_calls["gemm"] == (2 if kind == "strided" else 1)
    assert torch.equal(fast, via_op)  # the same kernel on the same operands
    assert rel_err(fast, ref_gemm(a, b, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["2d", "batched_a_2d_b", "batched"])
def test_gemm_softmax_fast_path_matches_op_path(op_calls, dtype, kind):
    a, b = _operands(kind, 127, 255, 129, dtype)
    via_op = torch.ops.tile_ops.gemm_softmax(a, b, 0.0625)
    poison()
    fast = tile_ops.gemm_softmax(a, b, 0.0625)
    assert op_calls["gemm_softmax"] == (2 if kind == "batched" else 1)  # batched: a launch per entry, no plan
    assert torch.equal(fast, via_op)


def test_fast_path_misaligned_pointer_error(op_calls):
    a, b = rnd(64, 64), rnd(64, 32)
    tile_ops.gemm(a, b)
    tile_ops.gemm(a, b)
    assert op_calls["gemm"] <= 1
    buf = rnd(1 + 64 * 64)
    with pytest.raises(ValueError, match=r"a's data pointer .* is not 16-byte aligned"):
        tile_ops.gemm(buf[1:].view(64, 64), b)  # the planned signature, misaligned


@pytest.mark.parametrize("M,N,K", [(1024, 1024, 256), (16, 4096, 1024), (96, 80, 64), (777, 3001, 1234)])
def test_fast_path_on_fresh_buffers(op_calls, M, N, K):
    """Each call on new pointers (outputs kept alive): the plan's TMA descriptors are encoded per pointer, and
    more pointers than its descriptor cache holds still launch right; 777x3001x1234 pads A and B into the
    plan's scratch buffers first."""
    tile_ops.gemm(rnd(M, K), rnd(K, N))
    calls = [(rnd(M, K), rnd(K, N)) for _ in range(6)]
    outs = [tile_ops.gemm(a, b) for a, b in calls]
    assert op_calls["gemm"] <= 1
    for (a, b), out in zip(calls, outs):
        assert rel_err(out, ref_gemm(a, b)) < TOL[F16]


def _family_members(ranges, m0, count=4):
    """Token counts of a plan family's runs other than the recording call's, nearest first."""
    inside = sorted((m for lo, hi in ranges for m in range(lo, hi + 1) if m != m0), key=lambda m: abs(m - m0))
    return inside[:count]


@pytest.mark.parametrize("layout", ["row", "a_t", "batched"])
def test_an_unseen_token_count_stays_on_the_fast_path(op_calls, layout):
    """Issue 41: after one call records its plan family, calls at token counts never seen that launch the same
    kernels take no checked path, allocate their outputs by m and are right against float64."""
    from tile_ops.kernels import gemm_launch
    from tile_ops.ops import fastpath

    fastpath.clear()
    K, N, m0 = 256, 384, 1000

    def a_of(m):
        return rnd(m, K) if layout == "row" else rnd(K, m).t() if layout == "a_t" else rnd(3, m, K)

    b = rnd(K, N)
    tile_ops.gemm(a_of(m0), b)
    a3 = a_of(m0).reshape(1, -1, K) if layout == "batched" else a_of(m0)[None]
    problem = gemm_launch.gemm_problem(a3, b[None], torch.empty(1, a3.shape[1], N, device="cuda", dtype=F16))[0]
    members = _family_members(gemm_launch.family_ranges(problem, 3 if layout == "batched" else 1), m0)
    assert len(members) == 4
    for m in members:
        a = a_of(m)
        poison()
        out = tile_ops.gemm(a, b)
        assert out.shape == (*a.shape[:-1], N) and rel_err(out, a.double() @ b.double()) < TOL[F16], m
    assert op_calls["gemm"] == 1


def test_an_unseen_token_count_stays_on_the_fast_path_of_gemm_softmax(op_calls):
    from tile_ops.kernels import gemm_softmax_launch
    from tile_ops.ops import fastpath

    fastpath.clear()
    b, m0 = rnd(128, 1024), 2000
    tile_ops.gemm_softmax(rnd(m0, 128), b, 0.125)
    problem = dict(M=m0, N=1024, K=128, scale=0.125, dtype="float16", out_dtype="float16")
    for m in _family_members(gemm_softmax_launch.family_ranges(problem, 1), m0):
        a = rnd(m, 128)
        poison()
        out = tile_ops.gemm_softmax(a, b, 0.125)
        ref = torch.softmax((a.double() @ b.double()) * 0.125, -1)
        assert out.shape == (m, 1024) and rel_err(out, ref) < TOL[F16], m
    assert op_calls["gemm_softmax"] == 1


def test_fast_path_under_cuda_graph_capture(op_calls):
    a, b = rnd(64, 64), rnd(64, 64)
    tile_ops.gemm(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tile_ops.gemm(a, b)
    a.copy_(rnd(64, 64))
    graph.replay()
    torch.cuda.synchronize()
    assert op_calls["gemm"] <= 1
    assert torch.equal(out, torch.ops.tile_ops.gemm(a, b))


@pytest.mark.parametrize("M, K, N", [(16, 8192, 2048), (777, 1234, 3001)], ids=["split-K", "padded"])
def test_composed_gemms_under_cuda_graph_capture(M, K, N):
    """Split-K decode (partials, then the reduction; 16x2048 is too few column tiles for the swapped kernel)
    and padded rows (pad_rows, then the gemm) on sm_90a launch their later kernels programmatically
    (Kernel.dependent): captured into a graph and replayed on new inputs, twice in a row, they give the
    eager result."""
    from tile_ops.kernels.gemm_launch import PaddedGemm, SplitKGemm, get_gemm_kernel

    a, b = rnd(M, K), rnd(K, N)
    out = tile_ops.gemm(a, b)
    if torch.cuda.get_device_capability() == (9, 0):  # what the op launches is the composed gemm named
        kernel = get_gemm_kernel(a[None], b[None], out[None])[0].launchable  # M bound at launch (Sized)
        assert isinstance(kernel, SplitKGemm if M == 16 else PaddedGemm), kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tile_ops.gemm(a, b)
    for _ in range(2):
        a.copy_(rnd(M, K))
        b.copy_(rnd(K, N))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_gemm(a, b)) < TOL[F16]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fast_path_on_another_device(op_calls):
    a, b = rnd(96, 64).to("cuda:1"), rnd(64, 80).to("cuda:1")
    via_op = torch.ops.tile_ops.gemm(a, b)
    fast = tile_ops.gemm(a, b)  # launched on cuda:1 and its current stream, not the current device's
    assert fast.device == a.device and op_calls["gemm"] == 1
    assert torch.equal(fast, via_op)


def test_linear_inference_on_the_fast_path(op_calls):
    lin = tile_ops.nn.Linear(256, 128, device="cuda", dtype=BF16)
    x = rnd(4, 32, 256, dtype=BF16)
    with torch.inference_mode():
        ys = [lin(x) for _ in range(3)]
    assert op_calls["gemm"] <= 1
    ref = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    for y in ys:
        assert rel_err(y, ref) < TOL[BF16]


# --------------------------------------------------------------------------- opcheck / compile


def test_opcheck_cuda():
    for dtype in DTYPES:
        a = rnd(2, 33, 40, dtype=dtype).requires_grad_()
        b = rnd(24, 40, dtype=dtype).t().detach().requires_grad_()
        bias = rnd(24, dtype=dtype).requires_grad_()
        torch.library.opcheck(torch.ops.tile_ops.gemm.default, (a, b, bias))
        torch.library.opcheck(torch.ops.tile_ops.gemm.default, (a, b), {"out_dtype": F32})
        torch.library.opcheck(torch.ops.tile_ops.gemm_softmax.default, (a, b, 0.3))
        torch.library.opcheck(torch.ops.tile_ops.gemm_softmax.default, (a[0], b, 1.0), {"out_dtype": F32})


def test_compile_fullgraph_dynamic_cuda():
    torch._dynamo.reset()
    lin = tile_ops.nn.Linear(64, 128, device="cuda", dtype=BF16)
    keys = rnd(128, 96, dtype=BF16)

    def f(x):
        return tile_ops.gemm_softmax(lin(x), keys, 128 ** -0.5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for M in (100, 37):
        x = rnd(M, 64, dtype=BF16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), f(x))


# --------------------------------------------------------------------------- nn.Linear


def test_mlp_training_matches_torch_linear():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    ).to(device="cuda", dtype=BF16)
    ours = torch.nn.Sequential(
        tile_ops.nn.Linear.from_linear(ref[0], copy=True), torch.nn.GELU(), tile_ops.nn.Linear.from_linear(ref[2], copy=True)
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    x, y = rnd(384, 256, dtype=BF16), rnd(384, 64, dtype=BF16)
    losses_ref, losses = [], []
    for _ in range(20):
        for model, o, log in ((ref, opt_ref, losses_ref), (ours, opt, losses)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            o.step()
            log.append(loss.item())
    assert losses[-1] < losses[0]
    for l_ours, l_ref in zip(losses, losses_ref):
        assert abs(l_ours - l_ref) <= 2e-2 * abs(l_ref), (losses, losses_ref)
