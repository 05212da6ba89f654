"""tile_ops.gemm through its CPU path: correctness, autograd, input checks, empty problems,
and the CUDA launch glue (layouts handed to the kernel) exercised with a stand-in kernel."""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tile_ops
import tile_ops.nn
from tile_ops.ops import matmul

gemm_mod = importlib.import_module("tile_ops.ops.gemm")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOL = {F16: 5e-3, BF16: 1e-2, F32: 1e-5, F64: 1e-12}


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.norm()
    return ((x - ref).norm() / (den if den > 0 else 1.0)).item()


def ref_gemm(a, b, bias=None):
    out = torch.matmul(a.double(), b.double())
    return out if bias is None else out + bias.double()


def rnd(*shape, dtype=F32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


# --------------------------------------------------------------------------- registration


def test_schema_and_registration():
    assert str(torch.ops.tile_ops.gemm.default._schema) == (
        "tile_ops::gemm(Tensor a, Tensor b, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor"
    )
    assert tile_ops.gemm is tile_ops.ops.gemm
    assert "bias" in tile_ops.gemm.__doc__ and "transpose" in tile_ops.gemm.__doc__
    for key in ("CPU", "CUDA", "Meta", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("tile_ops::gemm", key), key


# --------------------------------------------------------------------------- correctness


def _cases():
    # (name, a-maker, b-maker, bias?) with M=13, K=17, N=11, B=3
    M, K, N, B = 13, 17, 11, 3
    return {
        "2d": (lambda d: rnd(M, K, dtype=d), lambda d: rnd(K, N, dtype=d)),
        "batched": (lambda d: rnd(B, M, K, dtype=d), lambda d: rnd(B, K, N, dtype=d)),
        "batched_a_2d_b": (lambda d: rnd(B, M, K, dtype=d), lambda d: rnd(K, N, dtype=d)),
        "2d_a_batched_b": (lambda d: rnd(M, K, dtype=d), lambda d: rnd(B, K, N, dtype=d)),
        "a_t": (lambda d: rnd(K, M, dtype=d).t(), lambda d: rnd(K, N, dtype=d)),
        "b_t": (lambda d: rnd(M, K, dtype=d), lambda d: rnd(N, K, dtype=d).t()),
        "both_t_batched": (
            lambda d: rnd(B, K, M, dtype=d).transpose(1, 2),
            lambda d: rnd(B, N, K, dtype=d).mT,
        ),
        "strided_slices": (lambda d: rnd(M, 2 * K, dtype=d)[:, ::2], lambda d: rnd(K + 16, N, dtype=d)[8:-8]),
        "batch_slice": (lambda d: rnd(2 * B, M, K, dtype=d)[::2], lambda d: rnd(B, K, N, dtype=d)),
    }


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16])
@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_reference(dtype, case, with_bias):
    torch.manual_seed(0)
    make_a, make_b = _cases()[case]
    a, b = make_a(dtype), make_b(dtype)
    bias = rnd(b.shape[-1], dtype=dtype) if with_bias else None
    out = tile_ops.gemm(a, b, bias)
    ref = ref_gemm(a, b, bias)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("in_dtype,out_dtype", [(F16, F32), (BF16, F32), (BF16, F16), (F32, F64), (F64, F32)])
def test_gemm_out_dtype(in_dtype, out_dtype):
    a, b = rnd(2, 9, 7, dtype=in_dtype), rnd(7, 5, dtype=in_dtype)
    bias = rnd(5, dtype=out_dtype)  # bias may be in the output dtype
    out = tile_ops.gemm(a, b, bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (2, 9, 5)
    assert rel_err(out, ref_gemm(a, b, bias)) < max(TOL[in_dtype], TOL[out_dtype])
    # fp32 accumulation: a float32 result of half inputs is better than a half result
    if in_dtype in (F16, BF16) and out_dtype == F32:
        assert rel_err(out, ref_gemm(a, b, bias)) < 1e-5


def test_gemm_op_and_wrapper_agree():
    a, b, bias = rnd(4, 6), rnd(6, 3), rnd(3)
    torch.testing.assert_close(tile_ops.gemm(a, b, bias), torch.ops.tile_ops.gemm(a, b, bias))
    torch.testing.assert_close(
        tile_ops.gemm(a, b, out_dtype=F64), torch.ops.tile_ops.gemm(a, b, out_dtype=F64)
    )


def test_gemm_meta():
    a = torch.empty(3, 5, 7, device="meta", dtype=F16)
    b = torch.empty(7, 9, device="meta", dtype=F16)
    out = tile_ops.gemm(a, b, out_dtype=F32)
    assert out.device.type == "meta" and out.shape == (3, 5, 9) and out.dtype == F32 and out.is_contiguous()


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize(
    "shapes",
    [
        ((5, 7), (7, 3)),
        ((2, 5, 7), (2, 7, 3)),
        ((2, 5, 7), (7, 3)),
        ((5, 7), (2, 7, 3)),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_gradcheck(shapes, with_bias):
    torch.manual_seed(0)
    a = torch.randn(*shapes[0], dtype=F64, requires_grad=True)
    b = torch.randn(*shapes[1], dtype=F64, requires_grad=True)
    bias = torch.randn(shapes[1][-1], dtype=F64, requires_grad=True) if with_bias else None
    inputs = (a, b, bias) if with_bias else (a, b)
    assert torch.autograd.gradcheck(lambda *t: tile_ops.gemm(*t), inputs)
    assert torch.autograd.gradgradcheck(lambda *t: tile_ops.gemm(*t), inputs)


def test_gemm_gradcheck_transposed_views():
    torch.manual_seed(1)
    a = torch.randn(7, 5, dtype=F64, requires_grad=True)
    b = torch.randn(2, 3, 7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tile_ops.gemm(a.t(), b.mT), (a, b))


def test_gemm_grad_half_matches_float64():
    torch.manual_seed(2)
    a = torch.randn(2, 9, 16, dtype=BF16, requires_grad=True)
    b = torch.randn(16, 8, dtype=BF16, requires_grad=True)
    bias = torch.randn(8, dtype=BF16, requires_grad=True)
    g = torch.randn(2, 9, 8)
    tile_ops.gemm(a, b, bias).backward(g.to(BF16))
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref_gemm(a64, b64, bias64).backward(g.to(BF16).double())
    for t, r in ((a, a64), (b, b64), (bias, bias64)):
        assert t.grad.dtype == BF16
        assert rel_err(t.grad, r.grad) < 1e-2


def test_gemm_grad_with_float32_out_dtype():
    a = torch.randn(6, 4, dtype=BF16, requires_grad=True)
    b = torch.randn(4, 5, dtype=BF16, requires_grad=True)
    tile_ops.gemm(a, b, out_dtype=F32).sum().backward()
    assert a.grad.dtype == BF16 and b.grad.dtype == BF16
    assert rel_err(a.grad, torch.ones(6, 5, dtype=F64) @ b.double().t()) < 1e-2


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gemm_backward_uses_tile_ops_gemm_on_views():
    a = torch.randn(2, 5, 7, requires_grad=True)
    b = torch.randn(7, 3, requires_grad=True)  # leaves: AccumulateGrad itself may copy into a view's base
    bias = torch.randn(3, requires_grad=True)
    out = tile_ops.gemm(a, b, bias)
    g = torch.randn_like(out)
    with _OpLog() as log:
        out.backward(g)
    assert log.ops.count("tile_ops.gemm.default") == 2, log.ops
    assert not any("clone" in op or "contiguous" in op or "copy" in op for op in log.ops), log.ops


@pytest.mark.parametrize("needs", [(True, False), (False, True), (True, True)])
def test_gemm_saves_only_what_backward_needs(needs):
    a = torch.randn(4, 6, requires_grad=needs[0])
    b = torch.randn(6, 5, requires_grad=needs[1])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tile_ops.gemm(a, b)
    expected = []
    if needs[0]:
        expected.append(b)  # dA = dC @ B^T
    if needs[1]:
        expected.append(a)  # dB = A^T @ dC
    assert len(saved) == len(expected)
    assert all(any(s is e for e in expected) for s in saved)
    out.sum().backward()
    assert (a.grad is not None) == needs[0] and (b.grad is not None) == needs[1]


# --------------------------------------------------------------------------- empty problems


@pytest.mark.parametrize(
    "a_shape,b_shape,out_shape",
    [
        ((0, 5), (5, 4), (0, 4)),
        ((3, 5), (5, 0), (3, 0)),
        ((0, 5, 3), (0, 3, 4), (0, 5, 4)),
        ((2, 0, 3), (3, 4), (2, 0, 4)),
    ],
)
def test_gemm_empty_output(a_shape, b_shape, out_shape):
    out = tile_ops.gemm(torch.randn(a_shape), torch.randn(b_shape))
    assert out.shape == out_shape


def test_gemm_k_zero_gives_zeros_plus_bias():
    a, b = torch.randn(2, 3, 0, dtype=BF16), torch.randn(0, 4, dtype=BF16)
    out = tile_ops.gemm(a, b)
    assert out.shape == (2, 3, 4) and out.dtype == BF16 and (out == 0).all()
    bias = torch.randn(4, dtype=BF16)
    out = tile_ops.gemm(a, b, bias, out_dtype=F32)
    assert out.dtype == F32
    torch.testing.assert_close(out, bias.float().expand(2, 3, 4))


def test_gemm_empty_backward():
    a = torch.randn(3, 0, requires_grad=True)
    b = torch.randn(0, 4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    tile_ops.gemm(a, b, bias).sum().backward()
    assert a.grad.shape == (3, 0) and b.grad.shape == (0, 4)
    torch.testing.assert_close(bias.grad, torch.full((4,), 3.0))


# --------------------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32)), {}, TypeError,
         r"unsupported input dtype torch\.int32 \(accepted on CPU: float16, bfloat16, float32 or float64"),
        ((torch.ones(2, 3, dtype=F16), torch.ones(3, 2, dtype=BF16)), {}, TypeError,
         r"a and b must have the same dtype, got torch\.float16 and torch\.bfloat16 \(accepted"),
        ((torch.ones(2, 3), torch.ones(4, 2)), {}, ValueError,
         r"inner dimensions do not match: a has shape \(2, 3\) and b has shape \(4, 2\)"),
        ((torch.ones(3), torch.ones(3, 2)), {}, ValueError,
         r"a must be 2-D \(M, K\) or 3-D batched \(B, M, K\), got a 1-D tensor"),
        ((torch.ones(2, 3), torch.ones(1, 1, 3, 2)), {}, ValueError,
         r"b must be 2-D \(K, N\) or 3-D batched \(B, K, N\), got a 4-D tensor"),
        ((torch.ones(2, 4, 3), torch.ones(3, 3, 2)), {}, ValueError,
         r"batch sizes do not match: a has shape \(2, 4, 3\) and b has shape \(3, 3, 2\)"),
        ((torch.ones(2, 3), torch.ones(3, 4), torch.ones(3)), {}, ValueError,
         r"bias must be 1-D of shape \(N,\) = \(4,\).*got shape \(3,\)"),
        ((torch.ones(2, 3), torch.ones(3, 4), torch.ones(1, 4)), {}, ValueError,
         r"bias must be 1-D of shape \(N,\)"),
        ((torch.ones(2, 3), torch.ones(3, 4), torch.ones(4, dtype=F64)), {}, TypeError,
         r"bias dtype torch\.float64 does not match the inputs \(accepted: float32"),
        ((torch.ones(2, 3), torch.ones(3, 4)), {"out_dtype": torch.int32}, TypeError,
         r"unsupported out_dtype torch\.int32 \(accepted on CPU: float16, bfloat16, float32 or float64"),
        ((torch.ones(2, 3), torch.ones(3, 4, device="meta")), {}, RuntimeError,
         r"all tensors must be on the same device, got a on cpu and b on meta"),
        ((torch.ones(2, 3), torch.ones(3, 4), torch.ones(4, device="meta")), {}, RuntimeError,
         r"all tensors must be on the same device, got a on cpu and bias on meta"),
    ],
)
def test_gemm_input_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=r"tile_ops\.gemm: " + match):
        tile_ops.gemm(*args, **kwargs)


def test_gemm_cuda_rules_under_fake_cuda_tensors():
    """The fake impl applies the CUDA dtype rules to (fake) CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(4, 8, device="cuda", dtype=F16)
        b = torch.empty(8, 3, device="cuda", dtype=F16)
        out = tile_ops.gemm(a, b, out_dtype=F32)
        assert out.shape == (4, 3) and out.dtype == F32 and out.device.type == "cuda"
        with pytest.raises(TypeError, match=r"unsupported input dtype torch\.float32 \(accepted on CUDA: float16 or bfloat16"):
            tile_ops.gemm(a.float(), b.float())
        with pytest.raises(TypeError, match=r"unsupported out_dtype torch\.float64 \(accepted on CUDA: float16, bfloat16 or float32"):
            tile_ops.gemm(a, b, out_dtype=F64)
        with pytest.raises(RuntimeError, match=r"got a on cuda:0 and b on cpu"):
            tile_ops.gemm(a, torch.empty(8, 3, dtype=F16))


def test_check_helpers_cuda_kind():
    a, b = torch.ones(2, 3, dtype=F32), torch.ones(3, 4, dtype=F32)
    with pytest.raises(TypeError, match=r"accepted on CUDA: float16 or bfloat16, both the same; cast with"):
        matmul.check_matmul_inputs("tile_ops.gemm", a, b, kind="cuda")
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        matmul.check_matmul_inputs("tile_ops.gemm", [[1.0]], b)
    with pytest.raises(TypeError, match=r"out_dtype must be a torch\.dtype or None"):
        matmul.check_matmul_inputs("tile_ops.gemm", a, b, out_dtype="float32")


# --------------------------------------------------------------------------- CUDA launch glue


def _run_glue(stand_ins, a, b, bias=None, out_dtype=None):
    """The CUDA implementation on CPU tensors: its output and the operands it gave the kernel."""
    gemm_kernels, _ = stand_ins
    out = gemm_mod.GEMM.cuda(a, b, bias, out_dtype)
    return out, gemm_kernels.calls


def _same_storage(x, y):
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


@pytest.mark.parametrize("case", list(_cases()))
def test_cuda_glue_layouts(stand_in_kernels, case):
    torch.manual_seed(3)
    make_a, make_b = _cases()[case]
    a, b = make_a(F16), make_b(F16)
    bias = rnd(b.shape[-1], dtype=F16)
    out, calls = _run_glue(stand_in_kernels, a, b, bias, out_dtype=F32)
    assert len(calls) == 1
    assert out.dtype == F32 and out.shape == ref_gemm(a, b).shape
    assert rel_err(out, ref_gemm(a, b, bias)) < 1e-5
    a3, b3 = calls[0][0], calls[0][1]
    if case != "strided_slices":  # row-major and plain-transposed views are passed in place
        assert _same_storage(a3, a) and _same_storage(b3, b)


def test_cuda_glue_folds_batch_into_m(stand_in_kernels):
    a, b = rnd(4, 5, 8, dtype=BF16), rnd(8, 3, dtype=BF16)
    out, calls = _run_glue(stand_in_kernels, a, b)
    assert calls[0][0].shape == (1, 20, 8) and calls[0][2].shape == (1, 20, 3)
    assert rel_err(out, ref_gemm(a, b)) < 1e-2


def test_cuda_glue_broadcast_uses_zero_batch_stride(stand_in_kernels):
    a, b = rnd(5, 8, dtype=F16), rnd(3, 8, 4, dtype=F16)
    out, calls = _run_glue(stand_in_kernels, a, b)
    assert calls[0][0].shape == (3, 5, 8) and calls[0][0].stride(0) == 0
    assert rel_err(out, ref_gemm(a, b)) < 5e-3


def test_cuda_glue_empty_and_k_zero_do_not_launch(stand_in_kernels):
    out, calls = _run_glue(stand_in_kernels, rnd(0, 8, dtype=F16), rnd(8, 4, dtype=F16))
    assert out.shape == (0, 4) and not calls
    bias = rnd(4, dtype=F16)
    out, calls = _run_glue(stand_in_kernels, rnd(3, 0, dtype=F16), rnd(0, 4, dtype=F16), bias)
    assert not calls and torch.equal(out, bias.expand(3, 4))


def test_cuda_glue_misaligned_pointer_error(stand_in_kernels):
    buf = rnd(1 + 16 * 8, dtype=F16)
    a = buf[1:].view(16, 8)  # storage offset of one element: 2 bytes off
    b = rnd(8, 4, dtype=F16)
    with pytest.raises(ValueError, match=r"tile_ops\.gemm: a's data pointer .* is not 16-byte aligned.*pass a\.clone\(\)"):
        _run_glue(stand_in_kernels, a, b)
    with pytest.raises(ValueError, match=r"b's data pointer .* 16-byte aligned"):
        _run_glue(stand_in_kernels, rnd(4, 8, dtype=F16), buf[1:33].view(8, 4))


def test_a_misaligned_bias_view_is_copied_not_refused():
    """N values are cheap to copy; a view one element into a buffer (torch.randn(65)[1:]) is 4 bytes off."""
    from tile_ops.ops.gemm import prepare_gemm_launch

    a, b = torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 64, dtype=torch.float16)
    bias = torch.randn(65)[1:]
    _, (_, _, _, launched) = prepare_gemm_launch(a, b, bias, torch.float32, kind="cuda")
    assert launched.data_ptr() % 16 == 0 and torch.equal(launched, bias)


@pytest.mark.parametrize("bias_dtype, out_dtype", [(torch.float32, torch.float32), (BF16, BF16),
                                                   (torch.float16, torch.float32)])
def test_cuda_launch_passes_the_bias_in_its_own_dtype(bias_dtype, out_dtype):
    """The CUDA path hands the kernel the bias as given (input or output dtype), not rounded to the inputs'."""
    from tile_ops.ops.gemm import prepare_gemm_launch
    a, b = torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 24, dtype=torch.float16)
    bias = torch.full((24,), 1e5 if bias_dtype == torch.float32 else 1000.5).to(bias_dtype)
    _, (_, _, _, launched) = prepare_gemm_launch(a, b, bias, out_dtype, kind="cuda")
    assert launched.dtype == bias_dtype and torch.equal(launched, bias)


@pytest.mark.parametrize("call, error, message", [
    (lambda a, b: tile_ops.gemm(a, b, out_dtype="float16"), TypeError, "out_dtype must be a torch.dtype or None"),
    (lambda a, b: tile_ops.gemm([[1.0]], b), TypeError, "a must be a torch.Tensor, got list"),
    (lambda a, b: tile_ops.gemm(a, b, [1.0] * 5), TypeError, "bias must be a torch.Tensor, got list"),
    (lambda a, b: tile_ops.gemm_softmax(a, b, None), TypeError, "scale must be a real number .*, got NoneType"),
    (lambda a, b: tile_ops.gemm_softmax(a, b, True), TypeError, "scale must be a real number .*, got bool"),
    (lambda a, b: tile_ops.gemm_softmax(a, b, 10**400), ValueError, "scale must be a finite float"),
    (lambda a, b: tile_ops.gemm_softmax(a, b, 2**1024 - 2**969), ValueError, "scale must be a finite float"),
    (lambda a, b: tile_ops.gemm_softmax(a, "b"), TypeError, "b must be a torch.Tensor, got str"),
])
def test_arguments_of_the_wrong_type_are_refused_in_the_ops_words(call, error, message):
    """Not the dispatcher's 'Expected a value of type Optional[int]', and never a bool taken as a scale."""
    with pytest.raises(error, match=message):
        call(torch.randn(5, 4), torch.randn(4, 5))


def test_autocast_casts_like_torch_matmul_and_softmax():
    a, b, bias = torch.randn(8, 16), torch.randn(16, 24), torch.randn(24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tile_ops.gemm(a, b, bias)
        assert out.dtype == torch.matmul(a, b).dtype == torch.bfloat16
        assert tile_ops.gemm(a.double(), b.double()).dtype == torch.float64  # float64 is not cast
        p = tile_ops.gemm_softmax(a, b, 0.5)
        assert p.dtype == torch.softmax(0.5 * (a @ b), -1).dtype == torch.bfloat16  # (float32 on CUDA)
    ref = (a.bfloat16().float() @ b.bfloat16().float() + bias.bfloat16().float()).bfloat16()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # bf16 results: an ulp or so apart
    ref = torch.softmax(0.5 * (a.bfloat16().float() @ b.bfloat16().float()), -1).bfloat16()
    torch.testing.assert_close(p, ref, rtol=2e-2, atol=2e-3)
    compiled = torch.compile(lambda a, b: tile_ops.gemm(a, b), fullgraph=True)  # the casts trace too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(a, b).dtype == torch.bfloat16


def _jvp_cases():
    torch.manual_seed(3)
    a, b, bias = (torch.randn(*s, dtype=torch.float64) for s in ((2, 6, 5), (5, 4), (4,)))
    ta, tb, tbias = (torch.randn_like(x) for x in (a, b, bias))
    return a, b, bias, ta, tb, tbias


def test_forward_mode_tangents_are_the_products_not_zeros():
    """A custom op has no forward-mode formula: func.jvp gave a zero tangent and forward_ad none."""
    import torch.autograd.forward_ad as fwAD

    a, b, bias, ta, tb, tbias = _jvp_cases()
    want = torch.func.jvp(lambda x, y, z: torch.matmul(x, y) + z, (a, b, bias), (ta, tb, tbias))
    got = torch.func.jvp(lambda x, y, z: tile_ops.gemm(x, y, z), (a, b, bias), (ta, tb, tbias))
    torch.testing.assert_close(got, want)
    only_b = torch.func.jvp(lambda y: tile_ops.gemm(a, y), (b,), (tb,))[1]
    torch.testing.assert_close(only_b, a @ tb)
    for scale in (0.5, -2.0):
        want = torch.func.jvp(lambda x, y: torch.softmax(scale * (x @ y), -1), (a, b), (ta, tb))
        got = torch.func.jvp(lambda x, y: tile_ops.gemm_softmax(x, y, scale), (a, b), (ta, tb))
        torch.testing.assert_close(got, want)
    with fwAD.dual_level():
        y = tile_ops.gemm(fwAD.make_dual(a, ta), b)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, ta @ b)
    lin = tile_ops.nn.Linear(5, 4).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jvp(lin, (x,), (ta[0, :3],))[1], ta[0, :3] @ lin.weight.t())


def test_nested_forward_mode_is_refused():
    """The tangent of an outer forward level would be zero: refused, not returned (forward_ad itself refuses
    nested dual levels)."""
    a, b, _, ta, tb, _ = _jvp_cases()
    a, ta = a[0], ta[0]
    with pytest.raises(NotImplementedError, match="nested forward-mode AD .* is not supported"):
        torch.func.jacfwd(torch.func.jacfwd(lambda x: tile_ops.gemm(x, x.T.contiguous()).sum()))(a[:4, :4])
    with pytest.raises(NotImplementedError, match="nested forward-mode AD"):
        torch.func.jvp(lambda y: torch.func.jvp(lambda x: tile_ops.gemm(x, y), (a,), (ta,))[1], (b,), (tb,))


@pytest.mark.parametrize("call, message", [
    (lambda a, b: tile_ops.gemm(a.to_sparse(), b), r"a must be a dense tensor .*got a sparse_coo .*a\.to_dense\(\)"),
    (lambda a, b: tile_ops.gemm(a, b.to_sparse_csr()), r"b must be a dense .*got a sparse_csr .*b\.to_dense\(\)"),
    (lambda a, b: tile_ops.gemm(a, b, torch.randn(5).to_sparse()), r"bias must be a dense .*got a sparse_coo"),
    (lambda a, b: tile_ops.gemm(torch.nested.nested_tensor([a, a[:2]]), b), r"a must be a dense .*got a nested tensor"),
    (lambda a, b: tile_ops.gemm_softmax(torch.nested.nested_tensor([a, a[:2]], layout=torch.jagged), b),
     r"a must be a dense .*got a nested tensor .*to_padded_tensor"),
    (lambda a, b: tile_ops.gemm(torch.quantize_per_tensor(a, 0.1, 0, torch.qint8), b),
     r"a must be a dense .*got a quantized tensor .*a\.dequantize\(\)"),
    (lambda a, b: tile_ops.nn.Linear(4, 5)(a.to_sparse()), r"a must be a dense tensor .*got a sparse_coo"),
    # the same through the dispatcher (ops/dense_only.py), autograd's path included
    (lambda a, b: torch.ops.tile_ops.gemm(a.to_sparse(), b), r"a must be a dense tensor .*got a sparse_coo"),
    (lambda a, b: torch.ops.tile_ops.gemm(a, b.to_sparse_csr().requires_grad_()), r"b must be a dense .*sparse_csr"),
    (lambda a, b: torch.ops.tile_ops.gemm(a, b, torch.randn(5).to_sparse()), r"bias must be a dense .*sparse_coo"),
    (lambda a, b: torch.ops.tile_ops.gemm(a.to_sparse().to("meta"), b.to("meta")), r"a must be a dense .*sparse_coo"),
    (lambda a, b: torch.ops.tile_ops.gemm_softmax(torch.nested.nested_tensor([a, a[:2]]), b),
     r"a must be a dense .*got a nested tensor"),
    (lambda a, b: torch.ops.tile_ops.gemm(torch.nested.nested_tensor([a, a[:2]], layout=torch.jagged), b),
     r"a must be a dense .*got a nested tensor .*to_padded_tensor"),
    (lambda a, b: torch.ops.tile_ops.gemm_softmax(torch.quantize_per_tensor(a, 0.1, 0, torch.qint8), b),
     r"a must be a dense .*got a quantized tensor"),
])
@pytest.mark.filterwarnings("ignore::UserWarning")  # nested and quantized tensors' prototype / deprecation notes
def test_sparse_nested_and_quantized_operands_are_refused_in_the_ops_words(call, message):
    """Not the dispatcher's "Could not run 'tile_ops::gemm' with arguments from the 'SparseCPU' backend", nor a
    jagged nested tensor's bare NotImplementedError."""
    with pytest.raises(ValueError, match=r"tile_ops\.gemm(_softmax)?: " + message):
        call(torch.randn(3, 4), torch.randn(4, 5))
