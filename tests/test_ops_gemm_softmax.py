"""tile_ops.gemm_softmax through its CPU path: correctness, autograd, input checks, empty problems,
and the CUDA launch glue exercised with a stand-in kernel."""

import importlib
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tile_ops

gs_mod = importlib.import_module("tile_ops.ops.gemm_softmax")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOL = {F16: 5e-3, BF16: 1e-2, F32: 1e-5, F64: 1e-12}


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.norm()
    return ((x - ref).norm() / (den if den > 0 else 1.0)).item()


def ref_gemm_softmax(a, b, scale=1.0):
    return torch.softmax(torch.matmul(a.double(), b.double()) * scale, dim=-1)


def rnd(*shape, dtype=F32):
    return torch.randn(*shape).to(dtype)


def test_schema_and_registration():
    assert str(torch.ops.tile_ops.gemm_softmax.default._schema) == (
        "tile_ops::gemm_softmax(Tensor a, Tensor b, Scalar scale=1., ScalarType? out_dtype=None) -> Tensor"
    )
    assert tile_ops.gemm_softmax is tile_ops.ops.gemm_softmax
    assert "softmax" in tile_ops.gemm_softmax.__doc__
    for key in ("CPU", "CUDA", "Meta", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("tile_ops::gemm_softmax", key), key


def _cases():
    M, K, N, B = 13, 17, 11, 3
    return {
        "2d": (lambda d: rnd(M, K, dtype=d), lambda d: rnd(K, N, dtype=d)),
        "batched": (lambda d: rnd(B, M, K, dtype=d), lambda d: rnd(B, K, N, dtype=d)),
        "batched_a_2d_b": (lambda d: rnd(B, M, K, dtype=d), lambda d: rnd(K, N, dtype=d)),
        "2d_a_batched_b": (lambda d: rnd(M, K, dtype=d), lambda d: rnd(B, K, N, dtype=d)),
        "transposed": (lambda d: rnd(B, K, M, dtype=d).mT, lambda d: rnd(N, K, dtype=d).t()),
        "strided": (lambda d: rnd(M, 2 * K, dtype=d)[:, 1::2], lambda d: rnd(K, N, dtype=d)),
    }


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16])
@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_gemm_softmax_matches_reference(dtype, case, scale):
    torch.manual_seed(0)
    make_a, make_b = _cases()[case]
    a, b = make_a(dtype), make_b(dtype)
    out = tile_ops.gemm_softmax(a, b, scale)
    ref = ref_gemm_softmax(a, b, scale)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("in_dtype,out_dtype", [(F16, F32), (BF16, F32), (F16, BF16), (F64, F32)])
def test_gemm_softmax_out_dtype(in_dtype, out_dtype):
    a, b = rnd(2, 9, 7, dtype=in_dtype), rnd(2, 7, 5, dtype=in_dtype)
    out = tile_ops.gemm_softmax(a, b, 0.5, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (2, 9, 5)
    assert rel_err(out, ref_gemm_softmax(a, b, 0.5)) < max(TOL[in_dtype], TOL[out_dtype])


def test_gemm_softmax_rows_sum_to_one_and_int_scale():
    a, b = rnd(6, 8), rnd(8, 10)
    out = tile_ops.gemm_softmax(a, b, 2)  # an int scale is accepted as a float
    torch.testing.assert_close(out.sum(-1), torch.ones(6))
    torch.testing.assert_close(out, ref_gemm_softmax(a, b, 2.0).float())


def test_gemm_softmax_large_logits_are_stable():
    a, b = rnd(4, 8) * 100, rnd(8, 6) * 100
    out = tile_ops.gemm_softmax(a, b)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_gemm_softmax(a, b)) < 1e-4


def test_gemm_softmax_meta():
    a = torch.empty(3, 5, 7, device="meta", dtype=BF16)
    b = torch.empty(3, 7, 9, device="meta", dtype=BF16)
    out = tile_ops.gemm_softmax(a, b, 0.1, out_dtype=F32)
    assert out.device.type == "meta" and out.shape == (3, 5, 9) and out.dtype == F32


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize(
    "shapes",
    [((5, 7), (7, 3)), ((2, 5, 7), (2, 7, 3)), ((2, 5, 7), (7, 3)), ((5, 7), (2, 7, 3))],
)
def test_gemm_softmax_gradcheck(shapes):
    torch.manual_seed(0)
    a = torch.randn(*shapes[0], dtype=F64, requires_grad=True)
    b = torch.randn(*shapes[1], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tile_ops.gemm_softmax(a, b, 0.7), (a, b))
    assert torch.autograd.gradcheck(lambda a, b: tile_ops.gemm_softmax(a, b), (a, b))


def test_gemm_softmax_gradgradcheck_and_transposed():
    torch.manual_seed(1)
    a = torch.randn(7, 4, dtype=F64, requires_grad=True)
    b = torch.randn(3, 7, dtype=F64, requires_grad=True)
    fn = lambda a, b: tile_ops.gemm_softmax(a.t(), b.t(), -1.3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))


def test_gemm_softmax_grad_half_matches_float64():
    torch.manual_seed(2)
    a = torch.randn(2, 9, 16, dtype=F16, requires_grad=True)
    b = torch.randn(2, 16, 8, dtype=F16, requires_grad=True)
    g = torch.randn(2, 9, 8)
    tile_ops.gemm_softmax(a, b, 0.25).backward(g.to(F16))
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ref_gemm_softmax(a64, b64, 0.25).backward(g.to(F16).double())
    for t, r in ((a, a64), (b, b64)):
        assert t.grad.dtype == F16
        assert rel_err(t.grad, r.grad) < 5e-3


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gemm_softmax_backward_uses_two_tile_ops_gemms():
    a = torch.randn(2, 5, 7, requires_grad=True)
    b = torch.randn(2, 7, 3, requires_grad=True)
    out = tile_ops.gemm_softmax(a, b, 0.5)
    g = torch.randn_like(out)
    with _OpLog() as log:
        out.backward(g)
    assert log.ops.count("tile_ops.gemm.default") == 2, log.ops
    assert "tile_ops.gemm_softmax.default" not in log.ops  # nothing recomputed: P was saved


@pytest.mark.parametrize("needs", [(True, False), (False, True), (True, True)])
def test_gemm_softmax_saves_only_what_backward_needs(needs):
    a = torch.randn(4, 6, requires_grad=needs[0])
    b = torch.randn(6, 5, requires_grad=needs[1])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tile_ops.gemm_softmax(a, b, 0.3)
    expected = [out] + ([b] if needs[0] else []) + ([a] if needs[1] else [])
    assert len(saved) == len(expected)
    assert all(any(s is e for e in expected) for s in saved)
    out.pow(2).sum().backward()
    assert (a.grad is not None) == needs[0] and (b.grad is not None) == needs[1]


# --------------------------------------------------------------------------- empty problems


@pytest.mark.parametrize(
    "a_shape,b_shape,out_shape",
    [((0, 5), (5, 4), (0, 4)), ((3, 5), (5, 0), (3, 0)), ((0, 3, 5), (0, 5, 4), (0, 3, 4))],
)
def test_gemm_softmax_empty_output(a_shape, b_shape, out_shape):
    out = tile_ops.gemm_softmax(torch.randn(a_shape), torch.randn(b_shape))
    assert out.shape == out_shape


def test_gemm_softmax_k_zero_is_uniform():
    a = torch.randn(2, 3, 0, dtype=F16, requires_grad=True)
    b = torch.randn(0, 4, dtype=F16, requires_grad=True)
    out = tile_ops.gemm_softmax(a, b, 3.0)
    assert out.shape == (2, 3, 4) and out.dtype == F16
    torch.testing.assert_close(out, torch.full((2, 3, 4), 0.25, dtype=F16))
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


# --------------------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64)), {}, TypeError,
         r"unsupported input dtype torch\.int64 \(accepted on CPU: float16, bfloat16, float32 or float64"),
        ((torch.ones(2, 3, dtype=BF16), torch.ones(3, 2, dtype=F32)), {}, TypeError,
         r"a and b must have the same dtype, got torch\.bfloat16 and torch\.float32"),
        ((torch.ones(2, 3), torch.ones(2, 2)), {}, ValueError,
         r"inner dimensions do not match: a has shape \(2, 3\) and b has shape \(2, 2\)"),
        ((torch.ones(1, 1, 2, 3), torch.ones(3, 2)), {}, ValueError, r"a must be 2-D \(M, K\) or 3-D"),
        ((torch.ones(2, 3), torch.ones(2)), {}, ValueError, r"b must be 2-D \(K, N\) or 3-D"),
        ((torch.ones(2, 2, 3), torch.ones(4, 3, 2)), {}, ValueError, r"batch sizes do not match"),
        ((torch.ones(2, 3), torch.ones(3, 2), math.inf), {}, ValueError,
         r"scale must be a finite float, got inf"),
        ((torch.ones(2, 3), torch.ones(3, 2), math.nan), {}, ValueError,
         r"scale must be a finite float, got nan"),
        ((torch.ones(2, 3), torch.ones(3, 2)), {"out_dtype": torch.bool}, TypeError,
         r"unsupported out_dtype torch\.bool"),
        ((torch.ones(2, 3, device="meta"), torch.ones(3, 2)), {}, RuntimeError,
         r"all tensors must be on the same device, got a on meta and b on cpu"),
    ],
)
def test_gemm_softmax_input_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=r"tile_ops\.gemm_softmax: " + match):
        tile_ops.gemm_softmax(*args, **kwargs)


def test_gemm_softmax_cuda_rules_under_fake_cuda_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(4, 8, device="cuda", dtype=BF16)
        b = torch.empty(8, 3, device="cuda", dtype=BF16)
        assert tile_ops.gemm_softmax(a, b, 0.5).shape == (4, 3)
        with pytest.raises(TypeError, match=r"tile_ops\.gemm_softmax: unsupported input dtype torch\.float64 \(accepted on CUDA"):
            tile_ops.gemm_softmax(a.double(), b.double())


# --------------------------------------------------------------------------- CUDA launch glue


def _run_glue(stand_ins, a, b, scale=1.0, out_dtype=None):
    """The CUDA implementation on CPU tensors: its output and the (a2, b2, out2, scale) of each launch."""
    _, softmax_kernels = stand_ins
    out = gs_mod.GEMM_SOFTMAX.cuda(a, b, scale, out_dtype)
    return out, softmax_kernels.calls


@pytest.mark.parametrize("case", list(_cases()))
def test_cuda_glue(stand_in_kernels, case):
    torch.manual_seed(4)
    make_a, make_b = _cases()[case]
    a, b = make_a(F16), make_b(F16)
    out, calls = _run_glue(stand_in_kernels, a, b, 0.3, out_dtype=F32)
    assert out.dtype == F32 and out.is_contiguous()
    assert rel_err(out, ref_gemm_softmax(a, b, 0.3)) < 1e-5
    expected_launches = 3 if case in ("batched", "2d_a_batched_b") else 1
    assert len(calls) == expected_launches


def test_cuda_glue_misaligned_batch_pitch_is_padded(stand_in_kernels):
    # M*K and M*N are odd: batch entries of a contiguous tensor are not 16-byte aligned.
    a, b = rnd(3, 5, 7, dtype=BF16), rnd(3, 7, 9, dtype=BF16)
    out, calls = _run_glue(stand_in_kernels, a, b, 1.0)
    assert len(calls) == 3 and out.shape == (3, 5, 9)
    assert rel_err(out, ref_gemm_softmax(a, b)) < 1e-2


def test_cuda_glue_empty_and_k_zero(stand_in_kernels):
    out, calls = _run_glue(stand_in_kernels, rnd(0, 8, dtype=F16), rnd(8, 4, dtype=F16))
    assert out.shape == (0, 4) and not calls
    out, calls = _run_glue(stand_in_kernels, rnd(3, 0, dtype=F16), rnd(0, 5, dtype=F16))
    assert not calls and torch.equal(out, torch.full((3, 5), 0.2, dtype=F16))


def test_cuda_glue_misaligned_pointer_error(stand_in_kernels):
    buf = rnd(1 + 8 * 8, dtype=F16)
    with pytest.raises(ValueError, match=r"tile_ops\.gemm_softmax: b's data pointer .* not 16-byte aligned"):
        _run_glue(stand_in_kernels, rnd(4, 8, dtype=F16), buf[1:].view(8, 8))


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("scale", [1e39, -1e39, 10**39])
def test_a_scale_beyond_float32_is_refused_for_float32_scores(dtype, scale):
    """Scores of non-float64 inputs are float32, where such a scale is inf: rows of NaN, not a softmax."""
    a, b = torch.randn(3, 4, dtype=dtype), torch.randn(4, 5, dtype=dtype)
    # the op's Scalar takes ints of int64 only (test_the_op_takes_python_numbers_the_wrapper_any_real_number)
    direct = (torch.ops.tile_ops.gemm_softmax,) if isinstance(scale, float) else ()
    for call in (tile_ops.gemm_softmax, *direct):
        with pytest.raises(ValueError, match=r"tile_ops\.gemm_softmax: scale -?1e\+39 is beyond float32's range"):
            call(a, b, scale)


def test_float64_inputs_take_any_finite_scale():
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    p = tile_ops.gemm_softmax(a, b, 1e39)
    assert torch.equal(p, torch.nn.functional.one_hot((a @ b).argmax(-1), 5).to(F64))
    uniform = tile_ops.gemm_softmax(torch.zeros(3, 4), b.float(), torch.finfo(F32).max)  # the bound is accepted
    assert torch.equal(uniform, torch.full((3, 5), 0.2))


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.int64(2), 2])
def test_real_number_scales_are_taken_like_the_op_takes_them(scale):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    python = scale.item() if isinstance(scale, np.generic) else scale  # the op's Scalar takes Python numbers
    torch.testing.assert_close(tile_ops.gemm_softmax(a, b, scale), torch.ops.tile_ops.gemm_softmax(a, b, python))
    torch.testing.assert_close(tile_ops.gemm_softmax(a, b, scale), torch.softmax(float(scale) * (a @ b), -1))


@pytest.mark.parametrize("scale", [np.bool_(True), torch.tensor(0.5), 1j])
def test_non_real_scales_are_refused(scale):
    with pytest.raises(TypeError, match=r"tile_ops\.gemm_softmax: scale must be a real number"):
        tile_ops.gemm_softmax(torch.randn(3, 4), torch.randn(4, 5), scale)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("scale, error, message", [
    (True, TypeError, r"tile_ops\.gemm_softmax: scale must be a real number .*got bool"),
    (False, TypeError, r"tile_ops\.gemm_softmax: scale must be a real number .*got bool"),
    (torch.tensor(0.5), RuntimeError, r"Expected a value of type 'number' for argument 'scale' but instead found "
                                      r"type 'Tensor'"),
    (torch.tensor([2.0], requires_grad=True), RuntimeError, r"for argument 'scale' but instead found type 'Tensor'"),
    (np.bool_(True), RuntimeError, r"for argument 'scale' but instead found type 'bool'"),
    (1j, TypeError, r"tile_ops\.gemm_softmax: scale must be a real number .*got complex"),
])
def test_the_op_called_directly_refuses_what_the_wrapper_refuses(device, scale, error, message):
    """Issue 45, item 7: a bool or a tensor ``scale`` reached the op's implementations as a float (1.0, 0.5: the
    dispatcher converts for a ``float`` argument), so the op computed silently what the wrapper refuses."""
    a, b = torch.randn(3, 4, device=device), torch.randn(4, 5, device=device)
    for op in (torch.ops.tile_ops.gemm_softmax, torch.ops.tile_ops.gemm_softmax.default):
        with pytest.raises(error, match=message):
            op(a, b, scale)
        with pytest.raises(error, match=message):
            op(a, b, scale=scale)
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        tile_ops.gemm_softmax(a, b, scale)


def test_the_op_refuses_a_bool_scale_under_compile():
    f = torch.compile(lambda a, b: torch.ops.tile_ops.gemm_softmax(a, b, True), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"scale must be a real number .*got bool"):
        f(torch.randn(3, 4), torch.randn(4, 5))


@pytest.mark.parametrize("scale", [np.float32(0.5), np.int64(2), 10**39])
def test_the_op_takes_python_numbers_the_wrapper_any_real_number(scale):
    """The op's ``Scalar scale`` takes Python ints (of int64) and floats; NumPy's float32 and int64 and larger ints
    the dispatcher refuses, and the wrapper passes them to the op as floats."""
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    with pytest.raises((RuntimeError, OverflowError)):
        torch.ops.tile_ops.gemm_softmax(a, b, scale)
    torch.testing.assert_close(tile_ops.gemm_softmax(a, b, scale), torch.ops.tile_ops.gemm_softmax(a, b, float(scale)))


def test_int_scales_reach_the_op_as_ints():
    """The wrapper passes a Python int or float as given (the fast path's plans key on its type)."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.tile_ops.gemm_softmax.default:
                seen.append(args[2])
            return func(*args, **(kwargs or {}))

    with Spy():
        tile_ops.gemm_softmax(torch.randn(3, 4), torch.randn(4, 5), 2)
        tile_ops.gemm_softmax(torch.randn(3, 4), torch.randn(4, 5), 0.5)
    assert [(type(s), s) for s in seen] == [(int, 2), (float, 0.5)]


@pytest.mark.parametrize("call", ["op", "wrapper"])
def test_an_int_scale_compiles_symbolic(call):
    """Under dynamic=True an int scale is traced as a SymInt, which the op's ``Scalar`` passes to the fake as is."""
    torch._dynamo.reset()
    run = torch.ops.tile_ops.gemm_softmax if call == "op" else tile_ops.gemm_softmax
    f = torch.compile(lambda a, b, s: run(a, b, s), fullgraph=True, dynamic=True, backend="aot_eager")
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for scale in (2, 3):
        torch.testing.assert_close(f(a, b, scale), torch.softmax(scale * (a @ b), -1))
