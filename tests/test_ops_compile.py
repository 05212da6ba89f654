"""torch.library.opcheck and torch.compile(fullgraph=True) for the tile_ops ops (CPU path)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import tile_ops
import tile_ops.nn

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _r(*shape, dtype=F32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _rt(*shape, dtype=F32, grad=True):
    """A transposed view (last two dims swapped) of a fresh leaf."""
    t = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).requires_grad_(grad)
    return t.transpose(-1, -2)


GEMM_SAMPLES = {
    "2d_bias": lambda: ((_r(5, 7), _r(7, 3), _r(3)), {}),
    "batched_bT_f64": lambda: ((_r(2, 5, 7, dtype=F64), _rt(2, 7, 3, dtype=F64)), {}),
    "batched_a_2d_b_out_f64": lambda: ((_r(3, 4, 6), _r(6, 5), _r(5)), {"out_dtype": F64}),
    "aT_2d_batched_b": lambda: ((_rt(4, 6), _r(2, 6, 3)), {}),
    "bf16_out_f32": lambda: ((_r(4, 8, dtype=BF16, grad=False), _r(8, 3, dtype=BF16, grad=False)), {"out_dtype": F32}),
    "k_zero": lambda: ((_r(3, 0), _r(0, 4), _r(4)), {}),
}

GEMM_SOFTMAX_SAMPLES = {
    "2d": lambda: ((_r(5, 7), _r(7, 3)), {}),
    "2d_scale": lambda: ((_r(5, 7, dtype=F64), _r(7, 3, dtype=F64), 0.5), {}),
    "batched_transposed": lambda: ((_rt(2, 5, 7), _rt(2, 7, 4), -0.25), {}),
    "batched_a_2d_b": lambda: ((_r(3, 4, 6), _r(6, 5), 2.0), {}),
    "f16_out_f32": lambda: ((_r(4, 8, dtype=F16, grad=False), _r(8, 3, dtype=F16, grad=False), 0.1), {"out_dtype": F32}),
}


@pytest.mark.parametrize("name", list(GEMM_SAMPLES))
def test_opcheck_gemm_cpu(name):
    args, kwargs = GEMM_SAMPLES[name]()
    torch.library.opcheck(torch.ops.tile_ops.gemm.default, args, kwargs)


@pytest.mark.parametrize("name", list(GEMM_SOFTMAX_SAMPLES))
def test_opcheck_gemm_softmax_cpu(name):
    args, kwargs = GEMM_SOFTMAX_SAMPLES[name]()
    torch.library.opcheck(torch.ops.tile_ops.gemm_softmax.default, args, kwargs)


class TinyModel(torch.nn.Module):
    """x (M, 16) -> tile_ops Linear -> softmax(h @ keys / sqrt(d)) via gemm_softmax -> gemm with values."""

    def __init__(self):
        super().__init__()
        self.proj = tile_ops.nn.Linear(16, 32)
        self.keys = torch.nn.Parameter(torch.randn(32, 24))
        self.values = torch.nn.Parameter(torch.randn(24, 8))

    def forward(self, x):
        h = self.proj(x)
        p = tile_ops.gemm_softmax(h, self.keys, 32 ** -0.5)
        return tile_ops.gemm(p, self.values)


def _graph_ops(counter_graphs):
    return {str(n.target) for gm in counter_graphs for n in gm.graph.nodes if n.op == "call_function"}


def test_explain_no_graph_breaks():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyModel()
    explanation = torch._dynamo.explain(model)(torch.randn(10, 16))
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    ops = _graph_ops(explanation.graphs)
    assert {"tile_ops.gemm", "tile_ops.gemm_softmax"} <= {op.removesuffix(".default") for op in ops}


@pytest.mark.parametrize("dynamic_m", [False, True])
def test_compile_fullgraph_matches_eager(dynamic_m):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyModel()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    for M in (10, 13, 7):
        x = torch.randn(M, 16, requires_grad=True)
        if dynamic_m:
            torch._dynamo.mark_dynamic(x, 0)
        x_ref = x.detach().clone().requires_grad_()
        y = compiled(x)
        y_ref = model(x_ref)
        torch.testing.assert_close(y, y_ref)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x, *model.parameters()], g)
        grads_ref = torch.autograd.grad(y_ref, [x_ref, *model.parameters()], g)
        for got, want in zip(grads, grads_ref):
            torch.testing.assert_close(got, want)

    if dynamic_m:
        assert counter.frame_count == 1  # one graph, symbolic in M: no recompiles
    else:
        assert counter.frame_count >= 1


def test_compile_inductor_dynamic_matches_eager():
    """The default backend (inductor) around the custom ops, with a dynamic M and a backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyModel()
    compiled = torch.compile(model, fullgraph=True)
    for M in (9, 12):
        x = torch.randn(M, 16, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = compiled(x), model(x_ref)
        torch.testing.assert_close(y, y_ref)
        y.sum().backward()
        y_ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)


def _jvp_operands():
    torch.manual_seed(3)
    a, b, bias = (torch.randn(*s, dtype=F64) for s in ((2, 6, 5), (5, 4), (4,)))
    return (a, b, bias), tuple(torch.randn_like(x) for x in (a, b, bias))


@pytest.mark.parametrize("ops", ["wrappers", "ops"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_forward_mode_inside_compile_has_the_real_tangents(backend, ops):
    """func.jvp and jacfwd traced by dynamo: the wrappers' tangent formulas trace with them; the ops' own
    Autograd kernels build the same tangents when AOT traces the graph (a custom op alone gives a zero tangent,
    silently)."""
    torch._dynamo.reset()
    (a, b, bias), (ta, tb, tbias) = _jvp_operands()
    if ops == "ops":
        gemm, gemm_softmax = torch.ops.tile_ops.gemm, torch.ops.tile_ops.gemm_softmax
    else:
        gemm, gemm_softmax = tile_ops.gemm, tile_ops.gemm_softmax

    def tangents(gemm, gemm_softmax):
        return (torch.func.jvp(lambda x, y, z: gemm(x, y, z), (a, b, bias), (ta, tb, tbias))[1],
                torch.func.jvp(lambda y: gemm_softmax(a, y, -0.5), (b,), (tb,))[1],
                torch.func.jacfwd(lambda x: gemm(x, b))(a[0, :2]))

    def reference(x, y, z=None):
        return x @ y + (0 if z is None else z)

    compiled = torch.compile(lambda: tangents(gemm, gemm_softmax), backend=backend, fullgraph=True)
    want = tangents(reference, lambda x, y, s: torch.softmax(s * (x @ y), -1))
    for got, expected in zip(compiled(), want):
        torch.testing.assert_close(got, expected)


def test_nested_forward_mode_inside_compile_is_refused():
    torch._dynamo.reset()
    (a, b, _), (ta, tb, _) = _jvp_operands()
    nested = torch.compile(
        lambda: torch.func.jvp(lambda y: torch.func.jvp(lambda x: tile_ops.gemm(x, y), (a,), (ta,))[1], (b,), (tb,)),
        backend="aot_eager")
    with pytest.raises(NotImplementedError, match="nested forward-mode AD"):
        nested()


@pytest.mark.parametrize("dynamic", [None, True])
def test_gemm_softmax_with_a_varying_scale_compiles_fullgraph(dynamic):
    """A float scale dynamo does not specialize (dynamic=True, or a second value) is traced, not a float:
    its checks run when the op runs, and still refuse what eager refuses."""
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, s: tile_ops.gemm_softmax(a, b, s), fullgraph=True, dynamic=dynamic,
                      backend="aot_eager")
    a, b = _r(3, 4), _r(4, 6)
    for scale in (0.5, 0.25, -2.0):
        y = f(a, b, scale)
        want = torch.softmax(scale * (a @ b), -1)
        w = torch.randn_like(y)
        torch.testing.assert_close(y, want)
        grads = [torch.autograd.grad((p * w).sum(), (a, b)) for p in (y, want)]
        for got, expected in zip(*grads):
            torch.testing.assert_close(got, expected)
    # torch 2.13 re-raises the op's ValueError; 2.11 (the GPU machine's) wraps it in dynamo's TorchRuntimeError
    refused = (ValueError, torch._dynamo.exc.TorchRuntimeError)
    with pytest.raises(refused, match="scale must be a finite float, got inf"):
        f(a, b, float("inf"))
    with pytest.raises(refused, match="beyond float32's range"):
        f(a, b, 1e39)
