"""The eager fast path (tile_ops/ops/fastpath.py, csrc/plans.cpp) on the CPU, with the stand-in kernels.

CPU tensors are sent through the ops' CUDA implementations (the dispatcher's CPU kernel is
pointed at them), so plans are recorded for CPU signatures and ``tile_ops.gemm`` /
``tile_ops.gemm_softmax`` take the fast path for them exactly as they do for CUDA tensors: the
extension's checks, signature lookup and allocation, then the stand-in's launch (a host-code
plan) instead of the driver's.
"""

import importlib
import itertools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tile_ops
import tile_ops.nn
from tile_ops.compiler.meta import PlanExpr
from tile_ops.ops import fastpath

GEMM = importlib.import_module("tile_ops.ops.gemm").GEMM  # the op's OpSpec (tile_ops.ops.gemm is the function)
GEMM_SOFTMAX = importlib.import_module("tile_ops.ops.gemm_softmax").GEMM_SOFTMAX

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Counter:
    """Counts the calls that went through the dispatcher into an op's (CUDA) implementation."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def ops(stand_in_kernels, monkeypatch):
    """CPU calls of the ops run their CUDA implementations: (gemm op counter, gemm_softmax op counter, stand-ins)."""
    gemm_op = Counter(GEMM.cuda)
    softmax_op = Counter(GEMM_SOFTMAX.cuda)
    monkeypatch.setitem(GEMM.op._backend_fns, "cpu", gemm_op)
    monkeypatch.setitem(GEMM_SOFTMAX.op._backend_fns, "cpu", softmax_op)
    return gemm_op, softmax_op, stand_in_kernels


def rnd(*shape, dtype=F16):
    return torch.randn(*shape).to(dtype)


def same_signature(t):
    """A fresh tensor with ``t``'s shape, strides and dtype, and new values."""
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(torch.randn(t.shape))


def ref_gemm(a, b, bias=None, out_dtype=None):
    out = torch.matmul(a.float(), b.float())
    return (out if bias is None else out + bias.float()).to(out_dtype or a.dtype)


def ref_gemm_softmax(a, b, scale, out_dtype=None):
    return torch.softmax(torch.matmul(a.float(), b.float()) * scale, -1).to(out_dtype or a.dtype)


def close(x, ref):
    torch.testing.assert_close(x, ref, rtol=1e-2, atol=1e-2)


GEMM_CASES = {  # name -> (a, b, bias, out_dtype); M, K, N = 16, 32, 24
    "2d": lambda: (rnd(16, 32), rnd(32, 24), None, None),
    "bias_out_f32": lambda: (rnd(16, 32), rnd(32, 24), rnd(24), F32),
    "bf16_bias": lambda: (rnd(16, 32, dtype=BF16), rnd(32, 24, dtype=BF16), rnd(24, dtype=BF16), None),
    "batched": lambda: (rnd(3, 16, 32), rnd(3, 32, 24), None, None),
    "batched_a_2d_b": lambda: (rnd(3, 16, 32), rnd(32, 24), None, None),
    "2d_a_batched_b": lambda: (rnd(16, 32), rnd(3, 32, 24), None, None),
    "a_t": lambda: (rnd(32, 16).t(), rnd(32, 24), None, None),
    "b_t_bias": lambda: (rnd(16, 32), rnd(24, 32).t(), rnd(24), None),
    "both_t_batched": lambda: (rnd(3, 32, 16).mT, rnd(3, 24, 32).mT, None, None),
}

SOFTMAX_CASES = {  # name -> (a, b, scale, out_dtype): the ones the kernel runs in one launch
    "2d": lambda: (rnd(16, 32), rnd(32, 24), 0.125, None),
    "out_f32": lambda: (rnd(16, 32, dtype=BF16), rnd(32, 24, dtype=BF16), 1.0, F32),
    "batched_a_2d_b": lambda: (rnd(3, 16, 32), rnd(32, 24), -0.5, None),
    "batch_of_one": lambda: (rnd(1, 16, 32), rnd(1, 32, 24), 2.0, None),
}


# --------------------------------------------------------------------------- taken


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_gemm_repeated_signature_skips_the_op(ops, case):
    gemm_op, _, (kernels, _) = ops
    torch.manual_seed(0)
    a, b, bias, out_dtype = GEMM_CASES[case]()
    first = tile_ops.gemm(a, b, bias, out_dtype)
    assert (gemm_op.n, kernels.launches, fastpath.count()) == (1, 1, 1)
    a2, b2, bias2 = same_signature(a), same_signature(b), same_signature(bias)
    second = tile_ops.gemm(a2, b2, bias2, out_dtype)
    assert (gemm_op.n, kernels.launches, len(kernels.calls)) == (1, 2, 1)  # launched from the plan
    close(first, ref_gemm(a, b, bias, out_dtype))
    close(second, ref_gemm(a2, b2, bias2, out_dtype))
    assert second.shape == first.shape and second.dtype == first.dtype and second.is_contiguous()


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_gemm_softmax_repeated_signature_skips_the_op(ops, case):
    _, softmax_op, (_, kernels) = ops
    torch.manual_seed(1)
    a, b, scale, out_dtype = SOFTMAX_CASES[case]()
    close(tile_ops.gemm_softmax(a, b, scale, out_dtype), ref_gemm_softmax(a, b, scale, out_dtype))
    a2, b2 = same_signature(a), same_signature(b)
    close(tile_ops.gemm_softmax(a2, b2, scale, out_dtype), ref_gemm_softmax(a2, b2, scale, out_dtype))
    assert (softmax_op.n, kernels.launches, len(kernels.calls)) == (1, 2, 1)
    tile_ops.gemm_softmax(a2, b2, scale / 2, out_dtype)  # the scale is part of the signature
    assert softmax_op.n == 2


def test_a_changed_tune_table_drops_the_plans(ops, tmp_path, monkeypatch):
    """A plan launches the config chosen when it was recorded: a new tuned entry must reach the next call."""
    import dataclasses

    from tile_ops import autotune

    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    tile_ops.gemm(rnd(16, 32), rnd(32, 24))
    assert fastpath.count() == 1
    autotune.record("gemm", (16, 24, 32), "float16", "SOME GPU", dataclasses.make_dataclass("Cfg", [])())
    assert fastpath.count() == 0
    tile_ops.gemm(rnd(16, 32), rnd(32, 24))
    assert fastpath.count() == 1
    autotune.TuneTable().clear()
    assert fastpath.count() == 0


def test_a_planned_signature_under_forward_mode_gets_its_tangent(ops):
    """The fast path's gate looks only at forward_ad's level: functorch's tensors are wrapped, and a plan serves
    plain tensors only."""
    import torch.autograd.forward_ad as fwAD

    a, b, t = rnd(16, 32), rnd(32, 24), rnd(16, 32)
    tile_ops.gemm(a, b)
    assert fastpath.count() == 1
    out, tangent = torch.func.jvp(lambda x: tile_ops.gemm(x, b), (a,), (t,))
    close(tangent, ref_gemm(t, b, None, None))
    with fwAD.dual_level():
        y = tile_ops.gemm(fwAD.make_dual(a, t), b)
        close(fwAD.unpack_dual(y).tangent, ref_gemm(t, b, None, None))


def test_op_path_launches_from_the_plan_too(ops):
    gemm_op, softmax_op, (kernels, softmax_kernels) = ops
    a, b = rnd(16, 32), rnd(32, 24)
    for _ in range(3):
        close(torch.ops.tile_ops.gemm(a, b), ref_gemm(a, b))
        close(torch.ops.tile_ops.gemm_softmax(a, b, 0.5), ref_gemm_softmax(a, b, 0.5))
    assert (gemm_op.n, kernels.launches, len(kernels.calls)) == (3, 3, 1)  # checked once
    assert (softmax_op.n, softmax_kernels.launches, len(softmax_kernels.calls)) == (3, 3, 1)


def test_no_grad_and_inference_mode_take_the_fast_path(ops):
    gemm_op, _, _ = ops
    a, b = rnd(16, 32).requires_grad_(), rnd(32, 24).requires_grad_()
    with torch.no_grad():
        tile_ops.gemm(a, b)
        tile_ops.gemm(a, b)
    with torch.inference_mode():
        out = tile_ops.gemm(a, b)
    assert gemm_op.n == 1 and not out.requires_grad


def test_linear_is_a_torch_linear_and_infers_on_the_fast_path(ops):
    gemm_op, _, _ = ops
    lin = tile_ops.nn.Linear(32, 24, dtype=F16)
    assert isinstance(lin, torch.nn.Linear)
    x = rnd(4, 4, 32)
    with torch.no_grad():
        y = [lin(x) for _ in range(3)]
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).to(F16)
    assert gemm_op.n == 1
    for out in y:
        close(out, ref)


# --------------------------------------------------------------------------- not taken


def test_not_planned_when_the_checked_path_copies(ops):
    gemm_op, softmax_op, _ = ops
    a, b = rnd(16, 64)[:, ::2], rnd(32, 24)  # a strided view: copied for the kernel
    for _ in range(2):
        close(tile_ops.gemm(a, b), ref_gemm(a, b))
    a3, b3 = rnd(3, 16, 32), rnd(3, 32, 24)  # one launch per batch entry
    for _ in range(2):
        close(tile_ops.gemm_softmax(a3, b3, 0.5), ref_gemm_softmax(a3, b3, 0.5))
    assert gemm_op.n == 2 and softmax_op.n == 2
    assert fastpath.count() == 0


def test_grad_mode_goes_through_the_op_and_gradients_flow(ops):
    gemm_op, softmax_op, (kernels, _) = ops
    torch.manual_seed(2)
    a, b, bias, keys = (rnd(*s).requires_grad_() for s in ((2, 16, 32), (32, 24), (24,), (24, 8)))
    weights = torch.randn(2, 16, 8)
    calls = []
    for _ in range(2):
        for t in (a, b, bias, keys):
            t.grad = None
        p = tile_ops.gemm_softmax(tile_ops.gemm(a, b, bias), keys, 0.25)
        (p.float() * weights).sum().backward()
        calls.append((gemm_op.n, softmax_op.n, kernels.launches))
    # step 1: the forward gemm and the backward's four gemms through the op; step 2: the forward
    # through the op, the backward's gemms (which build no graph) from their plans
    assert calls == [(5, 1, 5), (6, 2, 10)]
    refs = [t.detach().float().requires_grad_() for t in (a, b, bias, keys)]
    ra, rb, rbias, rkeys = refs
    (torch.softmax(torch.matmul(torch.matmul(ra, rb) + rbias, rkeys) * 0.25, -1) * weights).sum().backward()
    for t, r in zip((a, b, bias, keys), refs):
        assert t.grad.abs().sum() > 0
        torch.testing.assert_close(t.grad.float(), r.grad, rtol=2e-2, atol=2e-2)


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("context", ["dispatch_mode", "function_mode", "compiling"])
def test_interception_goes_through_the_op(ops, monkeypatch, context):
    gemm_op, _, _ = ops
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)
    if context == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with {"dispatch_mode": _Seen, "function_mode": lambda: torch.device("cpu")}.get(context, torch.no_grad)():
        tile_ops.gemm(a, b)
    assert gemm_op.n == 2


def test_torch_compile_calls_the_op(ops):
    gemm_op, _, _ = ops
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: tile_ops.gemm(a, b), backend="eager", fullgraph=True)
    a, b = rnd(16, 32), rnd(32, 24)
    with torch.no_grad():
        for _ in range(3):
            close(compiled(a, b), ref_gemm(a, b))
    assert gemm_op.n == 3


def test_dispatch_checks_of_the_wrappers_call(ops):
    """fastpath.call(..., check_dispatch=True) serves a plan only when the dispatcher would add nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b, bias = rnd(16, 32), rnd(32, 24), rnd(24)
    tile_ops.gemm(a, b)
    tile_ops.gemm(a, b, bias)

    def served(x, y, c=None, check=True):
        return fastpath.call(GEMM.plan_id, (x, y, c), (None,), check) is not None

    w = torch.nn.Parameter(b.clone())
    assert served(a, b) and served(a, b, bias) and served(a, w.detach())
    assert not served(a, w)  # a parameter that requires grad, in grad mode
    assert served(a, w, check=False)  # inside the op: the dispatcher already ran
    with torch.no_grad():
        assert served(a, w)
    assert not served(a, b, bias.clone().requires_grad_())
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(a)
    assert not served(fake, b)
    with _Seen():
        assert not served(a, b)
    with torch.device("cpu"):  # a torch function mode
        assert not served(a, b)
    seen = []

    def probe(x):
        seen.append(served(a, b))  # the planned signature, inside a transform or a trace
        return x * 2

    torch.vmap(probe)(torch.ones(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace is deprecated, still used
        torch.jit.trace(probe, (a,), check_trace=False)
    assert seen == [False, False]
    assert served(a, b)


def test_signature_fields_each_count(ops):
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)
    same = dict(x=a, y=b, c=None, flags=(None,))
    others = [dict(x=a.to(BF16), y=b.to(BF16)), dict(x=rnd(17, 32)), dict(y=rnd(24, 32).t()), dict(c=rnd(24)),
              dict(flags=(F32,)), dict(flags=(1.0,)), dict(flags=(None, None)), dict(x=a[None])]
    for change in [{}] + others:
        args = {**same, **change}
        out = fastpath.call(GEMM.plan_id, (args["x"], args["y"], args["c"]), args["flags"], True)
        assert (out is not None) == (not change), change
    assert fastpath.call(GEMM.plan_id, (a, b), (None,), True) is None  # how many tensors
    assert fastpath.call(GEMM_SOFTMAX.plan_id, (a, b, None), (None,), True) is None  # the op counts too


@pytest.mark.parametrize("make", [
    lambda a: torch._neg_view(a),  # same strides and pointer, values negated by a key
    lambda a: torch._efficientzerotensor(a.shape, dtype=a.dtype),
    lambda a: torch._to_functional_tensor(a),
    lambda a: a.to_sparse_csr(),
    lambda a: a.to_sparse(),
    lambda a: torch.nested.nested_tensor([a, a]),
], ids=["neg_view", "zero_tensor", "functional", "sparse_csr", "sparse_coo", "nested"])
def test_only_dense_plain_memory_reaches_a_plan(ops, make):
    """Tensors whose memory is not plainly their values (or that have no strides) never take a plan: the
    wrapper gives what the op gives, result or error (sparse and nested ones: the ops' layout error, on both)."""
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)  # a plan for this signature
    x = make(a)
    assert fastpath.call(GEMM.plan_id, (x, b, None), (None,), False) is None
    got, want = _outcome(tile_ops.gemm, x, b), _outcome(torch.ops.tile_ops.gemm, x, b)
    if x.is_nested or x.layout != torch.strided:
        assert got[0] is want[0] is ValueError and "must be a dense tensor" in got[1] and got[1] == want[1]
    elif isinstance(want, torch.Tensor):
        assert torch.equal(torch._from_functional_tensor(got) if torch._is_functional_tensor(got) else got,
                           torch._from_functional_tensor(want) if torch._is_functional_tensor(want) else want)
    else:
        assert isinstance(got, tuple) and got[0] is want[0]


def test_call_arguments_are_checked(ops):
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)

    class BadBool:
        def __bool__(self):
            raise ValueError("no truth value")

    with pytest.raises(ValueError, match="no truth value"):
        fastpath.call(GEMM.plan_id, (a, b, None), (None,), BadBool())
    with pytest.raises(OverflowError):
        fastpath.call(2 ** 70, (a, b, None), (None,), True)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        fastpath.call(GEMM.plan_id, (a, b, None))
    with pytest.raises(TypeError, match="tensors and flags must be tuples"):
        fastpath.call(GEMM.plan_id, [a, b, None], (None,), True)


def test_recorded_programs_are_checked(ops):
    a, b = rnd(16, 32), rnd(32, 24)
    out = torch.empty(16, 24, dtype=F16)
    step = (0, (1, 1, 1), (128, 1, 1), 0, "k", [(0, None), (7, None)])
    with pytest.raises(ValueError, match=r"argument buffer 7 of kernel 'k' is not one of the plan's 4 buffers"):
        fastpath.record(GEMM.plan_id, (a, b, None), (None,), (out,), ([], [step]))
    spec = dict(tensor="A", dtype="float16", dims=[32, 16], strides=[60], box=[64, 16], element_strides=[1, 1],
                swizzle=3, l2_promotion=2, oob_fill=0)
    step = (0, (1, 1, 1), (128, 1, 1), 0, "k", [(0, spec)])
    with pytest.raises(ValueError, match=r"strides_bytes\[0\] = 60 must be a positive multiple of 16"):
        fastpath.record(GEMM.plan_id, (a, b, None), (None,), (out,), ([], [step]))
    step = (0, (1, 1, 1), (128, 1, 1), 0, "k", [(0, None)])
    with pytest.raises(ValueError, match=r"kernel 'k' is not a loaded function"):
        fastpath.record(GEMM.plan_id, (a, b, None), (None,), (out,), ([], [step]))
    with pytest.raises(ValueError, match=r"an op's plan makes at least one output"):
        fastpath.record(GEMM.plan_id, (a, b, None), (None,), (), lambda *pointers: None)
    assert fastpath.count() == 0


# --------------------------------------------------------------------------- errors


def _outcome(fn, *args):
    """The result of ``fn(*args)``, or the type and message of what it raised."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)


@pytest.mark.parametrize(
    "make_args",
    [
        lambda a, b: (torch.cat([a.flatten(), a.flatten()[:1]])[1:].view(16, 32), b),  # misaligned, warm signature
        lambda a, b: (a.float(), b.float()),  # CUDA dtype rules
        lambda a, b: (a, b[:16]),  # inner dimensions
        lambda a, b: (a, b, torch.ones(7, dtype=F16)),  # bias shape
        lambda a, b: (a.unsqueeze(0).unsqueeze(0), b),  # rank
    ],
)
def test_gemm_errors_are_the_same_on_both_paths(ops, make_args):
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)  # a plan for this signature
    args = make_args(a, b)
    via_op = _outcome(torch.ops.tile_ops.gemm, *args)
    assert isinstance(via_op, tuple) and _outcome(tile_ops.gemm, *args) == via_op
    if args[0].dtype == F32:
        assert "accepted on CUDA" in via_op[1]


@pytest.mark.parametrize("out_dtype", ["float32", [F32]])  # not a dtype; unhashable
def test_what_the_schema_refuses_the_wrapper_refuses_in_the_ops_words(ops, out_dtype):
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm(a, b)  # a plan for this signature
    assert _outcome(tile_ops.gemm, a, b, None, out_dtype) == (
        TypeError, f"tile_ops.gemm: out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    assert _outcome(torch.ops.tile_ops.gemm, a, b, None, out_dtype)[0] is RuntimeError  # the dispatcher's


@pytest.mark.parametrize("scale, error", [(float("inf"), ValueError), (True, TypeError), ([0.5], TypeError),
                                          ("0.5", TypeError)])
def test_gemm_softmax_refuses_a_scale_that_is_not_a_finite_float(ops, scale, error):
    """On both paths; the op's schema would take True as 1.0, the wrapper does not."""
    a, b = rnd(16, 32), rnd(32, 24)
    tile_ops.gemm_softmax(a, b, 1.0)  # 1.0 == True: only the scale's type tells them apart
    got = _outcome(tile_ops.gemm_softmax, a, b, scale)
    assert isinstance(got, tuple) and got[0] is error and "scale must be a" in got[1]


def test_plans_are_bounded(ops):
    """The table is cleared when full (4096 signatures), so varying shapes cannot grow it forever."""
    b = rnd(32, 8)
    for m in range(1, 4098):
        a = torch.empty(m, 32, dtype=F16)
        fastpath.record(GEMM.plan_id, (a, b, None), (None,), (torch.empty(m, 8, dtype=F16),), lambda *ptrs: None)
    assert fastpath.count() == 1


def _plans_lib():
    from tile_ops.jit.launcher import get_launcher

    lib = get_launcher()
    lib.plans_configure(fastpath._PLAIN_TENSORS, None)
    return lib


class _Launch:
    """A host launch whose teardown records plans (as a launcher whose finalizer runs an op would)."""

    ops = itertools.count(10_000)  # each recorded plan its own signature

    def __init__(self, lib, a, records):
        self.lib, self.a, self.records = lib, a, records

    def __call__(self, *pointers):
        pass

    def __del__(self):
        for _ in range(self.records):
            self.lib.plans_record(next(self.ops), (self.a, self.a.t()), (), [([1], F16)], lambda *p: None)


@pytest.mark.parametrize("how", ["clear", "replace", "full"])
def test_the_plans_table_survives_python_run_while_it_changes(how):
    """Destroying a plan runs Python (its host launch's finalizer), which may record plans: that used to run in
    the middle of the table's clear or insert (a double free). Now a plan leaves the table first."""
    lib, a = _plans_lib(), torch.zeros(16, 32, dtype=F16)
    lib.plans_clear()
    for i in range(200):
        lib.plans_record(i, (a, a.t()), (), [([1], F16)], _Launch(lib, a, 4))
    if how == "clear":
        lib.plans_clear()
        assert lib.plans_size() == 200 * 4  # recorded by the finalizers, after the table was emptied
    elif how == "replace":
        for i in range(200):
            lib.plans_record(i, (a, a.t()), (), [([1], F16)], lambda *p: None)
        assert lib.plans_size() == 200 + 200 * 4
    else:  # past the table's bound (4096): it is cleared, then the new plan goes in
        for i in range(200, 5000):
            lib.plans_record(i, (a, a.t()), (), [([1], F16)], lambda *p: None)
        assert 0 < lib.plans_size() <= 4096
    lib.plans_clear()


def test_plans_take_only_tensor_types_and_report_their_module():
    lib = _plans_lib()
    with pytest.raises(TypeError, match="plain_types must be torch.Tensor and its subclasses"):
        lib.plans_configure((int,), None)
    lib.plans_configure(fastpath._PLAIN_TENSORS, None)
    assert lib.plans_call.__module__ == lib.__name__
    with pytest.raises(OverflowError):  # not a SystemError from a call made with the error pending
        lib.plans_call(2**70, (), (), True)


def test_a_plan_takes_any_tensor_operands_outputs_and_flags():
    """A signature is any number of tensor operands (None: one left out) and scalar flags, each counting by type
    and value; the plan allocates every output (several: a tuple) and passes its host launch the pointers of all
    its buffers, the operands' (0 for one left out), then the outputs'."""
    lib = _plans_lib()
    lib.plans_clear()
    xs = [rnd(4, 8) for _ in range(4)]
    tensors, flags = lambda xs: (xs[0], None, xs[1], xs[2], xs[3]), (3, 2.5, True, F32, None)
    outputs, seen = [([4, 8], F16), ([2], F32)], []
    assert lib.plans_record(7, tensors(xs), flags, outputs, lambda *pointers: seen.append(pointers))
    ys = [same_signature(x) for x in xs]
    got = lib.plans_call(7, tensors(ys), flags, True)
    assert isinstance(got, tuple) and [(tuple(t.shape), t.dtype) for t in got] == [((4, 8), F16), ((2,), F32)]
    assert seen == [(ys[0].data_ptr(), 0, *(y.data_ptr() for y in ys[1:]), *(t.data_ptr() for t in got))]
    for other in [(3.0, 2.5, True, F32, None), (3, 2.5, 1, F32, None), (4, 2.5, True, F32, None),
                  (3, 2.5, True, F16, None), (3, 2.5, True, F32), (3, 2.5, True, F32, None, None)]:
        assert lib.plans_call(7, tensors(ys), other, True) is None, other
    assert lib.plans_call(7, (ys[0], ys[1], ys[1], ys[2], ys[3]), flags, True) is None  # the left-out one counts
    assert not lib.plans_record(8, (xs[0],), ("a string",), outputs, lambda *p: None)  # no flag of that type
    assert not lib.plans_record(8, tuple(rnd(2) for _ in range(9)), (), outputs, lambda *p: None)  # > 8 tensors
    lib.plans_clear()


# --------------------------------------------------------------------------- plan families (a runtime size m)


def _family(lib, op, x, ranges, launch, var=(0, 0), outputs=None):
    m = PlanExpr.m()
    return fastpath.record_family(op, (x,), (None,), var, ranges, outputs or [([m, 3], F32)], launch)


def test_a_family_serves_an_unseen_m_from_its_expressions():
    """One family for m in 2..9 and 20..30: a call at any such m, its other sizes and its layout as recorded,
    runs the plan with outputs sized by m and m passed to the launch; another m, K, dtype or layout does not."""
    lib = _plans_lib()
    lib.plans_clear()
    seen = []
    assert _family(lib, 41, rnd(5, 8), [(20, 30), (2, 9)], lambda *args: seen.append(args))
    assert lib.plans_families() == 1 and lib.plans_size() == 0
    for m in (2, 7, 9, 20, 30):
        x = rnd(m, 8)
        out = lib.plans_call(41, (x,), (None,), False)
        assert out.shape == (m, 3) and out.dtype == F32
        assert seen[-1] == (x.data_ptr(), out.data_ptr(), m)
    for x in (rnd(1, 8), rnd(10, 8), rnd(31, 8), rnd(7, 9), rnd(7, 8, dtype=BF16), rnd(8, 7).t(), rnd(7, 16)[:, :8]):
        assert lib.plans_call(41, (x,), (None,), False) is None, (x.shape, x.stride(), x.dtype)
    lib.plans_clear()
    assert lib.plans_families() == 0


def test_a_family_of_a_layout_whose_strides_follow_m():
    """A^T stored M-contiguous: its strides are expressions of m too; a batch of row-major (B, m, K) likewise."""
    lib = _plans_lib()
    lib.plans_clear()
    assert _family(lib, 42, rnd(8, 6).t(), [(2, 64)], lambda *args: None)
    assert lib.plans_call(42, (rnd(8, 40).t(),), (None,), False).shape == (40, 3)
    assert lib.plans_call(42, (rnd(40, 8),), (None,), False) is None  # row-major: another family
    assert _family(lib, 43, rnd(3, 6, 8), [(2, 64)], lambda *args: None, var=(0, 1),
                   outputs=[([3, PlanExpr.m(), 5], F16)])
    assert lib.plans_call(43, (rnd(3, 33, 8),), (None,), False).shape == (3, 33, 5)
    assert lib.plans_call(43, (rnd(3, 40, 8)[:, :33],), (None,), False) is None  # the batch stride is not 33 * 8
    lib.plans_clear()


def test_a_family_is_checked_when_recorded():
    lib = _plans_lib()
    lib.plans_clear()
    x, launch = rnd(5, 8), lambda *args: None
    with pytest.raises(ValueError, match="must take the call that records it"):
        _family(lib, 44, x, [(6, 9)], launch)
    with pytest.raises(ValueError, match="disjoint"):
        _family(lib, 44, x, [(2, 9), (9, 12)], launch)
    with pytest.raises(ValueError, match="var is"):
        _family(lib, 44, x, [(2, 9)], launch, var=(0, 2))
    with pytest.raises(ValueError, match="malformed expression"):
        _family(lib, 44, x, [(2, 9)], launch, outputs=[([(1, 0, 2, 0), 3], F32)])  # m + (nothing)
    assert not _family(lib, 44, rnd(5, 16)[:, :8], [(2, 9)], launch)  # not dense: no family
    assert lib.plans_families() == 0


def test_dense_layouts_as_expressions_of_m():
    for t, var, sizes, strides in [
        (torch.empty(5, 7, 9), 1, lambda m: [5, m, 9], lambda m: [m * 9, 9, 1]),
        (torch.empty(5, 9, 7).mT, 1, lambda m: [5, m, 9], lambda m: [9 * m, 1, m]),
        (torch.empty(7, 9).expand(5, 7, 9), 1, lambda m: [5, m, 9], lambda m: [0, 9, 1]),
        (torch.empty(9), None, lambda m: [9], lambda m: [1]),
    ]:
        got = fastpath.dense_layout(t, var)
        for m in (1, 7, 100):
            assert [evaluate_at(e, m) for e in got[0]] == sizes(m)
            assert [evaluate_at(e, m) for e in got[1]] == strides(m)
    assert fastpath.dense_layout(torch.empty(5, 7, 9)[:, :, :4], 1) is None


def evaluate_at(e, m):
    return e.value(m) if isinstance(e, PlanExpr) else e


def test_plan_expressions_evaluate_as_python_does():
    """A meta expression evaluated with m as a PlanExpr, then at m, is the expression evaluated at m; the
    extension's arithmetic is Python's (floor division and modulo of negatives too)."""
    from tile_ops.compiler.meta import evaluate

    text = "min(132, ((M + 127) // 128) * 16) + max(M % 7, 3) - (5 - M) // 4"
    e = evaluate(text, {"M": PlanExpr.m() * 3})
    assert all(e.value(m) == evaluate(text, {"M": 3 * m}) for m in range(0, 300, 7))
    lib = _plans_lib()
    lib.plans_clear()
    assert _family(lib, 45, rnd(5, 8), [(1, 400)], lambda *args: None, outputs=[([e, 1], F32)])
    for m in (1, 50, 399):
        out = lib.plans_call(45, (rnd(m, 8),), (None,), False)
        assert out.shape == (evaluate(text, {"M": 3 * m}), 1)
    lib.plans_clear()


def test_an_op_call_records_its_row_family_once(monkeypatch):
    """record_row_family: m is the first tensor's rows (M = fold * m for a batch of rows run as one problem),
    the output's rows are m, the program is asked for at M = fold * m; nothing for kernels with a static M, a
    single row, rows that do not divide M, host code, or a call a family already takes."""
    recorded = []
    monkeypatch.setattr(fastpath, "record_family", lambda *args: recorded.append(args))
    taken = False
    monkeypatch.setattr(fastpath, "in_family", lambda *args: taken)
    a, out = rnd(3, 5, 8), torch.empty(3, 5, 4, dtype=F16)

    def record(a=a, dims=(15,), host_code=False):
        program_at = (lambda d: lambda *pointers: None) if host_code else (lambda d: ([], [("M", d[0])]))
        fastpath.record_row_family(9, ((a,), (None,)), a, out, dims, program_at, lambda fold: [(1, 100 * fold)])

    record()
    [(op, tensors, flags, var, ranges, outputs, program)] = recorded
    assert (op, var, ranges) == (9, (0, 1), [(1, 300)])
    [(shape, dtype)] = outputs
    assert [evaluate_at(d, 7) for d in shape] == [3, 7, 4] and dtype == F16
    assert program[1][0][1].value(7) == 21  # M = 3 * m
    for kw in (dict(dims=()), dict(a=rnd(3, 1, 8)), dict(dims=(16,)), dict(host_code=True)):
        record(**kw)
    taken = True
    record()
    assert len(recorded) == 1
