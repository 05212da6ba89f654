"""tile_ops.nn.Linear as a drop-in for torch.nn.Linear (CPU path)."""

import functools

import pytest
import torch
import torch._dynamo.testing

import tile_ops
import tile_ops.nn
from tile_ops.integrations.linear import convert_linears


def test_alias_module():
    from tile_ops.integrations import Linear

    assert tile_ops.nn.Linear is Linear


@pytest.mark.parametrize("bias", [True, False])
def test_same_init_parameters_and_state_dict_keys(bias):
    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 7, bias=bias)
    torch.manual_seed(0)
    ours = tile_ops.nn.Linear(12, 7, bias=bias)
    assert list(ours.state_dict().keys()) == list(ref.state_dict().keys())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    assert ours.weight.shape == (7, 12) and (ours.bias is None) == (not bias)
    assert repr(ours) == repr(ref)
    assert ours.in_features == 12 and ours.out_features == 7


def test_constructor_dtype_device_and_reset():
    m = tile_ops.nn.Linear(4, 3, bias=True, device="cpu", dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and m.bias.dtype == torch.float64
    m2 = tile_ops.nn.Linear(4, 3, device="meta")
    assert m2.weight.device.type == "meta"
    torch.manual_seed(5)
    m.reset_parameters()
    bound = 1 / 2  # 1/sqrt(in_features)
    assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound


def test_state_dict_round_trip():
    ref = torch.nn.Linear(6, 5)
    ours = tile_ops.nn.Linear(6, 5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 6)
    torch.testing.assert_close(ours(x), ref(x))
    back = torch.nn.Linear(6, 5)
    back.load_state_dict(ours.state_dict())
    torch.testing.assert_close(back(x), ref(x))


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_shares_or_copies(bias):
    ref = torch.nn.Linear(6, 4, bias=bias)
    shared = tile_ops.nn.Linear.from_linear(ref)
    assert shared.weight is ref.weight and shared.bias is ref.bias
    copied = tile_ops.nn.Linear.from_linear(ref, copy=True)
    assert copied.weight is not ref.weight and torch.equal(copied.weight, ref.weight)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(shared(x), ref(x))
    torch.testing.assert_close(copied(x), ref(x))
    with pytest.raises(TypeError, match="expected a torch.nn.Linear, got Conv1d"):
        tile_ops.nn.Linear.from_linear(torch.nn.Conv1d(1, 1, 1))


def test_from_linear_keeps_the_instance_attributes():
    """Attributes set on the module (HF marks loaded ones _is_hf_initialized, to skip re-initializing them)."""
    ref = torch.nn.Linear(6, 4).eval()
    ref._is_hf_initialized, ref.tag = True, ["lm_head"]
    new = tile_ops.nn.Linear.from_linear(ref)
    assert new._is_hf_initialized and new.tag is ref.tag and not new.training
    assert new._parameters is not ref._parameters and new.weight is ref.weight


def test_is_a_torch_linear_and_converts_once():
    """A torch.nn.Linear subclass (torch's tensor-parallel styles and the like accept it); converting
    a model twice leaves the converted layers as they are."""
    ours = tile_ops.nn.Linear(4, 3)
    assert isinstance(ours, torch.nn.Linear)
    model = torch.nn.Sequential(ours, torch.nn.Linear(3, 2))
    convert_linears(model)
    assert model[0] is ours and type(model[1]) is tile_ops.nn.Linear
    assert convert_linears(ours) is ours


def test_convert_linears():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 2)))
    x = torch.randn(5, 4)
    ref = model(x)
    convert_linears(model)
    assert isinstance(model[0], tile_ops.nn.Linear) and isinstance(model[2][0], tile_ops.nn.Linear)
    torch.testing.assert_close(model(x), ref)


@pytest.mark.parametrize("copy", [False, True])
def test_convert_keeps_shared_modules_and_tied_parameters(copy):
    """A Linear used twice stays one (converted) module, and Linears sharing a weight keep sharing it, copied
    or not: otherwise the second use stays a torch Linear, or gets parameters of its own that train apart."""
    shared, tied = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    tied.weight = shared.weight
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.ModuleList([shared]), tied)
    n_params = len(list(model.parameters()))
    convert_linears(model, copy=copy)
    assert type(model[0]) is tile_ops.nn.Linear and model[2][0] is model[0]
    assert model[3].weight is model[0].weight and (model[0].weight is shared.weight) == (not copy)
    assert len(list(model.parameters())) == n_params


@pytest.mark.parametrize("shape", [(6,), (3, 6), (2, 3, 6), (2, 1, 3, 6), (0, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_backward_match_torch(shape, dtype):
    torch.manual_seed(1)
    ref = torch.nn.Linear(6, 5, dtype=dtype)
    ours = tile_ops.nn.Linear.from_linear(ref, copy=True)
    x = torch.randn(*shape, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x1), ours(x2)
    assert y.shape == y_ref.shape and y.dtype == dtype
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(y, y_ref, **tol)
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **tol)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, **tol)


def test_non_contiguous_input():
    ref = torch.nn.Linear(6, 5)
    ours = tile_ops.nn.Linear.from_linear(ref)
    x = torch.randn(4, 6, 3).transpose(1, 2)  # (4, 3, 6), not viewable as 2-D
    torch.testing.assert_close(ours(x), ref(x))
    x = torch.randn(6, 9).t()  # (9, 6) transposed view
    torch.testing.assert_close(ours(x), ref(x))


def test_forward_uses_tile_ops_gemm_with_transposed_weight_view():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.tile_ops.gemm.default:
                seen.append(args)
            return func(*args, **(kwargs or {}))

    m = tile_ops.nn.Linear(6, 5)
    with Log():
        m(torch.randn(2, 3, 6))
    (x2, w_t, bias), = seen
    assert x2.shape == (6, 6) and w_t.shape == (6, 5) and w_t.stride() == (1, 6)
    assert w_t.data_ptr() == m.weight.data_ptr()


def test_bad_input_shape():
    m = tile_ops.nn.Linear(6, 5)
    with pytest.raises(ValueError, match=r"tile_ops.nn.Linear: expected an input of shape \(\*, in_features\) with in_features=6, got shape \(3, 4\)"):
        m(torch.randn(3, 4))


def test_mlp_training_matches_torch():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ours = torch.nn.Sequential(
        tile_ops.nn.Linear.from_linear(ref[0], copy=True), torch.nn.Tanh(), tile_ops.nn.Linear.from_linear(ref[2], copy=True)
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses_ref, losses = [], []
    for _ in range(10):
        for model, o, log in ((ref, opt_ref, losses_ref), (ours, opt, losses)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            o.step()
            log.append(loss.item())
    assert losses[-1] < losses[0]
    for l_ours, l_ref in zip(losses, losses_ref):
        assert abs(l_ours - l_ref) <= 1e-5 * max(1.0, abs(l_ref))


class _Doubled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _hooked():
    m = torch.nn.Linear(4, 3)
    m.register_forward_hook(lambda mod, args, out: out + 1)
    return m


def _state_dict_hooked():
    m = torch.nn.Linear(4, 3)
    m._register_state_dict_hook(lambda mod, state, prefix, local: state.pop(prefix + "bias"))
    return m


def _forward_on_the_instance():
    """How accelerate's add_hook_to_module (device_map offloading) wraps a module's forward."""
    m = torch.nn.Linear(4, 3)
    m._old_forward = m.forward
    m.forward = functools.partial(lambda mod, x: mod._old_forward(x) * 2, m)
    return m


def _with_buffer():
    m = torch.nn.Linear(4, 3)
    m.register_buffer("scale", torch.ones(3))
    return m


@pytest.mark.parametrize("make, why", [
    (lambda: _Doubled(4, 3), "has a forward of its own"),
    (_forward_on_the_instance, "has a forward of its own"),
    (_hooked, "has hooks"),
    (_state_dict_hooked, "has hooks"),
    (lambda: torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3)), "has parametrizations"),
    (_with_buffer, "has buffers or submodules of its own"),
])
def test_a_linear_that_does_more_is_not_converted(make, why):
    """Converting these would silently drop what they add (doubling, a forward or state_dict hook,
    weight_norm's training, a buffer in the state_dict)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), make())
    x = torch.randn(2, 4)
    expected, state_keys = model(x), model.state_dict().keys()
    with pytest.warns(UserWarning, match=rf"left as they are.*: 1 \({type(model[1]).__name__}\) {why}"):
        convert_linears(model)
    assert isinstance(model[0], tile_ops.nn.Linear) and not isinstance(model[1], tile_ops.nn.Linear)
    torch.testing.assert_close(model(x), expected)
    assert model.state_dict().keys() == state_keys
    with pytest.raises(TypeError, match=why):
        tile_ops.nn.Linear.from_linear(make())


def test_a_lazy_linear_is_converted_only_once_initialized():
    model = torch.nn.Sequential(torch.nn.LazyLinear(3))
    with pytest.warns(UserWarning, match=r"0 \(LazyLinear\) is not initialized yet"):
        convert_linears(model)
    model(torch.randn(2, 4))  # initializes it: a torch.nn.Linear from now on
    assert isinstance(convert_linears(model)[0], tile_ops.nn.Linear)


def test_autocast_gives_what_torch_linear_gives():
    lin = torch.nn.Linear(16, 8)
    fast = tile_ops.nn.Linear.from_linear(lin)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = lin(x), fast(x)
        mixed = fast(x.bfloat16())  # bf16 activations, fp32 parameters
    assert got.dtype == expected.dtype == mixed.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_a_linear_compiled_in_place_is_converted_uncompiled_with_a_warning():
    """module.compile() keeps the compiled forward on the instance: a converted module must not inherit it (it
    would run the original's forward, on the original's parameters)."""
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    m = torch.nn.Linear(4, 3)
    m.compile(backend="eager")
    with pytest.warns(UserWarning, match=r"was compiled \(module.compile\(\)\) and the converted module is not"):
        new = tile_ops.nn.Linear.from_linear(m, copy=True)
    with torch.no_grad():
        new.weight.zero_()
        new.bias.fill_(1.0)
    y = new(x)
    torch.testing.assert_close(y, torch.ones(2, 3))
    y.sum().backward()
    assert new.weight.grad is not None and m.weight.grad is None
    net = torch.nn.Sequential(m)
    with pytest.warns(UserWarning, match="was compiled"):
        convert_linears(net)
    assert isinstance(net[0], tile_ops.nn.Linear) and net[0]._compiled_call_impl is None


def test_a_torch_compile_wrapper_stays_compiled_around_the_converted_linear():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    x = torch.randn(2, 4)
    wrapped = torch.compile(torch.nn.Linear(4, 3), backend=counter)
    wrapped(x)
    assert convert_linears(wrapped, copy=True) is wrapped
    assert isinstance(wrapped._orig_mod, tile_ops.nn.Linear)
    with torch.no_grad():
        wrapped._orig_mod.weight.zero_()
        wrapped._orig_mod.bias.fill_(1.0)
    torch.testing.assert_close(wrapped(x), torch.ones(2, 3))
    assert counter.frame_count == 2  # the converted Linear, compiled by the same backend
    with pytest.raises(TypeError, match="a torch.compile wrapper: convert it with tile_ops.nn.convert_linears"):
        tile_ops.nn.Linear.from_linear(wrapped)
