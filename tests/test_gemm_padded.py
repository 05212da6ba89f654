"""Operands whose rows are not 16-byte multiples, on the CPU: on sm_90a build_gemm pads exactly those
(A's or B's stored rows, transposed or not) so that TMA loads them; ``pad_rows`` copies and zero-fills
(run on the CPU emulator); the PaddedGemm launch and plan plumbing (fake kernels).  GPU numerics:
tests/test_gemm_configs_gpu.py (ragged shapes, every config) and tests/test_ops_gpu.py (the fast path)."""

import numpy as np
import pytest
import torch

from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from tile_ops.kernels import gemm_launch
from tile_ops.kernels.gemm import pad_rows
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_defaults import default_config
from tile_ops.jit.kernel import Sized
from tile_ops.kernels.gemm_launch import PaddedGemm, SplitKGemm, build_gemm
from fake_kernels import FakeKernel, record_allocations
from tile_ops.jit.emulator import Emulator

CFG = GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("shape, trans_A, trans_B, pads", [
    ((777, 3001, 1234), False, False, {0: (1, 777, 1240), 1: (1, 1234, 3008)}),  # A along K, B along N
    ((777, 3001, 1234), True, True, {0: (1, 1234, 784), 1: (1, 3001, 1240)}),  # A^T along M, B^T along K
    ((1024, 3001, 1024), False, False, {1: (1, 1024, 3008)}),
    ((1024, 3001, 1024), False, True, {}),  # B^T's rows are K = 1024 long: aligned
    ((3000, 1000, 1500), False, False, {0: (1, 3000, 1504)})])
def test_sm90a_pads_exactly_the_operands_tma_cannot_load(shape, trans_A, trans_B, pads):
    k = unsized(build_gemm(*shape, 1, 1, 1, trans_A, trans_B, True, "float16", "float16", CFG, target="sm_90a"))
    if not pads:
        assert not isinstance(k, PaddedGemm)
        return
    M = shape[0]
    assert isinstance(k, PaddedGemm) and {i: at(pad, 1, M) for i, pad in k.pads.items()} == pads
    for i, pad in k.pads.items():  # the workspace the gemm reads
        assert pad.meta.params[1][::2] == ("Y", "float16") and at(k.main, i, M) == pads[i]
    # both operands are TMA-loaded now (a synchronous-copy fallback would have no tensor map for them)
    assert {"A", "B"} <= {m["tensor"] for m in k.main.meta.tensormaps.values()} and "wgmma.mma_async" in k.source
    assert k.meta is k.main.meta and k.cubin == k.main.cubin
    assert at(k.main, 3, M) == (1, *shape[:2])  # the output is not padded
    # M at run time (the pad of A's rows too), except where A^T's rows of M are padded: per M
    assert k.main.meta.dims == ([] if trans_A else [("M", 1)])


def unsized(k):
    """The launchable inside build_gemm's ``Sized`` (M at run time, bound), or ``k``."""
    return k.launchable if isinstance(k, Sized) else k


def at(kernel, i, M) -> tuple:
    """Parameter i's shape at M."""
    return tuple(evaluate(d, {"M": M}) for d in kernel.meta.params[i][1])


def test_padding_only_where_it_enables_tma():
    shape = (777, 3001, 1234)
    unpadded = unsized(build_gemm(*shape, cfg=CFG, target="sm_90a", pad=False))
    assert not isinstance(unpadded, PaddedGemm) and "cp.async.bulk.tensor" not in unpadded.source
    assert not isinstance(unsized(build_gemm(*shape, cfg=CFG, target="sm_90")), PaddedGemm)  # cp.async: no TMA
    # a decode split-K gemm with a ragged K pads A inside (the split pair reads the workspace)
    k = unsized(build_gemm(16, 2048, 4095, cfg=default_config(16, 2048, 4095, "sm_90a"), target="sm_90a"))
    assert isinstance(k, PaddedGemm) and isinstance(k.main, SplitKGemm) and list(k.pads) == [0]
    # ... and so does the swapped decode kernel (B^T A^T): its "B" operand is A
    swapped = default_config(16, 4096, 4095, "sm_90a")
    k = unsized(build_gemm(16, 4096, 4095, cfg=swapped, target="sm_90a"))
    assert swapped.swap_ab and isinstance(k, PaddedGemm) and list(k.pads) == [0]


def test_pad_rows_grid_takes_a_million_rows():
    """Rows go on grid x (up to 2^31 - 1 blocks), not y (65535 blocks: ~1M rows of 16)."""
    grid = compile_program(pad_rows.fn(1, 1_100_000, 1001, 1008), "sm_90a").meta.grid
    assert grid == (68750, 4, 1)


@pytest.mark.parametrize("rows, cols, padded", [(37, 129, 136), (5, 3001, 3008), (16, 7, 8)])
def test_pad_rows_copies_rows_and_zero_fills_the_rest(rows, cols, padded):
    x = np.random.default_rng(0).uniform(-4, 4, (2, rows, cols)).astype(np.float16)
    y = np.full((2, rows, padded), np.nan, np.float16)
    lk = lower(pad_rows.fn(2, rows, cols, padded), "sm_80")
    Emulator(lk.func, {"X": x, "Y": y}).run(lk.meta.grid)
    np.testing.assert_array_equal(y[..., :cols], x)
    assert not y[..., cols:].any()  # zeros, not NaN: they multiply the other operand's zero rows


def _padded(log):
    pad_a = FakeKernel([("X", (1, 16, 7), "float16"), ("Y", (1, 16, 8), "float16")], log, "pad A")
    pad_b = FakeKernel([("X", (1, 7, 9), "bfloat16"), ("Y", (1, 7, 16), "bfloat16")], log, "pad B")
    main = FakeKernel([], log, "gemm")
    return PaddedGemm({0: pad_a, 1: pad_b}, main)


def test_padded_gemm_launches_pads_then_the_gemm_on_the_workspaces(monkeypatch):
    log, cpu = [], torch.device("cpu")
    allocs = record_allocations(monkeypatch, gemm_launch)
    gemm_launch.gemm_launcher(_padded(log), cpu)(0x100, 0x200, 0x300, 0x400)
    (sa, da, wa), (sb, db, wb) = allocs
    assert (sa, da, sb, db) == ((1, 16, 8), torch.float16, (1, 7, 16), torch.bfloat16)
    assert log == [("pad A", [0x100, wa], cpu), ("pad B", [0x200, wb], cpu), ("gemm", [wa, wb, 0x400, 0x300], cpu)]


def test_padded_gemm_launches_every_step_after_the_first_programmatically():
    """Each later step starts while the one before it runs and waits for it at its entry (Kernel.dependent)."""
    k = _padded([])
    assert [k.pads[0].programmatic, k.pads[1].programmatic, k.main.programmatic] == [False, True, True]
    d = k.dependent()  # every step, the first pad too; the original is unchanged
    assert [d.pads[0].programmatic, d.pads[1].programmatic, d.main.programmatic] == [True, True, True]
    assert not k.pads[0].programmatic


def test_padded_gemm_plan_puts_the_workspaces_in_scratch_buffers():
    k = _padded([])
    A, B, C, OUT, SCRATCH = range(5)
    spaces, steps = k.plan(None, [A, B, C, OUT], SCRATCH)
    assert spaces == [((1, 16, 8), torch.float16), ((1, 7, 16), torch.bfloat16)]
    assert steps == [("pad A", [A, SCRATCH]), ("pad B", [B, SCRATCH + 1]), ("gemm", [SCRATCH, SCRATCH + 1, C, OUT])]


def test_padded_gemm_plan_is_its_launch_where_the_gemm_runs_host_code():
    log = []
    k = _padded(log)
    k.main.meta.needs_workspace = True  # stream-K: its plan is its launcher, which runs host code
    launch = gemm_launch.gemm_plan(k, torch.device("cpu"), 0, 1, 3, 2, 4)  # buffers a, b, out, bias; scratch
    assert callable(launch)
    launch(0x100, 0x200, 0x300, 0x400)  # the pointers of the plan buffers a, b, bias, out
    assert [n for n, _, _ in log] == ["pad A", "pad B", "gemm"] and log[0][1][0] == 0x100 and log[1][1][0] == 0x200
    assert log[2][1][2:] == [0x300, 0x400]  # bias slot <- bias, output <- out
