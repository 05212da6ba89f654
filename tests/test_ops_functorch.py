"""torch.func over the ops (CPU reference path, float64): every transform and the usual compositions against
the same function written with torch.matmul/softmax; forward mode through the ops themselves; torch.autograd's
vectorized (batched) gradients.  A custom op's own autograd is refused by torch.func.grad
(pytorch#168393) and has no forward formula; vmap fell back to one call per slice."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import tile_ops
import tile_ops.nn

F64 = torch.float64


def _r(*shape):
    return torch.randn(*shape, dtype=F64)


def tile_gemm(x, y, z=None):
    return tile_ops.gemm(x, y, z)


def torch_gemm(x, y, z=None):
    return x @ y if z is None else x @ y + z


def tile_softmax(x, y):
    return tile_ops.gemm_softmax(x, y, 0.7)


def torch_softmax(x, y):
    return torch.softmax(0.7 * (x @ y), -1)


@pytest.fixture(autouse=True)
def _no_per_slice_fallback():
    """vmap's fallback (one call per slice) warns: with the batching rules it must not run."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule.*")
        yield


def _same(got, want):
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want):
        torch.testing.assert_close(g, w)


a, b, bias = _r(4, 3), _r(3, 5), _r(5)

TRANSFORMS = {
    "grad": lambda mm, sm: grad(lambda x, y, z: (mm(x, y, z) ** 2).sum(), argnums=(0, 1, 2))(a, b, bias),
    "vjp": lambda mm, sm: vjp(lambda x, y: sm(x, y), a, b)[1](_r(4, 5)),
    "jacrev": lambda mm, sm: (jacrev(lambda x: mm(x, b, bias))(a), jacrev(lambda x: sm(x, b))(a)),
    "jacrev_jacrev": lambda mm, sm: jacrev(jacrev(lambda x: (mm(x, b) ** 3).sum()))(a),
    "hessian": lambda mm, sm: (hessian(lambda x: (mm(x, b, bias) ** 2).sum())(a),
                               hessian(lambda y: (sm(a, y) ** 2).sum())(b)),
    "hvp": lambda mm, sm: jvp(grad(lambda x: (sm(x, b) * _r(4, 5)).sum()), (a,), (_r(4, 3),))[1],
    "jvp": lambda mm, sm: (jvp(mm, (a, b, bias), (_r(4, 3), _r(3, 5), _r(5))), jvp(sm, (a, b), (_r(4, 3), _r(3, 5)))),
    "jacfwd": lambda mm, sm: jacfwd(lambda y: sm(a, y))(b),
    "vmap_rows": lambda mm, sm: (vmap(lambda x: mm(x, b, bias))(_r(6, 4, 3)), vmap(lambda x: sm(x, b))(_r(6, 4, 3))),
    "vmap_in_dim_1": lambda mm, sm: vmap(lambda x: mm(x, b), in_dims=1)(_r(4, 6, 3)),
    "vmap_b": lambda mm, sm: (vmap(lambda y: mm(a, y, bias))(_r(6, 3, 5)), vmap(lambda y: sm(a, y))(_r(6, 3, 5))),
    "vmap_batched_a_and_b": lambda mm, sm: vmap(mm, in_dims=(0, None))(_r(6, 2, 4, 3), _r(2, 3, 5)),
    "vmap_ensemble": lambda mm, sm: vmap(mm)(_r(6, 4, 3), _r(6, 3, 5), _r(6, 5)),  # a model per slice
    "vmap_bias_only": lambda mm, sm: vmap(lambda z: mm(a, b, z), in_dims=1)(_r(5, 6)),
    "vmap_2d_mapped_over_3d": lambda mm, sm: (vmap(mm, in_dims=(None, 0))(_r(2, 4, 3), _r(6, 3, 5)),
                                              vmap(sm, in_dims=(0, None))(_r(6, 4, 3), _r(2, 3, 5))),
    "vmap_k_0": lambda mm, sm: vmap(mm, in_dims=(0, None, None))(_r(6, 4, 0), _r(0, 5), bias),
    "vmap_jvp_bias": lambda mm, sm: vmap(lambda z, t: jvp(lambda q: mm(a, b, q), (z,), (t,)))(_r(6, 5), _r(6, 5)),
    "vmap_vmap": lambda mm, sm: vmap(vmap(lambda x, y: mm(x, y)), in_dims=(0, None))(_r(2, 6, 4, 3), _r(6, 3, 5)),
    "per_sample_grad": lambda mm, sm: vmap(grad(lambda w, x: (mm(x, w) ** 2).sum()), in_dims=(None, 0))(b, _r(6, 4, 3)),
    "grad_of_vmap": lambda mm, sm: grad(lambda w: (vmap(lambda x: sm(x, w))(_r(6, 4, 3)) ** 2).sum())(b),
    "jvp_of_vmap": lambda mm, sm: jvp(vmap(lambda x: mm(x, b)), (_r(6, 4, 3),), (_r(6, 4, 3),)),
    "vmap_of_jvp": lambda mm, sm: vmap(lambda x, t: jvp(lambda r: sm(r, b), (x,), (t,)))(_r(6, 4, 3), _r(6, 4, 3)),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transform_matches_torch(name):
    state = torch.random.get_rng_state()  # the same random tangents and operands for both
    got = TRANSFORMS[name](tile_gemm, tile_softmax)
    torch.random.set_rng_state(state)
    _same(got, TRANSFORMS[name](torch_gemm, torch_softmax))


def test_per_sample_gradients_of_a_converted_model():
    """The torch.func recipe (functional_call + vmap(grad)) on a model whose Linears run tile_ops.gemm."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    fast = tile_ops.nn.convert_linears(torch.nn.Sequential(*model), copy=True)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, target = _r(5, 3), _r(5, 2)

    def per_sample(m):
        def loss(p, xi, ti):
            return ((functional_call(m, p, (xi[None],)) - ti) ** 2).sum()
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    _same(per_sample(fast), per_sample(model))


def test_nested_forward_levels_are_refused():
    """A tangent built from the inner level's saved tensors would miss the outer level's mixed terms."""
    with pytest.raises(NotImplementedError, match="nested forward-mode AD"):
        jvp(lambda y: jvp(lambda x: tile_gemm(x, y), (a,), (a,))[1], (b,), (b,))


def test_grad_inside_compile_falls_back_or_says_what_works():
    torch._dynamo.reset()
    f = grad(lambda x: (tile_gemm(x, b) ** 2).sum())
    _same(torch.compile(lambda: f(a), backend="aot_eager")(), grad(lambda x: ((x @ b) ** 2).sum())(a))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"inside torch.compile are not supported .*pytorch#168393"):
        torch.compile(lambda: f(a), backend="aot_eager", fullgraph=True)()


def test_vmap_inside_compile():
    torch._dynamo.reset()
    x = _r(6, 4, 3)
    got = torch.compile(lambda: vmap(lambda r: tile_gemm(r, b, bias))(x), backend="aot_eager", fullgraph=True)()
    _same(got, x @ b + bias)


def _exported(fn, *args):
    class Module(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)
    return torch.export.export(Module(), args).module()


OPS_FORWARD_MODE = {  # (the function of the op), each against torch
    "jvp_gemm": lambda mm, sm: jvp(mm, (a, b, bias), (_r(4, 3), _r(3, 5), _r(5))),
    "jvp_gemm_softmax": lambda mm, sm: jvp(lambda x, y: sm(x, y, 0.7), (a, b), (_r(4, 3), _r(3, 5))),
    "jacfwd_batched": lambda mm, sm: (lambda x: jacfwd(lambda y: sm(x, y, 0.7))(b))(_r(2, 4, 3)),
    "vmap_of_jvp": lambda mm, sm: vmap(lambda x, t: jvp(lambda r: mm(r, b), (x,), (t,)))(_r(6, 4, 3), _r(6, 4, 3)),
    "exported_jvp": lambda mm, sm: jvp(_exported(lambda x: mm(x, b, bias), a), (a,), (_r(4, 3),)),
}


@pytest.mark.parametrize("name", OPS_FORWARD_MODE)
def test_forward_mode_through_the_ops_themselves(name):
    """torch.ops.tile_ops.* called directly (as in exported programs and FX graphs), not through the wrappers:
    the tangents are the products', not zeros."""
    state = torch.random.get_rng_state()
    got = OPS_FORWARD_MODE[name](torch.ops.tile_ops.gemm, torch.ops.tile_ops.gemm_softmax)
    torch.random.set_rng_state(state)
    _same(got, OPS_FORWARD_MODE[name](torch_gemm, lambda x, y, s: torch.softmax(s * (x @ y), -1)))


def test_forward_ad_through_the_ops_themselves_with_backward():
    """torch.autograd.forward_ad on the op, then backward through both the primal and the tangent."""
    def run(mm, sm):
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        with fwAD.dual_level():
            p, t = fwAD.unpack_dual(mm(fwAD.make_dual(x, a.cos()), fwAD.make_dual(w, b.sin()), bias))
            q, u = fwAD.unpack_dual(sm(fwAD.make_dual(x, a.cos()), w, 0.7))
            return (p, t, q, u), torch.autograd.grad((p * t).sum() + (q * u).sum(), (x, w))

    def manual_softmax(x, y, s):  # (torch.softmax's forward-over-reverse trips its own in-place check)
        e = (s * (x @ y)).exp()
        return e / e.sum(-1, keepdim=True)

    _same(run(torch.ops.tile_ops.gemm, torch.ops.tile_ops.gemm_softmax), run(torch_gemm, manual_softmax))


def test_nested_forward_levels_through_the_ops_are_refused():
    with pytest.raises(NotImplementedError, match="nested forward-mode AD"):
        jvp(lambda y: jvp(lambda x: torch.ops.tile_ops.gemm(x, y), (a,), (a,))[1], (b,), (b,))


BATCHED_GRADS = {  # torch.autograd's own vmap (is_grads_batched, vectorize=True) over the backward / the tangent
    "grad_batched_bias": lambda mm, sm, x, y: torch.autograd.grad(
        mm(x, y, bias.requires_grad_()), (x, y, bias), _r(7, 4, 5), is_grads_batched=True),
    "grad_batched_3d_a": lambda mm, sm, x, y: torch.autograd.grad(
        mm(x.expand(2, 4, 3), y), (x, y), _r(7, 2, 4, 5), is_grads_batched=True),
    "jacobian_vectorized": lambda mm, sm, x, y: torch.autograd.functional.jacobian(
        lambda p, q: mm(p, q, bias), (x, y), vectorize=True),
    "jacobian_forward_gemm": lambda mm, sm, x, y: torch.autograd.functional.jacobian(
        lambda p, q: mm(p, q, bias), (x, y), vectorize=True, strategy="forward-mode"),
    "jacobian_forward_gemm_softmax": lambda mm, sm, x, y: torch.autograd.functional.jacobian(
        lambda p, q: sm(p, q), (x, y), vectorize=True, strategy="forward-mode"),
}


@pytest.mark.parametrize("name", BATCHED_GRADS)
def test_batched_gradients_match_torch(name):
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    state = torch.random.get_rng_state()
    got = BATCHED_GRADS[name](tile_gemm, tile_softmax, x, y)
    torch.random.set_rng_state(state)
    _same(got, BATCHED_GRADS[name](torch_gemm, torch_softmax, x, y))


VMAP_INPUT_ERRORS = {  # (function, per-sample arguments stacked on dim 0): vmap refuses what one sample may not be
    "a_1d": (lambda x: tile_gemm(x, b), (_r(2, 3),)),
    "a_4d": (lambda x: tile_gemm(x, b), (_r(2, 2, 2, 4, 3),)),
    "batch_3_vs_1": (tile_gemm, (_r(2, 3, 4, 3), _r(2, 1, 3, 5))),
    "softmax_batch_3_vs_1": (tile_softmax, (_r(2, 3, 4, 3), _r(2, 1, 3, 5))),
    "bias_dtype": (lambda z: tile_ops.gemm(a.float(), b.float(), z), (_r(2, 5),)),
    "bias_shape": (lambda z: tile_gemm(a, b, z), (_r(2, 7),)),
    "k_mismatch": (lambda x: tile_gemm(x, b), (_r(2, 4, 6),)),
}


@pytest.mark.parametrize("name", VMAP_INPUT_ERRORS)
def test_vmap_refuses_what_the_op_refuses_in_its_words(name):
    fn, stacked = VMAP_INPUT_ERRORS[name]
    with pytest.raises(Exception) as direct:
        fn(*(x[0] for x in stacked))
    with pytest.raises(type(direct.value)) as mapped:
        vmap(fn)(*stacked)
    assert str(mapped.value) == str(direct.value)
