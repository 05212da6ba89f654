"""Issue 45, item 2: a fragment or local array read before anything writes it holds whatever its registers held
(NaN on the emulator): the compiler refuses the read at the user's line (compiler/definite.py), and accepts
every program that writes before it reads."""

import pytest

import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.definite import check_written_before_read
from tile_ops.lang.errors import TileLangError

M = N = K = 64
BK = 32


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def check(prog) -> None:
    check_written_before_read(prog.kernel, prog.buffers)


def refused(prog) -> str:
    with pytest.raises(TileLangError) as e:
        check(prog)
    return str(e.value)


def matmul(clear: bool, clear_accum: bool = False, copy_out_first: bool = False):
    @T.prim_func
    def main(A: T.Tensor((M, K), "float16"), B: T.Tensor((K, N), "float16"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as bx:
            A_s = T.alloc_shared((M, BK), "float16")
            B_s = T.alloc_shared((BK, N), "float16")
            acc = T.alloc_fragment((M, N), "float32")
            if clear:
                T.clear(acc)
            if copy_out_first:
                T.copy(acc, C)
            for k in T.Pipelined(K // BK, num_stages=2):
                T.copy(A[0, k * BK], A_s)
                T.copy(B[k * BK, 0], B_s)
                T.gemm(A_s, B_s, acc, clear_accum=clear_accum)
            T.copy(acc, C)
    return main


def test_a_gemm_accumulating_into_an_uncleared_fragment_is_refused_at_its_line():
    msg = refused(matmul(clear=False))
    assert "test_definite_writes.py:" in msg and "T.gemm(A_s, B_s, acc, clear_accum=clear_accum)" in msg
    assert "fragment acc is read here before anything writes it" in msg
    assert "T.clear(acc)" in msg and "T.gemm(..., clear_accum=True)" in msg


def test_the_compiler_refuses_it():
    with pytest.raises(TileLangError, match="fragment acc is read here before anything writes it"):
        compile_program(matmul(clear=False), "sm_80")
    with pytest.raises(TileLangError, match="fragment acc is read here before anything writes it"):
        compile_program(matmul(clear=False), "sm_90a")


def test_a_copy_out_before_the_gemm_is_refused():
    msg = refused(matmul(clear=False, clear_accum=True, copy_out_first=True))
    assert "fragment acc is read here before anything writes it" in msg and "T.copy(acc, C)" in msg


@pytest.mark.parametrize("clear, clear_accum", [(True, False), (False, True), (True, True)])
def test_a_cleared_accumulator_compiles(clear, clear_accum):
    """Cleared before the loop, or by the gemm itself; what the loop writes is read after it."""
    check(matmul(clear=clear, clear_accum=clear_accum))
    compile_program(matmul(clear=clear, clear_accum=clear_accum), "sm_80")


def online_max(init: bool):
    """m, the running row max, read (kept as the previous max) before the loop's T.reduce_max updates it."""
    @T.prim_func
    def main(X: T.Tensor((4 * M, N), "float32"), Y: T.Tensor((M,), "float32")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_fragment((M, N), "float32")
            m = T.alloc_fragment((M,), "float32")
            prev = T.alloc_fragment((M,), "float32")
            if init:
                T.fill(m, -T.infinity("float32"))
            for t in T.serial(4):
                T.copy(X[t * M, 0], S)
                T.copy(m, prev)
                T.reduce_max(S, m, dim=1, clear=False)
            T.copy(m, Y)
    return main


def test_a_loop_carried_statistic_written_only_inside_the_loop_is_refused():
    msg = refused(online_max(init=False))
    assert "T.copy(m, prev)" in msg
    assert "fragment m is read here on the first iteration of the loop, before line" in msg
    assert "T.clear(m) or T.fill(m, value)" in msg


def test_a_loop_carried_statistic_filled_before_the_loop_compiles():
    check(online_max(init=True))


def reduce_into(clear: bool):
    @T.prim_func
    def main(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M,), "float32")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_fragment((M, N), "float32")
            m = T.alloc_fragment((M,), "float32")
            T.copy(X, S)
            T.reduce_sum(S, m, dim=1, clear=clear)
            T.copy(m, Y)
    return main


def test_a_reduce_combining_into_an_unwritten_fragment_is_refused():
    msg = refused(reduce_into(clear=False))
    assert "fragment m is read here before anything writes it" in msg and "clear=True" in msg
    check(reduce_into(clear=True))


def parallel_rows(write_first: bool):
    """A row fragment written per row in one T.Parallel (a partial write, as a write), read in the next."""
    @T.prim_func
    def main(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_fragment((M, N), "float32")
            r = T.alloc_fragment((M,), "float32")
            T.copy(X, S)
            if write_first:
                for i in T.Parallel(M):
                    r[i] = S[i, 0]
            for i, j in T.Parallel(M, N):
                S[i, j] = S[i, j] - r[i]
            T.copy(S, Y)
    return main


def test_a_load_in_t_parallel_of_an_unwritten_fragment_is_refused():
    msg = refused(parallel_rows(write_first=False))
    assert "fragment r is read here before anything writes it" in msg and "S[i, j] = S[i, j] - r[i]" in msg
    check(parallel_rows(write_first=True))


def local_sum(init: bool):
    @T.prim_func
    def main(X: T.Tensor((M,), "float32"), Y: T.Tensor((1,), "float32")):
        with T.Kernel(1, threads=128) as bx:
            total = T.alloc_local((1,), "float32")
            if init:
                total[0] = 0.0
            for i in T.serial(M):
                total[0] = total[0] + X[i]
            Y[0] = total[0]
    return main


def test_a_local_array_read_before_its_first_write_is_refused():
    msg = refused(local_sum(init=False))
    assert "local array total is read here before anything writes it" in msg and "before the loop" in msg
    check(local_sum(init=True))


def deferred_pv():
    """FlashAttention's shape: the deferred P V reads P, which the body writes after the block's place (the
    block runs at the end of the iteration)."""
    @T.prim_func
    def main(Q: T.Tensor((M, 64), "float16"), Kt: T.Tensor((4 * N, 64), "float16"),
             V: T.Tensor((4 * N, 64), "float16"), O: T.Tensor((M, 64), "float32")):
        with T.Kernel(1, threads=128) as bx:
            Q_s = T.alloc_shared((M, 64), "float16")
            K_s = T.alloc_shared((N, 64), "float16")
            V_s = T.alloc_shared((N, 64), "float16")
            S = T.alloc_fragment((M, N), "float32")
            P = T.alloc_fragment((M, N), "float16")
            acc = T.alloc_fragment((M, 64), "float32")
            T.copy(Q, Q_s)
            T.clear(acc)
            for t in T.Pipelined(4, num_stages=2):
                T.copy(Kt[t * N, 0], K_s)
                T.copy(V[t * N, 0], V_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True, policy="full_row")
                with T.deferred():
                    T.gemm(P, V_s, acc, policy="full_row")
                T.copy(S, P)
            T.copy(acc, O)
    return main


def test_a_deferred_block_runs_at_the_end_of_its_iteration():
    check(deferred_pv())


def deferred_write_read_before():
    """A deferred block writing what a statement before it reads: on the first iteration that read comes first."""
    @T.prim_func
    def main(X: T.Tensor((4 * M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_fragment((M, N), "float32")
            keep = T.alloc_fragment((M, N), "float32")
            for t in T.Pipelined(4, num_stages=2):
                T.copy(keep, Y)
                with T.deferred():
                    T.copy(X[t * M, 0], keep)
                T.copy(X[t * M, 0], S)
    return main


def test_a_read_before_the_deferred_block_that_writes_it_is_refused():
    msg = refused(deferred_write_read_before())
    assert "fragment keep is read here on the first iteration of the loop" in msg and "T.copy(keep, Y)" in msg


def test_a_loop_of_no_iterations_reads_nothing():
    """T.serial(0) around a gemm that only lays its accumulator out (tests/test_fragments_emulated.py)."""
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as bx:
            A_s = T.alloc_shared((M, 16), "float16")
            B_s = T.alloc_shared((16, N), "float16")
            acc = T.alloc_fragment((M, N), "float32")
            for _ in T.serial(0):
                T.gemm(A_s, B_s, acc)
            T.copy(A, acc)
            T.copy(acc, C)

    check(main)

