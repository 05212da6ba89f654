"""An op declared by nothing but its OpSpec (ops/spec.py): registering it makes the torch.library op with its
fake, autograd, forward mode and batching rule, its place on the fast path, and its entry in the autotuner's and
the command line's registry; none of the generic modules names it.  In a subprocess: the op stays out of this
one's registries."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import torch

import tile_ops
from tile_ops.autotune import targets
from tile_ops.ops import fastpath, functorch, spec

launches = []


def reference(x, y, alpha=1.0):
    return x + alpha * y


def launch(x, y, alpha=1.0):  # the checked path: computes, then records a host-code plan for the signature
    launches.append("checked")
    out = reference(x, y, alpha)
    fastpath.record(AXPY.plan_id, (x, y), (alpha,), (out,), lambda *pointers: launches.append(len(pointers)))
    return out


class AxpyTarget(targets.Target):  # what the tuner and the command line would drive
    demo_quick = [((8, 8, 1), "float16")]

    def configs(self):
        return targets.KernelConfigs(dict, lambda *a: [{}], lambda *a: {}, lambda *a: 0)

    def compile(self, shape, dtype, cfg, arch): ...
    def problem(self, shape, dtype, scale=1.0): ...
    def kernel_call(self, problem, arch): ...
    def inputs(self, shape, dtype, device): ...
    def reference(self, args, scale=1.0, dtype=None): ...
    def torch_equivalent(self, args, scale): ...

    def flops(self, shape):
        return 2 * shape[0] * shape[1]


def vmap(info, in_dims, x, y, alpha=1.0):
    x, y = functorch.mapped_first(x, in_dims[0]), functorch.mapped_first(y, in_dims[1])
    return AXPY.op(x, y, alpha), 0


AXPY = spec.register(spec.OpSpec(
    name="axpy_test", schema="(Tensor x, Tensor y, float alpha=1.0) -> Tensor",
    reference=reference, fake=lambda x, y, alpha=1.0: torch.empty_like(x), launch=launch,
    signature=lambda x, y, alpha=1.0: ((x, y), (alpha,)),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "alpha", inputs[2]),
    backward=lambda ctx, g: (g, ctx.alpha * g, None),
    saved=lambda inputs, out: (), jvp=None,
    tangent=lambda ops, args, tangents, out: sum(t * w for t, w in zip(tangents[:2], (1.0, args[2])) if t is not None),
    vmap=vmap, tuning=AxpyTarget()))

x, y, t = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
torch.testing.assert_close(torch.ops.tile_ops.axpy_test(x, y, 2.0), x + 2 * y)
torch.library.opcheck(torch.ops.tile_ops.axpy_test.default, (x, y, 2.0))
xg = x.clone().requires_grad_()
torch.ops.tile_ops.axpy_test(xg, y, 2.0).sum().backward()
torch.testing.assert_close(xg.grad, torch.ones_like(x))
_, tangent = torch.func.jvp(lambda v: torch.ops.tile_ops.axpy_test(x, v, 2.0), (y,), (t,))
torch.testing.assert_close(tangent, 2 * t)
torch.testing.assert_close(torch.vmap(lambda a, b: torch.ops.tile_ops.axpy_test(a, b, 0.5))(x, y), x + 0.5 * y)

AXPY.cuda(x, y, 2.0)  # the CUDA implementation: the checked path records the plan ...
AXPY.cuda(x, y, 2.0)  # ... and the same signature runs from it: two operands and one output
assert launches == ["checked", 3] and fastpath.count() == 1, launches
assert AXPY.plan_id == len(spec.SPECS) - 1 and spec.SPECS["axpy_test"] is AXPY and targets.get("axpy_test") is AXPY.tuning
assert AXPY.function.__name__ == "AxpyTestFunction"
print("SPEC OK")
'''


def test_an_op_is_its_spec():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0 and "SPEC OK" in proc.stdout, proc.stdout + proc.stderr
