"""``T.atomic_add(dst, src)``: every block adds its tile into one global window (split-K's partial sums,
FlashAttention's dQ).  On the CPU emulator, from a fragment (a gemm's accumulator layout or a copy's blocked
one) and from a shared tile, at ragged edges; its CUDA on sm_80 (scalar adds) and sm_90a (vector adds)."""

import numpy as np
import pytest

import tile_ops.lang as T
from test_compiler import needs_nvcc
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.lang.errors import TileLangError
from tile_ops.jit.emulator import Emulator


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def sum_of_tiles(rows, cols, blocks, via):
    """Out[:rows, :cols] += X[b] for each of ``blocks`` blocks, through a fragment laid out by a gemm
    (``via="gemm"``: X[b] @ I), by a copy (``"fragment"``), or a shared tile (``"shared"``)."""
    @T.prim_func
    def main(X: T.Tensor((blocks, 64, 64), "float16"), Eye: T.Tensor((64, 64), "float16"),
             Out: T.Tensor((rows, cols), "float32")):
        with T.Kernel(blocks, threads=128) as b:
            X_s = T.alloc_shared((64, 64), "float16")
            I_s = T.alloc_shared((64, 64), "float16")
            F = T.alloc_fragment((64, 64), "float32")
            F_s = T.alloc_shared((64, 64), "float32")
            T.copy(X[b, 0, 0], X_s)
            T.copy(Eye, I_s)
            if via == "gemm":
                T.gemm(X_s, I_s, F, clear_accum=True)
            else:
                T.copy(X_s, F)
            if via == "shared":
                T.copy(F, F_s)
                T.atomic_add(Out[0, 0], F_s)
            else:
                T.atomic_add(Out[0, 0], F)
    return main


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("via, rows, cols", [("gemm", 64, 64), ("gemm", 50, 61), ("fragment", 64, 64),
                                             ("shared", 37, 64)])
def test_blocks_add_their_tiles_into_one_window(arch, via, rows, cols):
    blocks = 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((blocks, 64, 64)).astype(np.float16)
    base = rng.standard_normal((rows, cols)).astype(np.float32)
    out = base.copy()
    lk = lower(sum_of_tiles(rows, cols, blocks, via), arch)
    emu = Emulator(lk.func, dict(X=x, Eye=np.eye(64, dtype=np.float16), Out=out))
    emu.run((blocks, 1, 1))
    ref = base + x.astype(np.float64).sum(0)[:rows, :cols]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    widths = [k for k in emu.ran if k.startswith("red.add.f32")]
    assert widths and (arch == "sm_90a" and cols % 2 == 0 or widths == ["red.add.f32x1"]), emu.ran


@pytest.mark.parametrize("arch, added", [("sm_80", "atomicAdd(p, a)"), ("sm_90a", "float4")])
def test_its_cuda_adds_scalars_on_sm80_and_vectors_on_sm90a(arch, added):
    src = compile_program(sum_of_tiles(64, 64, 2, "shared"), arch).source
    assert added in src


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_its_cuda_builds(arch):
    import tile_ops

    kernel = tile_ops.compile(sum_of_tiles(64, 64, 2, "gemm"), target=arch)
    assert kernel.instruction_mix().get("RED", 0) or any(op.startswith("RED") for op in kernel.instruction_mix())


@pytest.mark.parametrize("src_scope, dtype, message", [
    ("global", "float32", "adds a fragment or shared tile into a global tensor"),
    ("fragment", "float16", "float32 into float32"),
])
def test_what_it_cannot_add_is_an_error(src_scope, dtype, message):
    def program():
        @T.prim_func
        def main(X: T.Tensor((64, 64), dtype), Out: T.Tensor((64, 64), "float32")):
            with T.Kernel(1, threads=128):
                F = T.alloc_fragment((64, 64), dtype)
                T.copy(X, F)
                T.atomic_add(Out, X if src_scope == "global" else F)
        return main

    with pytest.raises(TileLangError, match=message) as e:
        program()
    assert "test_atomic_add.py" in str(e.value)


def steps_added_by_tma(rows, steps, blocks):
    """Out[:rows] += X[b, step] for every block and pipeline step: each step's tile through a wgmma and a shared
    tile, whose T.atomic_add the warp-specialized sm_90a path issues as TMA's reduce-add."""
    @T.prim_func
    def main(X: T.Tensor((blocks, steps * 64, 64), "float16"), Eye: T.Tensor((64, 64), "float16"),
             Out: T.Tensor((rows, 64), "float32")):
        with T.Kernel(blocks, threads=128) as b:
            X_s = T.alloc_shared((64, 64), "float16")
            I_s = T.alloc_shared((64, 64), "float16")
            F = T.alloc_fragment((64, 64), "float32")
            F_s = T.alloc_shared((64, 64), "float32")
            T.copy(Eye, I_s)
            for s in T.Pipelined(steps, num_stages=2):
                T.copy(X[b, s * 64, 0], X_s)
                T.gemm(X_s, I_s, F, clear_accum=True)
                T.copy(F, F_s)
                T.atomic_add(Out[0, 0], F_s)
    return main


@pytest.mark.parametrize("rows", [64, 45])
def test_a_shared_tile_is_added_by_tma_on_the_warp_specialized_path(rows):
    """Three blocks of three steps add nine tiles into one window by cp.reduce.async.bulk.tensor (the rows past
    the tensor's edge dropped); the staged tile is rewritten only after TMA has read it."""
    blocks, steps = 3, 3
    rng = np.random.default_rng(1)
    x = rng.standard_normal((blocks, steps * 64, 64)).astype(np.float16)
    base = rng.standard_normal((rows, 64)).astype(np.float32)
    out = base.copy()
    lk = lower(steps_added_by_tma(rows, steps, blocks), "sm_90a")
    assert "Out_tmap" in lk.meta.tensormaps
    emu = Emulator(lk.func, dict(X=x, Eye=np.eye(64, dtype=np.float16), Out=out), tensormaps=lk.meta.tensormaps)
    emu.run((blocks, 1, 1))
    ref = base + x.astype(np.float64).reshape(blocks * steps, 64, 64).sum(0)[:rows]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    assert emu.ran["tma.reduce_add.2d.swizzle128"] == blocks * steps * 2  # two 32-column panels a tile
    assert not any(k.startswith("red.add") for k in emu.ran)
