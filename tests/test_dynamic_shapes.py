"""Runtime dimensions (``T.dynamic``): one kernel for every M.  The language's spelling and its errors; the
lowering for sm_80 and sm_90a (M an int entry parameter, the grid, persistent tile count and tensor-map
dims as expressions of M in the kernel's meta); the launch-time binding (LaunchDims, EntryArgs); the CPU
emulator running one kernel at several M, smaller than a tile and not a multiple of 8, against float64;
and the library gemm: M absent from the cache key, one kernel per config chosen."""

import importlib
import os
import random

import numpy as np
import pytest

import tile_ops
import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import KernelMeta, PlanExpr, evaluate
from tile_ops.jit.kernel import DIM, PLAN_VALUE, EntryArgs, Kernel, LaunchDims, Sized
from tile_ops.lang import TileLangError
from programs import matmul_any_m
from tile_ops.jit.emulator import Emulator

SM80_TILES = dict(block_M=32, block_N=32, block_K=32, num_stages=2, threads=64)
SM90_TILES = dict(block_M=64, block_N=64, block_K=64, num_stages=2, threads=128)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


# ----------------------------------------------------------------------------- the language


def _program(shape_of, grid_of=lambda M: (T.ceildiv(M, 64),), cluster=1):
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor(shape_of(M), "float32")):
        with T.Kernel(*grid_of(M), threads=128, cluster=cluster):
            pass

    return main


@pytest.mark.parametrize("make, message", [
    (lambda: T.dynamic("2M"), "accepted: a Python identifier"),
    (lambda: T.dynamic("M", multiple_of=0), "multiple_of=0; accepted: an int >= 1"),
    (lambda: _program(lambda M: (M + 1, 4)), "an expression of one is not a dimension"),
    (lambda: _program(lambda M: (M, -1)), "dimension -1"),
    (lambda: _program(lambda M: (M, 4), lambda M: (T.ceildiv(M, 64) * 1.5,)), "is not an integer"),
    (lambda: _program(lambda M: (M, 4), lambda M: (T.ceildiv(M, 64), 2), cluster=2),
     "each dividing its grid extent"),
])
def test_dynamic_spelling_errors_name_the_user_line(make, message):
    with pytest.raises(TileLangError, match=message):
        make()


def test_two_dynamic_sizes_of_one_name_are_refused():
    with pytest.raises(TileLangError, match="two T.dynamic sizes are named 'M'"):
        @T.prim_func
        def main(X: T.Tensor((T.dynamic("M"), 4), "float32"), Y: T.Tensor((T.dynamic("M"), 4), "float32")):
            with T.Kernel(1):
                pass


def test_a_cluster_divides_a_dynamic_grid_written_in_whole_clusters():
    prog = _program(lambda M: (M, 4), lambda M: (T.ceildiv(M, 2 * 64) * 2, 2), cluster=2)
    assert [d.name for d in prog.dims] == ["M"]


# ----------------------------------------------------------------------------- lowering and building


@pytest.mark.parametrize("arch, tiles", [("sm_80", SM80_TILES), ("sm_90a", SM90_TILES)])
def test_runtime_m_lowers_and_builds(arch, tiles):
    """One cubin: M is the entry's int parameter after the tensors; the grid (the persistent walk's CTAs
    on sm_90a) and the tensor map of A are expressions of it; no other value crosses from the host."""
    kernel = matmul_any_m(96, 128, **tiles, target=arch)
    m = kernel.meta
    assert m.dims == [("M", 1)] and m.kept[-1] == "M" and "int M)" in kernel.source and kernel.cubin
    assert m.params[0][1] == ("M", 128) and m.params[2][1] == ("M", 96)
    assert set(m.kept) <= {"A", "B", "C", "M"} | set(m.tensormaps)
    if arch == "sm_80":
        assert m.grid[1] == "((M + 31) // 32)"
    else:
        assert m.persistent_tiles and evaluate(m.persistent_tiles, {"M": 1000}) == 2 * 16
        assert m.tensormaps["A_tmap"]["dims"] == [128, "M"]


def test_static_kernels_keep_their_cuda():
    """A program without T.dynamic sizes compiles as before: ints in the meta, no int parameters."""
    from programs import matmul

    m = lower(matmul.fn(256, 256, 128), "sm_90a").meta
    assert m.dims == [] and all(isinstance(g, int) for g in m.grid)


# ----------------------------------------------------------------------------- the launch


def _meta(**kw):
    base = dict(name="k", arch="sm_90a", grid=(2, "((M + 63) // 64)", 1), block=(128, 1, 1), smem_bytes=0,
                params=[("A", ("M", 128), "float16"), ("C", ("M", 96), "float16")], kept=["A", "C", "M"],
                out_idx=[1], dims=[("M", 8)])
    return KernelMeta(**{**base, **kw})


def test_launch_dims_read_from_the_inputs_and_checked():
    dims = LaunchDims(_meta(), inputs=[0])
    assert dims.where == {"M": (0, 0, "shape")}
    assert dims.read([np.zeros((40, 128)), None]) == (40,)
    with pytest.raises(ValueError, match=r"M=44; this kernel takes M >= 0 and a multiple of 8"):
        dims.check((44,))
    dims.check((2**31 // 128 - 8,))
    with pytest.raises(ValueError, match="parameter A has 2\\^31 elements or more at M=16777216"):
        dims.check((2**31 // 128,))  # A's 128 columns reach 2^31 elements first
    with pytest.raises(ValueError, match="read from parameter A's dim 0"):
        dims.read([None, None])
    only_out = LaunchDims(_meta(params=[("A", (4, 128), "float16"), ("C", ("M", 96), "float16")]), inputs=[0])
    with pytest.raises(ValueError, match=r"sizes only outputs \(C\), which a call allocates: call launch\(\)"):
        only_out.read([np.zeros((4, 128)), None])


def test_kernel_grid_and_entry_arguments_follow_m():
    kernel = Kernel(_meta(), "", b"")
    assert kernel.grid_on(0, (40,)) == (2, 1, 1) and kernel.grid_on(0, (1000,)) == (2, 16, 1)
    with pytest.raises(ValueError, match="past CUDA's limits"):
        kernel.grid_on(0, (64 * 65536 + 64,))
    args = EntryArgs(_meta())
    assert args.sources[-1] == (DIM, 0)
    assert args.build([0x100, 0x200], 0, dims=(40,)) == [0x100, 0x200, 40]


def test_tensor_map_specs_are_evaluated_per_m():
    spec = dict(tensor="A", dtype="float16", dims=[128, "M"], strides=[256], box=[64, 64], element_strides=[1, 1],
                swizzle=3, l2_promotion=3, oob_fill=0)
    meta = _meta(kept=["A_tmap", "C", "M"], tensormaps={"A_tmap": spec})
    calls = []

    def encode(dtype, ptr, dims, strides, *rest, **kw):
        calls.append((ptr, list(dims)))
        return bytes(128)

    args = EntryArgs(meta, encode=encode)
    args.build([0x100, 0x200], 0, dims=(40,))
    args.build([0x100, 0x200], 0, dims=(40,))  # kept per (pointer, M)
    args.build([0x100, 0x200], 0, dims=(48,))
    assert calls == [(0x100, [128, 40]), (0x100, [128, 48])]
    assert args.spec("A_tmap", (40,))["dims"] == [128, 40] and spec["dims"] == [128, "M"]


def test_plan_of_a_runtime_m_kernel_takes_m_as_a_value(monkeypatch):
    kernel = Kernel(_meta(), "", b"")

    class Fn:
        smem_bytes, name = 0, "k"

        def bind(self, index):
            return None, 0xF00

    monkeypatch.setattr(kernel, "_fn", lambda: Fn())
    scratch, steps = kernel.plan("cuda:0", [0, 1], dims=(40,))
    assert scratch == [] and steps == [(0xF00, (2, 1, 1), (128, 1, 1), 0, "k", [(0, None), (1, None),
                                                                                  (PLAN_VALUE, 40)])]
    assert kernel.plan("cuda:0", [0, 1], dims=(0,)) == ([], [])  # M = 0: nothing to launch


def test_a_plan_family_program_is_the_plan_at_every_m(monkeypatch):
    """With M a PlanExpr of m (a batch of 8 folded into M), the program's grid, M argument and tensor-map dims
    are expressions that give, at each m, what the plan at that M has; a persistent grid is min(CTAs, tiles)."""
    spec = dict(tensor="A", dtype="float16", dims=[128, "M"], strides=[256], box=[64, 64], element_strides=[1, 1],
                swizzle=3, l2_promotion=3, oob_fill=0)
    for meta in (_meta(kept=["A_tmap", "C", "M"], tensormaps={"A_tmap": spec}),
                 _meta(grid=(132, 1, 1), persistent_tiles="(((M + 63) // 64) * 2)")):
        kernel = Kernel(meta, "", b"")

        class Fn:
            smem_bytes, name = 0, "k"

            def bind(self, index):
                return None, 0xF00

        monkeypatch.setattr(kernel, "_fn", lambda: Fn())
        monkeypatch.setattr(importlib.import_module("tile_ops.jit.kernel"), "_sm_count", lambda index: 132)
        _, [family] = kernel.plan("cuda:0", [0, 1], dims=(PlanExpr.m() * 8,))
        at = lambda x, m: x.value(m) if isinstance(x, PlanExpr) else x  # noqa: E731
        for m in (1, 13, 400, 5000):
            _, [step] = kernel.plan("cuda:0", [0, 1], dims=(8 * m,))
            assert tuple(at(g, m) for g in family[1]) == step[1]
            for (buf, spec_f), (buf_s, spec_s) in zip(family[5], step[5]):
                assert at(spec_f, m) == spec_s if buf == PLAN_VALUE else (buf, spec_f is None) == (buf_s, spec_s is None)
                if isinstance(spec_f, dict):
                    assert [at(d, m) for d in spec_f["dims"]] == spec_s["dims"]


# ----------------------------------------------------------------------------- the emulator


def _emulate(arch, M, N=64, K=96, **kw):
    lk = lower(matmul_any_m.fn(N, K, **kw), arch)
    rng = np.random.default_rng(M)
    a, b = (rng.integers(-16, 17, s) / 8 for s in ((M, K), (K, N)))
    A = (a.T.copy() if kw.get("transpose_A") else a).astype(np.float16)
    C = np.full((M, N), np.nan, np.float16)  # written everywhere, or NaN shows
    named = {"M": M}
    maps = {name: dict(s, dims=[evaluate(d, named) for d in s["dims"]],
                       strides=[evaluate(d, named) for d in s["strides"]]) for name, s in lk.meta.tensormaps.items()}
    if lk.meta.persistent_tiles:  # a resident grid of at most 4 CTAs walking the tiles
        grid = (min(4, evaluate(lk.meta.persistent_tiles, named)), 1, 1)
    else:
        grid = tuple(evaluate(g, named) for g in lk.meta.grid)
    emu = Emulator(lk.func, {"A": A, "B": b.astype(np.float16), "C": C, "M": M}, tensormaps=maps)
    emu.run(grid, resident=bool(lk.meta.persistent_tiles))
    np.testing.assert_array_equal(C, (a @ b).astype(np.float16))  # exact products, one rounding
    return emu.ran


@pytest.mark.parametrize("M", [1, 7, 33, 80])
def test_one_sm80_kernel_at_several_m_matches_float64(M):
    assert "cp.async.cg.16 zero-filled" in _emulate("sm_80", M, **SM80_TILES)


def test_sm80_kernel_with_a_transposed_a_of_m_a_multiple_of_8():
    assert "ldmatrix.x4.trans" in _emulate("sm_80", 40, **SM80_TILES, transpose_A=True, m_multiple=8)


@pytest.mark.parametrize("M, kw", [(5, dict(persistent=False)), (130, dict(persistent=False)), (200, {}),
                                   (72, dict(transpose_A=True, m_multiple=8))])
def test_one_sm90_kernel_at_several_m_matches_float64(M, kw):
    """TMA boxes past M zero-filled (5 rows of a 64-row tile), the persistent walk's tile count from M (200:
    4 tiles), A stored M-contiguous with M-long rows in its tensor map."""
    assert "tma.load.2d.swizzle128" in _emulate("sm_90a", M, **SM90_TILES, **kw)


def _rescale_rows(N=64, block_M=32):
    """Out[rows of the block, :] *= 2 through a T.Parallel over the global tile (the fused softmax's rescale)."""
    M = T.dynamic("M")

    @T.prim_func
    def main(Out: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(M, block_M), threads=64) as bx:
            for r, c in T.Parallel(block_M, N):
                Out[bx * block_M + r, c] = Out[bx * block_M + r, c] * 2.0

    return main


@pytest.mark.parametrize("M", [5, 64, 100])
def test_parallel_over_a_global_tile_tests_the_tile_once(M):
    """An interior tile (every row below M) runs the T.Parallel without a predicate per element, under one
    test of its last row; a ragged last tile takes the predicated copy: both right on the emulator."""
    lk = lower(_rescale_rows(), "sm_80")
    source = compile_program(_rescale_rows(), "sm_80").source.replace("((int)blockIdx.x)", "bx")
    assert "if (((bx * 32) + 31) < M)" in source and source.count("< M") == 1 + 32 * 64 // (64 * 4)  # float4s
    x = np.random.default_rng(M).standard_normal((M, 64)).astype(np.float32)
    out = x.copy()
    Emulator(lk.func, {"Out": out, "M": M}).run((-(-M // 32), 1, 1))
    np.testing.assert_array_equal(out, 2 * x)


def _band(N=64, block_M=32):
    """Out = X inside a band of each row (columns row - width < c <= row), -1 outside: a mask as attention's."""
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor((M, N), "float32"), Out: T.Tensor((M, N), "float32"), width: T.Scalar("int32")):
        with T.Kernel(T.ceildiv(M, block_M), threads=64) as bx:
            for r, c in T.Parallel(block_M, N):
                row = bx * block_M + r
                Out[row, c] = T.where((c <= row) & (c + width > row), X[row, c], -1.0)

    return main


@pytest.mark.parametrize("M, width", [(200, 150), (200, 1000), (70, 3), (5, 64)])
def test_a_mask_that_holds_on_a_whole_tile_is_tested_once(M, width):
    """A T.where whose condition is a conjunction of comparisons monotone in the loop variables holds on a whole
    tile when it holds at the tile's worst corners: such a tile (here rows 64.. with width >= the tile's last row
    + 1) stores X without a select per element, the others take the selecting copy; both right on the emulator."""
    source = compile_program(_band(), "sm_80").source.replace("((int)blockIdx.x)", "bx")
    fast = source[source.index("if (((((bx * 32) + 31) < M) && (2 <= bx)) && (32 <= (width - (bx * 32)))) {"):]
    fast = fast[:fast.index("} else {")]
    assert "?" not in fast and fast.count("Out_ptr[") == 32 * 64 // 64
    x = np.random.default_rng(M).standard_normal((M, 64)).astype(np.float32)
    out = np.full((M, 64), np.nan, np.float32)
    Emulator(lower(_band(), "sm_80").func, {"X": x, "Out": out, "M": M, "width": width}).run((-(-M // 32), 1, 1))
    rows, cols = np.arange(M)[:, None], np.arange(64)[None, :]
    np.testing.assert_array_equal(out, np.where((cols <= rows) & (cols + width > rows), x, -1.0))


def test_tile_indices_of_a_runtime_grid_are_computed_once_per_tile():
    """The persistent walk's tile coordinates divide by M's tile count: bound once per tile, the k-loop uses
    the variables (nvcc left the divisions in the loop, where the producer's TMA issue fell behind)."""
    source = compile_program(matmul_any_m.fn(256, 256, **SM90_TILES), "sm_90a").source
    k_loop = source[source.index("for (int k = 0;"):]
    k_loop = k_loop[:k_loop.index("\n    }")]
    assert "tile_ops_once(" in source and "tile_y" in k_loop and "(M + 63)" not in k_loop


# ----------------------------------------------------------------------------- the library gemm


def _kernels_in_cache() -> int:
    root = os.environ["TILE_OPS_CACHE_DIR"]
    return sum("meta.json" in files for _, _, files in os.walk(root))


def test_ten_token_counts_leave_at_most_two_gemm_kernels():
    """Issue 41: M = 1000..1023 at N = K = 4096 (fp16, sm_90a): one kernel, M bound per call."""
    from tile_ops.kernels.gemm_launch import build_gemm, launch_config

    launchables = [build_gemm(M, 4096, 4096, cfg=launch_config(M, 4096, 4096, "float16", arch="sm_90a"),
                              target="sm_90a") for M in random.Random(0).sample(range(1000, 1024), 10)]
    assert _kernels_in_cache() <= 2
    assert all(isinstance(k, Sized) and k.dims == (k.dims[0],) for k in launchables)


def test_random_token_counts_build_one_kernel_per_config(monkeypatch):
    """100 random M in 1..16384 (N = K = 4096): a kernel per distinct kernel call the configs chosen make (a
    config, its one-wave variant; a split's reduction tile), none per M (the builds counted, not run)."""
    import sys

    from tile_ops.kernels.gemm import gemm, gemm_splitk_reduce, reduce_tile
    from tile_ops.kernels.gemm_launch import build_gemm, gemm_call, launch_config

    class Built:
        meta = None

        def dependent(self):
            return self

    built, calls = [], set()
    monkeypatch.setattr(sys.modules["tile_ops.jit"], "_load_or_build",
                        lambda key, trace, target, out_idx: built.append(key) or Built())
    for factory in (gemm, gemm_splitk_reduce):  # kernels earlier tests of this process built: asked for again
        monkeypatch.setattr(factory, "_mem", {})
        monkeypatch.setattr(factory, "_fast", {})
    for M in random.Random(1).sample(range(1, 16385), 100):
        cfg = launch_config(M, 4096, 4096, "float16", arch="sm_90a")
        args, kwargs = gemm_call(M, 4096, 4096, cfg=cfg, target="sm_90a")
        calls.add(repr((args, sorted(kwargs.items()))))
        if cfg.split_k > 1:
            calls.add(repr((cfg.split_k, reduce_tile(M, 4096))))
        build_gemm(M, 4096, 4096, cfg=cfg, target="sm_90a")
    assert len(set(built)) == len(calls) < 20


@pytest.mark.parametrize("M, trans_A, fold", [(4096, False, 1), (1000, True, 1), (77, False, 1), (3000, False, 3)])
def test_a_plan_family_covers_the_token_counts_that_launch_the_same_kernels(M, trans_A, fold):
    """family_ranges: runs of m around the call's in its bucket, each m launching exactly what the call's M does
    (A^T stored M-contiguous: every 8th M shares the kernel of a multiple of 8), the call's own m among them."""
    from tile_ops.kernels.gemm_launch import family_ranges, launch_identity

    p = dict(M=M, N=4096, K=4096, batch=1, batch_a=1, batch_b=1, trans_A=trans_A, trans_B=False, has_bias=False,
             dtype="float16", out_dtype="float16", bias_dtype=None)
    ranges = family_ranges(p, fold, arch="sm_90a", reach=256)
    inside = {m for lo, hi in ranges for m in range(lo, hi + 1)}
    want = launch_identity(p, arch="sm_90a")
    assert M // fold in inside and all(launch_identity({**p, "M": fold * m}, arch="sm_90a") == want for m in inside)
    assert all(b[0] > a[1] + 1 for a, b in zip(ranges, ranges[1:]))  # runs, not touching
    if trans_A:
        assert all((fold * m) % 8 == 0 for m in inside) and len(ranges) > 1
