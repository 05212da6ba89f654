"""``T.deferred()`` and wgmma groups that run on past their gemm.

A deferred block ends its pipelined loop's iteration; the warp-specialized sm_90a loop runs iteration t's block
during iteration t + 1 at its place (its wgmmas under what follows it there), every other loop at the end of its
iteration.  A T.gemm on sm_90a commits its wgmmas as a group that the lowering waits for only where a later
statement needs it.  On the CPU emulator, whose wgmmas read their operands and write their accumulators only
when a wait retires them, a wait placed too late or a stage released too early gives wrong numbers."""

import re

import numpy as np
import pytest

import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.lang.errors import TileLangError
from tile_ops.jit.emulator import Emulator

DIM = 64


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def chain(bM=64, bN=32, stages=2, threads=128, deferred=True):
    """acc = 0; per key tile t: acc = acc / 2 + (Q K_t^T / 8) V_t, with ``tiles`` (a launch-time scalar) tiles: the
    shape of FlashAttention's loop (a rescale of acc that must follow the previous tile's P V) without its
    softmax.  ``deferred``: P V in a T.deferred() block placed right after S = Q K^T, else at the end."""
    N = T.dynamic("N", multiple_of=8)

    @T.prim_func
    def main(Q: T.Tensor((bM, DIM), "float16"), K: T.Tensor((N, DIM), "float16"), V: T.Tensor((N, DIM), "float16"),
             O: T.Tensor((bM, DIM), "float32"), tiles: T.Scalar("int32")):
        with T.Kernel(1, threads=threads):
            Q_s = T.alloc_shared((bM, DIM), "float16")
            K_s = T.alloc_shared((bN, DIM), "float16")
            V_s = T.alloc_shared((bN, DIM), "float16")
            S = T.alloc_fragment((bM, bN), "float32")
            P = T.alloc_fragment((bM, bN), "float16")
            acc = T.alloc_fragment((bM, DIM), "float32")
            T.copy(Q[0, 0], Q_s)
            T.clear(acc)
            for t in T.Pipelined(tiles, num_stages=stages):
                T.copy(K[t * bN, 0], K_s)
                T.copy(V[t * bN, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                if deferred:
                    with T.deferred():
                        T.gemm(P, V_s, acc, policy="full_row")
                for i, j in T.Parallel(bM, bN):
                    S[i, j] = S[i, j] * 0.125
                for i, j in T.Parallel(bM, DIM):
                    acc[i, j] = acc[i, j] * 0.5
                T.copy(S, P)
                if not deferred:
                    T.gemm(P, V_s, acc, policy="full_row")
            T.copy(acc, O[0, 0])

    return main


def run_chain(arch, tiles, bM=64, bN=32, stages=2, threads=128, seed=0):
    """(the emulator's O, float64's) for ``tiles`` key tiles (N = tiles * bN + 8 rows, so the loads never clip)."""
    lk = lower(chain(bM, bN, stages, threads), arch)
    rng = np.random.default_rng(seed)
    N = max(tiles, 1) * bN + 8
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((bM, DIM), (N, DIM), (N, DIM)))
    out = np.full((bM, DIM), np.nan, np.float32)
    at = lambda values: [int(eval(str(x), {}, {"N": N})) if isinstance(x, str) else x for x in values]  # noqa: E731
    maps = {n: dict(t, dims=at(t["dims"]), strides=at(t["strides"])) for n, t in lk.meta.tensormaps.items()}
    emu = Emulator(lk.func, dict(Q=q, K=k, V=v, O=out, N=N, tiles=tiles),
                   tensormaps=maps)
    emu.run((1, 1, 1), stagger=True)
    acc = np.zeros((bM, DIM))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for t in range(tiles):
        p = (q64 @ k64[t * bN:(t + 1) * bN].T / 8).astype(np.float16).astype(np.float64)
        acc = acc / 2 + p @ v64[t * bN:(t + 1) * bN]
    return out, acc, emu.ran


@pytest.mark.parametrize("arch, tiles, kw", [
    ("sm_90a", 0, {}), ("sm_90a", 1, {}), ("sm_90a", 2, {}), ("sm_90a", 5, {}),
    ("sm_90a", 4, dict(stages=3)), ("sm_90a", 3, dict(bM=128, threads=256, bN=64)),
    ("sm_80", 3, {}), ("sm_80", 0, {}),
])
def test_deferred_block_computes_the_loop_with_it_at_the_end(arch, tiles, kw):
    """Iteration t's P V one iteration late on sm_90a, at the end of iteration t on sm_80: both are the program's
    result; no key tile leaves acc 0, one runs only the peeled first step and the last block."""
    out, ref, ran = run_chain(arch, tiles, **kw)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3 * max(1.0, np.abs(ref).max()))
    if arch == "sm_90a" and tiles:
        assert ran.get("wgmma.m64n64k16.f16.rs", 0) or ran.get("wgmma.m64n64k16.f16.rs.trans-b", 0), ran


def _main_loop(source: str) -> str:
    """The consumers' loop over steps 1.. of an overlapped main loop: from its first wgmma.fence to its release."""
    body = source[re.search(r"for \(int \w+ = 1;", source).start():]
    return body[:body.index("mbarrier_arrive") if "mbarrier_arrive" in body else None]


def test_the_deferred_wgmmas_run_under_what_follows_them():
    """In the loop, S = Q K^T and the previous step's P V are both committed before the first wait, which waits
    for S only (``wait_group 1``); P V is waited for (``wait_group 0``) at acc's rescale, after S's scaling."""
    src = compile_program(chain(), "sm_90a").source
    loop = _main_loop(src)
    events = re.findall(r"wgmma_(commit_group|wait_group)\w*?(?:_(\d))?\(\)|S_ptr\[\w+\] = \(S_ptr|"
                        r"(acc_ptr)\[\w+\] = \(acc_ptr", loop)
    order = [e[0] + (e[1] and f" {e[1]}") or ("S scaled" if not e[2] else "acc rescaled") for e in events]
    assert order[:4] == ["commit_group", "commit_group", "wait_group 1", "S scaled"], order
    assert order.index("wait_group 0") < order.index("acc rescaled"), order


def test_a_gemm_is_waited_for_where_its_result_is_used():
    """Statements that do not touch a gemm's accumulator or operands run before its wait."""
    @T.prim_func
    def main(A: T.Tensor((64, 64), "float16"), X: T.Tensor((64, 64), "float32"), Y: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128):
            A_s = T.alloc_shared((64, 64), "float16")
            C = T.alloc_fragment((64, 64), "float32")
            D = T.alloc_fragment((64, 64), "float32")
            T.copy(A, A_s)
            T.gemm(A_s, A_s, C, transpose_B=True, clear_accum=True)
            T.copy(X, D)  # independent of the gemm: before its wait
            for i, j in T.Parallel(64, 64):
                C[i, j] = C[i, j] + D[i, j]
            T.copy(C, Y)

    src = compile_program(main, "sm_90a").source
    src = src[src.index("__global__"):]
    commit, wait = src.index("wgmma_commit_group"), src.index("wgmma_wait_group")
    x_read = src.index("X_ptr", commit)
    assert commit < x_read < wait


@pytest.mark.parametrize("where, message", [
    ("serial", "belongs directly in the body of a T.Pipelined loop"),
    ("twice", "has one T.deferred() block"),
    ("stages", "needs num_stages >= 2"),
    ("clash", "both touch P where one writes it"),
])
def test_a_deferred_block_that_cannot_run_late_is_an_error(where, message):
    def program():
        @T.prim_func
        def main(A: T.Tensor((256, 64), "float16"), O: T.Tensor((64, 64), "float32")):
            with T.Kernel(1, threads=128):
                A_s = T.alloc_shared((64, 64), "float16")
                S = T.alloc_fragment((64, 64), "float32")
                P = T.alloc_fragment((64, 64), "float16")
                acc = T.alloc_fragment((64, 64), "float32")
                T.clear(acc)
                loop = T.serial(4) if where == "serial" else T.Pipelined(4, num_stages=1 if where == "stages" else 2)
                for t in loop:
                    T.copy(A[t * 64, 0], A_s)
                    T.gemm(A_s, A_s, S, transpose_B=True, clear_accum=True)
                    if where == "clash":
                        T.copy(S, P)  # written before the block, which reads it
                    with T.deferred():
                        T.gemm(P, A_s, acc)
                    if where == "twice":
                        with T.deferred():
                            T.gemm(P, A_s, acc)
                    if where != "clash":
                        T.copy(S, P)
                T.copy(acc, O)
        return main

    with pytest.raises(TileLangError, match=re.escape(message)) as e:
        compile_program(program(), "sm_90a")
    assert "test_deferred.py" in str(e.value)


def test_sass_check_follows_wgmma_groups():
    """``wgmma_early_reads`` retires groups by ``WARPGROUP.DEPBAR.LE gsb0, N`` (the N youngest stay in flight): the
    older group's accumulators are readable after ``0x1``, the younger's not, and the younger's A registers are
    not to be written."""
    from tile_ops.jit.build import wgmma_early_reads
    from test_compiler import _listing

    s_gemm = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR24], R24, gsb0"
    pv = ["HGMMA.64x128x16.F32.BF16 R88, R120, gdesc[UR16].tnspB, R88", "HGMMA.64x128x16.F32.BF16 R88, R124, "
          "gdesc[UR8].tnspB, R88, gsb0"]
    wait1, wait0 = "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    read_s, read_acc, write_p = "FMUL R30, R30, 0.125", "FMUL R90, R90, 0.5", "F2FP.F16.F32.PACK_AB R121, R25, R24"
    assert wgmma_early_reads(_listing(s_gemm, *pv, wait1, read_s, wait0, read_acc, write_p)) == []
    assert wgmma_early_reads(_listing(s_gemm, *pv, wait1, read_s, read_acc, wait0)) == [read_acc]
    assert wgmma_early_reads(_listing(s_gemm, *pv, wait1, write_p, wait0)) == [write_p]
    assert wgmma_early_reads(_listing(s_gemm, *pv, read_s, wait0)) == [read_s]


def test_the_attention_kernel_defers_its_p_v():
    """The library's FlashAttention forward takes the overlapped loop on sm_90a (``tests/test_attention_kernel``
    runs it on the emulator)."""
    from tile_ops.kernels.attention import flash_attention_forward
    from tile_ops.kernels.attention_config import default_config

    program = flash_attention_forward.fn(128, "bfloat16", cfg=default_config(128, "sm_90a"))
    src = compile_program(program, "sm_90a").source
    loop = _main_loop(src)
    assert loop.count("wgmma_commit_group") == 2 and "wait_group_sync_aligned_1()" in loop
