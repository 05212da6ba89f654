"""The README's tensor-core GEMM (tests/programs.py's matmul) lowered for sm_80 and run on the CPU emulator
(tile_ops/jit/emulator.py: cp.async, ldmatrix, mma.sync m16n8k16): several blocks and at least two pipeline
iterations each, ragged M, N and K, rows too narrow for cp.async, transposed operands, float16 and bfloat16.
Inputs are multiples of 1/8 in [-2, 2], exact in both dtypes, so the float32 accumulation is exact and C is
the float64 reference rounded once to C's dtype: every element must match."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tile_ops.compiler.lower import lower
from programs import matmul
from tile_ops.jit.emulator import Emulator, _ldmatrix, _mma

TILE_32 = dict(block_M=32, block_N=32, block_K=16, num_stages=2, threads=64)  # 1x2 warps of 32x16


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _as(x, dtype):
    """float64 ``x`` (exact in ``dtype``) as the numpy array the emulator takes: bfloat16 as uint16 bits."""
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    return t.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else t.numpy()


def _from(c, dtype):
    return torch.from_numpy(c.view(np.int16)).view(torch.bfloat16).double().numpy() if dtype == "bfloat16" else c


def run_matmul(M, N, K, dtype="float16", out_dtype=None, transpose_A=False, transpose_B=False, **tiles):
    """C = A @ B on the emulator, with the float64 reference C's dtype rounds to and the PTX that ran."""
    out_dtype = out_dtype or dtype
    lk = lower(matmul.fn(M, N, K, dtype=dtype, out_dtype=out_dtype, transpose_A=transpose_A,
                         transpose_B=transpose_B, **tiles), "sm_80")
    rng = np.random.default_rng(M * N * K)
    a, b = (rng.integers(-16, 17, shape) / 8 for shape in ((M, K), (K, N)))
    A, B = _as(a.T.copy() if transpose_A else a, dtype), _as(b.T.copy() if transpose_B else b, dtype)
    C = _as(np.full((M, N), np.nan), out_dtype)  # written everywhere, or NaN shows
    emu = Emulator(lk.func, {"A": A, "B": B, "C": C})
    emu.run(lk.meta.grid)
    ref = torch.from_numpy(a @ b).to(getattr(torch, out_dtype)).double().numpy()  # exact, then one rounding
    return _from(C, out_dtype), ref, lk.meta.grid, emu.ran


@pytest.mark.parametrize("shape, kw, grid, ran", [
    pytest.param((64, 64, 32), dict(TILE_32), (2, 2, 1),
                 {"cp.async.cg.16", "ldmatrix.x4", "ldmatrix.x4.trans", "mma.f16"}, id="aligned"),
    pytest.param((80, 72, 48), dict(TILE_32, block_K=32, num_stages=3), (3, 3, 1),
                 {"cp.async.cg.16", "cp.async.cg.16 zero-filled", "ldmatrix.x4", "mma.f16"}, id="ragged"),
    pytest.param((33, 17, 40), dict(TILE_32, block_N=16, threads=32), (2, 2, 1),  # B's rows: 34 bytes
                 {"cp.async.cg.16 zero-filled", "ldmatrix.x4", "ldmatrix.x4.trans", "mma.f16"}, id="narrow-rows"),
    pytest.param((33, 17, 40), dict(TILE_32, block_N=8, threads=32, transpose_A=True, transpose_B=True), (3, 2, 1),
                 {"cp.async.cg.16 zero-filled", "ldmatrix.x4.trans", "ldmatrix.x2", "mma.f16"}, id="narrow-AtBt"),
    pytest.param((40, 20, 36), dict(TILE_32, block_N=16, threads=32, transpose_A=True, transpose_B=True), (2, 2, 1),
                 {"cp.async.cg.16 zero-filled", "cp.async.ca.8 zero-filled", "ldmatrix.x4.trans"}, id="8-byte-rows-AtBt"),
    pytest.param((80, 72, 48), dict(TILE_32, transpose_A=True, transpose_B=True, out_dtype="float32"), (3, 3, 1),
                 {"ldmatrix.x4.trans", "ldmatrix.x4", "mma.f16"}, id="AtBt-f32"),
    pytest.param((80, 72, 48), dict(TILE_32, dtype="bfloat16", num_stages=3, out_dtype="float32"), (3, 3, 1),
                 {"cp.async.cg.16 zero-filled", "mma.bf16"}, id="bf16-f32"),
    pytest.param((80, 40, 48), dict(TILE_32, dtype="bfloat16", transpose_A=True), (2, 3, 1),
                 {"ldmatrix.x4.trans", "mma.bf16"}, id="bf16-At"),
    pytest.param((48, 72, 40), dict(TILE_32, dtype="bfloat16", transpose_B=True, block_M=64, block_N=64,
                                    num_stages=3, threads=128), (2, 1, 1),
                 {"ldmatrix.x4", "mma.bf16"}, id="bf16-Bt-4warps"),
])
def test_matmul_on_tensor_cores_matches_numpy(shape, kw, grid, ran):
    C, ref, lk_grid, emu_ran = run_matmul(*shape, **kw)
    assert lk_grid == grid
    assert ran <= set(emu_ran), sorted(emu_ran)  # the PTX this case is for ran
    np.testing.assert_array_equal(C, ref)


def test_library_gemm_reading_b_evict_first_matches_numpy():
    """``GemmConfig(b_evict_first=True)`` on sm_80: B's cp.async copies carry the L2 policy a createpolicy made
    (A's do not); ragged M, N and K, so some copies are zero-filled."""
    from tile_ops.kernels.gemm import gemm
    from tile_ops.kernels.gemm_config import GemmConfig

    M, N, K = 40, 200, 100
    lk = lower(gemm.fn(M, N, K, 1, 1, 1, False, False, False, "float16", "float16",
                       GemmConfig(64, 64, 32, 3, 128, 0, b_evict_first=True)), "sm_80")
    rng = np.random.default_rng(9)
    a, b = (rng.integers(-16, 17, s) / 8 for s in ((M, K), (K, N)))
    arrays = {"A": a.astype(np.float16)[None], "B": b.astype(np.float16)[None], "Bias": np.zeros(N, np.float16),
              "C": np.full((1, M, N), np.nan, np.float16)}
    emu = Emulator(lk.func, arrays)
    emu.run(lk.meta.grid)
    assert {"cp.async.cg.16.evict_first", "cp.async.cg.16.evict_first zero-filled"} <= set(emu.ran), sorted(emu.ran)
    assert not any("evict" in r for r in emu.ran if r.startswith("cp.async.ca")), sorted(emu.ran)  # A: 8-byte rows
    np.testing.assert_array_equal(arrays["C"][0], (a @ b).astype(np.float16))


def _word(lo, hi):
    """A b32 register holding two float16 values, ``lo`` in its low half."""
    return np.array([lo, hi], np.float16).view(np.uint32)[0]


def test_mma_follows_the_ptx_fragment_layout():
    """mma.sync m16n8k16 .row.col, lane by lane as the PTX ISA's fragment tables give them (g = lane / 4,
    c = 2 (lane % 4)): a0..a7 at A[g, c..c+1], A[g+8, c..c+1], A[g, c+8..c+9], A[g+8, c+8..c+9]; b0..b3 at
    B[c..c+1, g], B[c+8..c+9, g]; c0..c3 and d0..d3 at C[g, c..c+1], C[g+8, c..c+1]."""
    rng = np.random.default_rng(1)
    A, B = rng.integers(-8, 9, (16, 16)).astype(np.float16), rng.integers(-8, 9, (16, 8)).astype(np.float16)
    C = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    lanes = [(lane // 4, 2 * (lane % 4)) for lane in range(32)]
    operands = [([_word(A[r, k], A[r, k + 1]) for r, k in ((g, c), (g + 8, c), (g, c + 8), (g + 8, c + 8))],
                 [_word(B[k, g], B[k + 1, g]) for k in (c, c + 8)],
                 [C[g, c], C[g, c + 1], C[g + 8, c], C[g + 8, c + 1]]) for g, c in lanes]
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    for (g, c), d in zip(lanes, _mma(None, "f16", operands)):
        assert list(d) == [D[g, c], D[g, c + 1], D[g + 8, c], D[g + 8, c + 1]]


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_follows_the_ptx_fragment_layout(count, trans):
    """ldmatrix m8n8.x{1,2,4}: lane 8i + r gives the address of row r of matrix i (rows anywhere, 16-byte
    aligned); lane t receives per matrix the word of row t / 4, elements 2 (t % 4) and 2 (t % 4) + 1 (with
    .trans, of column t / 4)."""
    mats = np.arange(count * 64, dtype=np.float16).reshape(count, 8, 8)
    smem = np.full(count * 8 * 32, 0xFF, np.uint8)
    addrs = [(i * 8 + r) * 32 + 16 * ((i + r) % 2) for i in range(count) for r in range(8)]  # scattered rows
    for i in range(count):
        for r in range(8):
            smem[addrs[i * 8 + r]:addrs[i * 8 + r] + 16] = mats[i, r].view(np.uint8)
    addrs += [0] * (32 - len(addrs))  # x1, x2: the other lanes' addresses are not read
    words = _ldmatrix(SimpleNamespace(smem=smem), (count, trans), addrs)
    for t in range(32):
        m = mats.transpose(0, 2, 1) if trans else mats
        assert list(words[t]) == [_word(m[i, t // 4, 2 * (t % 4)], m[i, t // 4, 2 * (t % 4) + 1]) for i in range(count)]
