"""T.Scalar parameters: values passed by value at each launch (a softmax scale, a window size), so a kernel is
not compiled per value.  The entry's parameters, the meta, the launch's encoding (32-bit patterns, negative ints
included), the errors, and a kernel on the emulator."""

import struct

import numpy as np
import pytest

import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.jit.kernel import EntryArgs, Kernel, encode_scalar
from tile_ops.lang.errors import TileLangError
from tile_ops.jit.emulator import Emulator


def axpb():
    M = T.dynamic("M")

    @T.prim_func
    def axpb(X: T.Tensor((M, 64), "float32"), Y: T.Tensor((M, 64), "float32"), a: T.Scalar("float32"),
             b: T.Scalar("int32")):
        with T.Kernel(T.ceildiv(M, 16)) as bx:
            f = T.alloc_fragment((16, 64), "float32")
            T.copy(X[bx * 16, 0], f)
            for i, j in T.Parallel(16, 64):
                f[i, j] = f[i, j] * a + T.cast(b, "float32")
            T.copy(f, Y[bx * 16, 0])

    return axpb


def test_scalars_are_entry_parameters_after_the_sizes():
    ck = compile_program(axpb(), "sm_80")
    assert ck.meta.scalars == [("a", "float32"), ("b", "int32")] and ck.meta.kept[-3:] == ["M", "a", "b"]
    assert "int M, float a, int b)" in ck.source


def test_a_scalar_of_another_dtype_is_refused():
    with pytest.raises(TileLangError, match="T.Scalar: dtype='float16'; accepted: 'float32' or 'int32'"):
        T.Scalar("float16")


def test_values_encode_scalars_as_32_bit_patterns():
    meta = compile_program(axpb(), "sm_80").meta
    kernel = Kernel(meta, "", b"")
    values = kernel.values((40,), a=-2.5, b=-3)
    assert values == (40, struct.unpack("<i", struct.pack("<f", -2.5))[0], -3)
    args = EntryArgs(meta).build([111, 222], 0, dims=values)
    assert args == [111, 222, 40, struct.unpack("<I", struct.pack("<f", -2.5))[0], 2**32 - 3]  # the launcher's uints
    with pytest.raises(TypeError, match="takes the scalars a, b; got a"):
        kernel.values((40,), a=1.0)
    with pytest.raises(TypeError, match=r"T.Scalar b \(int32\): got 2.5"):
        encode_scalar("b", 2.5, "int32")


def test_scalars_on_the_emulator():
    lk = lower(axpb(), "sm_80")
    x = np.random.default_rng(0).random((40, 64), dtype=np.float32)
    y = np.zeros_like(x)
    Emulator(lk.func, {"X": x, "Y": y, "M": 40, "a": 2.5, "b": -3}).run((3, 1, 1))
    assert np.array_equal(y, x * np.float32(2.5) - 3)
