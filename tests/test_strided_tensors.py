"""T.Tensor(..., strides=...): a view's strides, ints or T.dynamic sizes read from ``tensor.stride()`` at launch.
The language's checks, the CUDA entry's stride parameters, the tensor maps' strides, the launch's reading and
checking of them, and a strided copy on the emulator ((B, S, H, D) storage read as (B, H, S, D))."""

import numpy as np
import pytest
import torch

import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from tile_ops.jit.kernel import LaunchDims, extent
from tile_ops.lang.errors import TileLangError
from tile_ops.jit.emulator import Emulator


def transpose_copy(D=32, rows=32):
    B, H, S = T.dynamic("B"), T.dynamic("H"), T.dynamic("S")
    strides = (T.dynamic("sb", multiple_of=8), T.dynamic("sh", multiple_of=8), T.dynamic("ss", multiple_of=8), 1)

    @T.prim_func
    def copy(X: T.Tensor((B, H, S, D), "float16", strides=strides), Y: T.Tensor((B, H, S, D), "float16")):
        with T.Kernel(T.ceildiv(S, rows), H, B) as (bx, h, b):
            t = T.alloc_shared((rows, D), "float16")
            T.copy(X[b, h, bx * rows, 0], t)
            T.copy(t, Y[b, h, bx * rows, 0])

    return copy


@pytest.mark.parametrize("strides, match", [((4, 1, 2), "the last 1"), ((8, 1), "one stride per dimension")])
def test_strides_are_checked(strides, match):
    with pytest.raises(TileLangError, match=match):
        T.Tensor((2, 3, 4), "float16", strides=strides)


def test_entry_takes_the_strides_and_the_meta_names_them():
    ck = compile_program(transpose_copy(), "sm_80")
    assert ck.meta.strides == {"X": ["sb", "sh", "ss", 1]}
    assert {"sb", "sh", "ss"} <= set(ck.meta.kept) and "Y" not in ck.meta.strides
    assert "sh" in ck.source and "sb" in ck.source  # X's offsets use them


def test_tensor_maps_take_the_strides():
    """A pipelined load from a strided tensor on sm_90a: its tensor map's strides (bytes) are the view's."""
    D = 64
    B, S = T.dynamic("B"), T.dynamic("S")
    sb, ss = T.dynamic("sb", multiple_of=8), T.dynamic("ss", multiple_of=8)

    @T.prim_func
    def rowsum(X: T.Tensor((B, S, D), "float16", strides=(sb, ss, 1)), Y: T.Tensor((B, 64, 64), "float32")):
        with T.Kernel(B) as b:
            W = T.alloc_shared((64, D), "float16")
            A = T.alloc_shared((64, D), "float16")
            C = T.alloc_fragment((64, 64), "float32")
            T.clear(C)
            T.copy(X[b, 0, 0], A)
            for k in T.Pipelined(T.ceildiv(S, 64), num_stages=2):
                T.copy(X[b, k * 64, 0], W)
                T.gemm(A, W, C, transpose_B=True)
            T.copy(C, Y[b, 0, 0])

    spec = compile_program(rowsum, "sm_90a").meta.tensormaps["X_tmap"]
    assert spec["dims"] == [64, "S", "B"] and spec["strides"] == ["(ss * 2)", "(sb * 2)"]


def test_launch_reads_strides_and_bounds_the_span():
    lk = lower(transpose_copy(), "sm_80")
    dims = LaunchDims(lk.meta, inputs=[0])
    x = torch.zeros(2, 100, 3, 32, dtype=torch.float16).transpose(1, 2)
    values = dims.read([x, torch.zeros(2, 3, 100, 32)])
    named = dims.named(values)
    assert (named["sb"], named["sh"], named["ss"]) == x.stride()[:3]
    assert extent(lk.meta, 0, named) == x.untyped_storage().nbytes() // 2


def test_strided_copy_on_the_emulator():
    lk = lower(transpose_copy(), "sm_80")
    x = torch.randn(2, 50, 3, 32).half()  # (B, S, H, D) storage
    view = x.transpose(1, 2)
    y = np.full((2, 3, 50, 32), np.nan, np.float16)
    sizes = {"B": 2, "H": 3, "S": 50, **dict(zip(("sb", "sh", "ss"), view.stride()[:3]))}
    emu = Emulator(lk.func, {"X": x.reshape(-1).numpy(), "Y": y, **sizes})
    emu.run(tuple(evaluate(g, sizes) for g in lk.meta.grid))
    assert np.array_equal(y, view.numpy())
