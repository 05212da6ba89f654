"""Fragment programs run on the CPU emulator (tile_ops/jit/emulator.py: registers, warp shuffles): row
reductions, a row statistic of one accumulator applied to another (FlashAttention's rescale), casts
between fragments.  A gemm in a loop of no iterations only fixes the fragments' layouts; their values
come from global memory through T.copy."""

import math

import numpy as np
import pytest
import torch

import tile_ops
import tile_ops.lang as T
from tile_ops.compiler.lower import lower
from tile_ops.lang.errors import TileLangError
from tile_ops.jit.emulator import Emulator

bM, bN, DIM = 64, 64, 128


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def emulate(prog, arch, **arrays):
    lk = lower(prog, arch)
    Emulator(lk.func, arrays).run(lk.meta.grid)


def rescale(policy_s, policy_o, threads=128, kind="max"):
    """O - rowmax(S) (or T.reduce_``kind``'s statistic), S (bM, bN) and O (bM, DIM) laid out by two gemms of the
    given policies."""
    @T.prim_func
    def main(X: T.Tensor((bM, bN), "float32"), X2: T.Tensor((bM, DIM), "float32"), Y: T.Tensor((bM, DIM), "float32"),
             Z: T.Tensor((bM,), "float32")):
        with T.Kernel(1, threads=threads) as bx:
            Q_s = T.alloc_shared((bM, 16), "float16")
            K_s = T.alloc_shared((16, bN), "float16")
            V_s = T.alloc_shared((16, DIM), "float16")
            S = T.alloc_fragment((bM, bN), "float32")
            O = T.alloc_fragment((bM, DIM), "float32")
            m = T.alloc_fragment((bM,), "float32")
            for _ in T.serial(0):
                T.gemm(Q_s, K_s, S, policy=policy_s)
                T.gemm(Q_s, V_s, O, policy=policy_o)
            T.copy(X, S)
            T.copy(X2, O)
            getattr(T, f"reduce_{kind}")(S, m, dim=1)
            for i, j in T.Parallel(bM, DIM):
                O[i, j] = O[i, j] - m[i]
            T.copy(O, Y)
            T.copy(m, Z)
    return main


@pytest.mark.parametrize("arch, policy_s, policy_o", [("sm_80", "full_row", "full_row"), ("sm_90a", "full_row", "full_row"),
                                                      ("sm_90a", "square", "square"), ("sm_90a", "full_row", "square")])
def test_a_row_statistic_of_one_accumulator_rescales_another_of_the_same_rows(arch, policy_s, policy_o):
    """FlashAttention's `O[i, j] *= f(m[i])` with m reduced from S (bM x bN) and O bM x DIM: the loop runs over
    O's registers, so m's register is found from O's numbering (it read S's: wrong rows, past m's end)."""
    rng = np.random.default_rng(0)
    X, X2 = rng.standard_normal((bM, bN)).astype(np.float32), rng.standard_normal((bM, DIM)).astype(np.float32)
    Y, Z = np.zeros((bM, DIM), np.float32), np.zeros(bM, np.float32)
    emulate(rescale(policy_s, policy_o), arch, X=X, X2=X2, Y=Y, Z=Z)
    np.testing.assert_array_equal(Z, X.max(1))
    np.testing.assert_array_equal(Y, X2 - X.max(1)[:, None])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("kind", ["min", "sum"])
def test_row_minimum_and_sum(arch, kind):
    """T.reduce_min and T.reduce_sum fold like T.reduce_max: each thread's own columns, then the quad's lanes."""
    rng = np.random.default_rng(1)
    X, X2 = rng.standard_normal((bM, bN)).astype(np.float32), rng.standard_normal((bM, DIM)).astype(np.float32)
    Y, Z = np.zeros((bM, DIM), np.float32), np.zeros(bM, np.float32)
    policy = "full_row" if arch == "sm_80" else "square"  # (one row's threads in both accumulators)
    emulate(rescale(policy, policy, kind=kind), arch, X=X, X2=X2, Y=Y, Z=Z)
    want = X.min(1) if kind == "min" else X.astype(np.float64).sum(1)
    np.testing.assert_allclose(Z, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Y, X2 - Z[:, None], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy_s, policy_o", [("square", "square"), ("full_row", "square")])
def test_a_row_statistic_of_an_accumulator_over_other_warps_is_refused_at_its_line(policy_s, policy_o):
    """mma.sync: a square 64x64 accumulator is 2x2 warps, a 64x128 one 1x4, so S's rows sit in other threads
    than O's; the error names both warp grids and what works."""
    with pytest.raises(TileLangError, match=r"fragment m holds the rows of a 64x64 accumulator over \dx\d warps, but "
                                            r"this T.Parallel's 64x128 accumulator is over 1x4 warps .* give both "
                                            r'gemms policy="full_row"') as e:
        lower(rescale(policy_s, policy_o), "sm_80")
    assert "O[i, j] = O[i, j] - m[i]" in str(e.value) or "T.Parallel(bM, DIM)" in str(e.value)


def cast_between_fragments(M, N, threads, in_loop):
    """B = A cast to float16 through two fragments no gemm lays out: a T.copy, or a T.Parallel reading both."""
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), "float16")):
        with T.Kernel(1, threads=threads) as bx:
            F = T.alloc_fragment((M, N), "float32")
            G = T.alloc_fragment((M, N), "float16")
            T.copy(A, F)
            if in_loop:
                for i, j in T.Parallel(M, N):
                    G[i, j] = T.cast(F[i, j] * 2.0, "float16")
            else:
                T.copy(F, G)
            T.copy(G, B)
    return main


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("in_loop", [False, True])
def test_fragments_no_gemm_lays_out_share_one_layout_across_a_cast(arch, in_loop):
    """Each got a default layout from its own dtype (4 floats or 8 halves a thread in a row), so the cast copy
    paired registers holding other elements (1008 of 1024 wrong) and the loop was refused as mixing layouts."""
    A = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
    B = np.zeros((32, 32), np.float16)
    emulate(cast_between_fragments(32, 32, 64, in_loop), arch, A=A, B=B)
    np.testing.assert_array_equal(B, (A * (2 if in_loop else 1)).astype(np.float16))


def test_a_row_value_in_a_loop_over_fragments_no_gemm_laid_out_is_refused_at_its_line():
    @T.prim_func
    def main(A: T.Tensor((32, 32), "float32")):
        with T.Kernel(1, threads=32) as bx:
            F = T.alloc_fragment((32, 32), "float32")
            m = T.alloc_fragment((32,), "float32")
            T.copy(A, F)
            T.fill(m, 2.0)
            for i, j in T.Parallel(32, 32):
                F[i, j] = F[i, j] * m[i]
            T.copy(F, A)

    with pytest.raises(TileLangError, match=r"fragment m is read by row in a T.Parallel whose 2-D fragments no gemm "
                                            r"laid out: a row value \(what T.reduce_\* writes\) applies to a gemm's"):
        lower(main, "sm_80")


def masked_rows(vectorized: bool):
    """Y[r0 + i, j] = X[i, j] (through a fragment, or a plain tile) only where i < n: T.when; Z[0] = 1 where n > 4."""
    n, r0 = T.dynamic("n"), T.dynamic("r0")

    @T.prim_func
    def main(X: T.Tensor((32, 16), "float32"), Y: T.Tensor((r0, 16), "float32"), Z: T.Tensor((n,), "float32")):
        with T.Kernel(1, threads=64) as bx:
            F = T.alloc_fragment((32, 16), "float32")
            T.copy(X, F)
            start = Y.shape[0] - 32
            for i, j in T.Parallel(32, 16):
                with T.when(i < Z.shape[0]):
                    if vectorized:
                        Y[start + i, j] = X[i, j]
                    else:
                        Y[start + i, j] = F[i, j]
            with T.when(Z.shape[0] > 4):
                Z[0] = 1.0
    return main


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("n", [3, 32])
def test_when_writes_only_where_its_condition_holds(arch, vectorized, n):
    """Rows at or past n keep what they held (NaN), on the interior-tile path (n = 32: settled once a tile) and
    the masked one; the top-level store too."""
    X = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)
    Y, Z = torch.full((40, 16), math.nan), torch.zeros(n)
    tile_ops.interpret(masked_rows(vectorized), X, Y, Z, arch=arch)
    assert torch.equal(Y[8:8 + n], X[:n])
    assert Y[:8].isnan().all() and Y[8 + n:].isnan().all()
    assert Z[0] == (1.0 if n > 4 else 0.0)


@pytest.mark.parametrize("body, match", [
    (lambda X, F: T.copy(X, F), r"test_fragments_emulated.py:\d+: a T.when block holds element assignments .* \(Copy\)"),
    (lambda X, F: T.fill(F, 0.0), r"not a tile op or loop \(Fill\); put the T.when inside the T.Parallel"),
])
def test_when_around_a_tile_op_is_refused_at_its_line(body, match):
    with pytest.raises(TileLangError, match=match):
        @T.prim_func
        def main(X: T.Tensor((32, 16), "float32")):
            with T.Kernel(1, threads=64) as bx:
                F = T.alloc_fragment((32, 16), "float32")
                with T.when(bx == 0):
                    body(X, F)


def test_when_takes_a_condition():
    with pytest.raises(TileLangError, match=r"T.when: the condition .* is int32; accepted: a comparison"):
        @T.prim_func
        def main(X: T.Tensor((32,), "float32")):
            with T.Kernel(1, threads=32) as bx:
                for i in T.Parallel(32):
                    with T.when(i + 1):
                        X[i] = 0.0


def gather_rows(n_rows):
    """Out[i] = X[Rows[bx] + i] over blocks of 16 rows whose starts a table gives: T.bind reads them once."""
    n = T.dynamic("n")

    @T.prim_func
    def main(X: T.Tensor((n, 8), "float32"), Rows: T.Tensor((4,), "int32"), Out: T.Tensor((64, 8), "float32")):
        with T.Kernel(4, threads=32) as bx:
            start = T.bind(Rows[bx], "start")
            count = T.bind(T.min(n - start, n_rows), "count")
            for i, j in T.Parallel(16, 8):
                with T.when(i < count):
                    Out[bx * 16 + i, j] = X[start + i, j]
    return main


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_bind_computes_a_value_once_a_block_from_global_memory(arch):
    X = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)
    Rows, Out = torch.tensor([3, 30, 0, 36], dtype=torch.int32), torch.full((64, 8), math.nan)
    tile_ops.interpret(gather_rows(16), X, Rows, Out, arch=arch)
    for b, start in enumerate(Rows.tolist()):
        count = min(40 - start, 16)
        assert torch.equal(Out[b * 16:b * 16 + count], X[start:start + count])
        assert Out[b * 16 + count:(b + 1) * 16].isnan().all()


@pytest.mark.parametrize("where, match", [
    ("loop", r"T.bind belongs at the top of the T.Kernel body"),
    ("float", r"T.bind: .* is float32; accepted: an integer value"),
])
def test_bind_is_refused_inside_a_loop_and_for_a_float(where, match):
    with pytest.raises(TileLangError, match=match):
        @T.prim_func
        def main(X: T.Tensor((32,), "float32")):
            with T.Kernel(1, threads=32) as bx:
                if where == "float":
                    T.bind(X[0])
                for i in T.serial(2):
                    T.bind(i)
