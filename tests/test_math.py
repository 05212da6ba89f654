"""The language's math on floating values (``T.exp`` ... ``T.pow``): each lowers to CUDA's float32 function
(libdevice's, or ex2.approx for exp2), builds for sm_80 and sm_90a, and runs on the emulator to within a few
float32 ulp of float64; a name the language lacks is an error that lists the names it has."""

import math

import numpy as np
import pytest

import tile_ops.lang as T
from test_compiler import needs_nvcc
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.jit.emulator import Emulator

N = 256
X = np.linspace(-3.0, 3.0, N, dtype=np.float32)
POSITIVE = np.linspace(0.05, 6.0, N, dtype=np.float32)
UNARY = {  # name: (float64 reference, inputs, CUDA function in the source)
    "exp": (np.exp, X, "expf"), "exp2": (np.exp2, X, "tile_ops_exp2"), "log": (np.log, POSITIVE, "logf"),
    "log2": (np.log2, POSITIVE, "log2f"), "log1p": (np.log1p, POSITIVE, "log1pf"), "sqrt": (np.sqrt, POSITIVE, "sqrtf"),
    "rsqrt": (lambda x: 1 / np.sqrt(x), POSITIVE, "rsqrtf"), "tanh": (np.tanh, X, "tanhf"),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), X, "exp"), "erf": (np.vectorize(math.erf), X, "erff"),
    "sin": (np.sin, X, "sinf"), "cos": (np.cos, X, "cosf"), "tan": (np.tan, X / 2, "tanf"),
    "atan": (np.arctan, X, "atanf"), "floor": (np.floor, X * 1.5, "floorf"), "ceil": (np.ceil, X * 1.5, "ceilf"),
    "round": (np.rint, X * 1.5, "nearbyintf"), "trunc": (np.trunc, X * 1.5, "truncf"),
}


def elementwise(fn):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), Out: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128) as bx:
            for i in T.Parallel(N):
                Out[i] = fn(A[i])

    return main


def emulate(prog, a):
    out = np.full(N, np.nan, np.float32)
    Emulator(lower(prog, "sm_80").func, {"A": a, "Out": out}).run((1, 1, 1))
    return out


@pytest.mark.parametrize("name", sorted(UNARY))
def test_a_math_function_matches_float64(name):
    ref, a, cuda = UNARY[name]
    prog = elementwise(getattr(T, name))
    assert cuda in compile_program(prog, "sm_80").source
    np.testing.assert_allclose(emulate(prog, a), ref(a.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_pow_matches_float64():
    prog = elementwise(lambda x: T.pow(x, 2.5))
    assert "powf(" in compile_program(prog, "sm_80").source
    np.testing.assert_allclose(emulate(prog, POSITIVE), POSITIVE.astype(np.float64) ** 2.5, rtol=1e-6)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_math_function_builds(arch):
    import tile_ops

    def every(x):
        y = T.pow(x, 1.5)
        for name in sorted(UNARY):
            y = y + getattr(T, name)(x)
        return y

    assert tile_ops.compile(elementwise(every), target=arch).cubin


def test_an_integer_argument_is_refused_at_its_line():
    with pytest.raises(T.TileLangError, match="T.erf: needs a floating point argument, got int32"):
        @T.prim_func
        def main(A: T.Tensor((N,), "int32"), Out: T.Tensor((N,), "float32")):
            with T.Kernel(1, threads=128) as bx:
                for i in T.Parallel(N):
                    Out[i] = T.erf(A[i])


def test_a_name_the_language_lacks_lists_the_names_it_has():
    with pytest.raises(AttributeError, match=r"tile_ops.lang has no 'gelu'; the language's names: .*\berf\b.*\bsigmoid\b"):
        T.gelu  # noqa: B018
    with pytest.raises(AttributeError) as e:
        T.cumsum  # noqa: B018
    assert "__" not in str(e.value)  # the language's names, not the module's dunders
