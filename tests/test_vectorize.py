"""16-byte vector accesses for T.Parallel without fragments, synchronous copies and fills; scalar
fallbacks where a vector could be misaligned, non-contiguous or straddle a ragged bound; and pipeline
stages read by T.Parallel and copies.  Correctness runs the lowered TIR on a CPU emulator."""

import re

import numpy as np
import pytest
import torch

import tile_ops
import tile_ops.lang as T
from tile_ops.compiler import compile_program
from tile_ops.compiler.lower import lower
from tile_ops.jit.build import _find_tool
from tile_ops.jit.emulator import Emulator

needs_sass = pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None or
                                _find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is None, reason="no nvcc/cuobjdump")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def scale(M, N, shift=0, bm=16, bn=128, dtype="float16"):
    """B = A * 2 through a shared tile: clear, T.Parallel global -> shared, copy shared -> global."""
    @T.prim_func
    def main(A: T.Tensor((M, N + shift), dtype), B: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=128) as (bx, by):
            A_s = T.alloc_shared((bm, bn), dtype)
            T.clear(A_s)
            for i, j in T.Parallel(bm, bn):
                A_s[i, j] = A[by * bm + i, bx * bn + j + shift] * 2
            T.copy(A_s, B[by * bm, bx * bn])
    return main


def emulate(prog, **arrays):
    lk = lower(prog, "sm_80")
    Emulator(lk.func, arrays).run(lk.meta.grid)


def vector_accesses(src: str, buf: str) -> set:
    """The vector types TVM accesses ``buf`` through (uint4: 8 halves, half4, half2, float4 ...)."""
    return set(re.findall(r"\*\((\w+)\*\)\(" + buf + r"_ptr", src))


@pytest.mark.parametrize("M,N", [(32, 256), (17, 136), (17, 129), (20, 60)])
def test_parallel_copy_and_clear_compute_correctly(M, N):
    A = np.random.default_rng(0).uniform(-4, 4, (M, N)).astype(np.float16)
    B = np.zeros((M, N), np.float16)
    emulate(scale(M, N), A=A, B=B)
    np.testing.assert_array_equal(B, A * np.float16(2))


def test_scalar_statements_outside_parallel_are_predicated():
    """An element assignment in a serial loop (not in T.Parallel) read and wrote past a global tensor's end
    where the last block's window is ragged; it is predicated like T.Parallel's."""
    n, per = 5, 2

    @T.prim_func
    def main(A: T.Tensor((n,), "float32"), O: T.Tensor((n,), "float32")):
        with T.Kernel(T.ceildiv(n, per), threads=32) as bx:
            for t in T.serial(per):
                O[bx * per + t] = A[bx * per + t] * 2

    A, O = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    emulate(main, A=A, O=O)  # the emulator raises on an index past the end
    np.testing.assert_array_equal(O, A * 2)


def test_accesses_before_a_tensor_read_zero_and_write_nothing():
    """Stencils and halo windows index row -1 or column -1: the predicates checked only the upper bound, so
    loads read before the tensor (and stores wrote there); the README promises every access is predicated."""
    n = 64

    @T.prim_func
    def shifted(A: T.Tensor((n, n), "float32"), B: T.Tensor((n, n), "float32"), C: T.Tensor((n, n), "float32")):
        with T.Kernel(n // 16, threads=128) as bx:
            for i, j in T.Parallel(16, n):
                B[bx * 16 + i, j] = A[bx * 16 + i - 1, j]  # down a row: whole vectors, one row predicate
                C[bx * 16 + i, j - 1] = A[bx * 16 + i, j]  # left a column: scalar, the store predicated

    A = np.random.default_rng(2).uniform(1, 2, (n, n)).astype(np.float32)
    B, C = np.zeros((n, n), np.float32), np.full((n, n), -7, np.float32)
    emulate(shifted, A=A, B=B, C=C)  # numpy would wrap a negative index around: read the last row instead
    np.testing.assert_array_equal(B, np.vstack([np.zeros((1, n), np.float32), A[:-1]]))
    np.testing.assert_array_equal(C[:, :-1], A[:, 1:])
    assert (C[:, -1] == -7).all()

    @T.prim_func
    def stencil(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
        with T.Kernel(n // 16, threads=32) as bx:
            A_s = T.alloc_shared((18,), "float32")
            T.copy(A[bx * 16 - 1], A_s)  # a halo window from one element before the block's
            for i in T.Parallel(16):
                B[bx * 16 + i] = A_s[i] + A_s[i + 1] + A_s[i + 2]

    a, b = np.arange(1, n + 1, dtype=np.float32), np.zeros(n, np.float32)
    emulate(stencil, A=a, B=b)
    padded = np.concatenate([[0], a, [0]])
    np.testing.assert_array_equal(b, padded[:-2] + padded[1:-1] + padded[2:])


def test_a_cp_async_window_before_the_tensor_copies_no_bytes_from_there():
    @T.prim_func
    def halo(A: T.Tensor((64, 64), "float16"), B: T.Tensor((64, 64), "float16")):
        with T.Kernel(4, threads=128) as bx:
            A_s = T.alloc_shared((16, 64), "float16")
            T.copy(A[bx * 16 - 1, 0], A_s)
            T.copy(A_s, B[bx * 16, 0])

    src = compile_program(halo, "sm_80").source
    assert "cp.async" in src and re.search(r"\(1 <= \(*\(*\(\(int\)blockIdx.x\) \* 16\)", src), src[-3000:]


def test_aligned_rows_use_16_byte_accesses():
    src = compile_program(scale(64, 256), "sm_80").source
    assert vector_accesses(src, "A") == {"uint4"} and vector_accesses(src, "B") == {"uint4"}
    assert "*(uint4*)(((half*)smem_ptr)" in src  # the shared stores of T.Parallel, T.clear and the copy's loads


def test_ragged_rows_of_whole_vectors_stay_vectorized():
    """N = 136 = 17 vectors: a vector is all in or all out of bounds, so one predicate guards it."""
    c = compile_program(scale(17, 136), "sm_80")
    assert vector_accesses(c.source, "A") == {"uint4"} and vector_accesses(c.source, "B") == {"uint4"}


@pytest.mark.parametrize("M,N,shift,width", [(17, 129, 0, set()),  # rows not a multiple of 2 elements
                                             (16, 130, 0, {"half2"}),  # 4-byte vectors fit 130
                                             (16, 256, 4, {"half4"}),  # start 4 elements in: 8 bytes
                                             (16, 256, 1, set())])  # start 1 element in: scalar
def test_misaligned_or_ragged_global_falls_back(M, N, shift, width):
    src = compile_program(scale(M, N, shift), "sm_80").source
    assert vector_accesses(src, "A") == width
    A = np.random.default_rng(1).uniform(-4, 4, (M, N + shift)).astype(np.float16)
    B = np.zeros((M, N), np.float16)
    emulate(scale(M, N, shift), A=A, B=B)
    np.testing.assert_array_equal(B, A[:, shift:] * np.float16(2))


def _elementwise(body, M=64, N=128, a_dtype="float16", b_dtype="float16"):
    @T.prim_func
    def main(A: T.Tensor((M, N), a_dtype), B: T.Tensor((M, N), b_dtype)):
        with T.Kernel(1, threads=128) as bx:
            body(A, B)
    return main


def test_non_contiguous_bodies_stay_scalar():
    def transposed(A, B):
        for i, j in T.Parallel(64, 64):
            B[i, j] = A[j, i]

    def call(A, B):
        for i, j in T.Parallel(64, 128):
            B[i, j] = T.exp2(A[i, j])

    for body, N in ((transposed, 64), (call, 128)):
        c = compile_program(_elementwise(body, N=N), "sm_80")
        assert not vector_accesses(c.source, "A") and not vector_accesses(c.source, "B")
    A = np.random.default_rng(2).uniform(-4, 4, (64, 64)).astype(np.float16)
    B = np.zeros((64, 64), np.float16)
    emulate(_elementwise(transposed, N=64), A=A, B=B)
    np.testing.assert_array_equal(B, A.T)


def test_casts_and_broadcasts_vectorize_at_the_wider_dtype():
    """float32 -> float16 with a per-row scalar: 4 lanes (16 bytes of float32, 8 of float16)."""
    def body(A, B):
        for i, j in T.Parallel(64, 128):
            B[i, j] = T.cast(A[i, j] * T.cast(i, "float32") + 1.0, "float16")

    prog = _elementwise(body, a_dtype="float32")
    src = compile_program(prog, "sm_80").source
    assert vector_accesses(src, "A") == {"float4"} and vector_accesses(src, "B") == {"half4"}
    A = np.random.default_rng(3).uniform(-4, 4, (64, 128)).astype(np.float32)
    B = np.zeros((64, 128), np.float16)
    emulate(prog, A=A, B=B)
    np.testing.assert_array_equal(B, (A * np.arange(64, dtype=np.float32)[:, None] + 1).astype(np.float16))


@needs_sass
def test_float32_math_on_halves_takes_vectors_of_4():
    """float16 tensors, float32 arithmetic: float32x8 has no CUDA vector type, so 4 lanes (8-byte accesses)."""
    def body(A, B):
        for i, j in T.Parallel(64, 128):
            B[i, j] = T.cast(T.cast(A[i, j], "float32") * 3.0, "float16")

    k = tile_ops.compile(_elementwise(body), target="sm_80")
    assert vector_accesses(k.source, "A") == {"half4"} and vector_accesses(k.source, "B") == {"half4"}
    assert re.search(r"LDG\.E\.64", k.sass()) and re.search(r"STG\.E\.64", k.sass())


def test_copies_between_any_memories_are_vectorized():
    def body(A, B):
        X_s = T.alloc_shared((64, 128), "float16")
        Y_s = T.alloc_shared((64, 128), "float16")
        T.copy(A, B)  # global -> global
        T.copy(A, X_s)  # global -> shared (cp.async)
        T.copy(X_s, Y_s)  # shared -> shared
        T.copy(Y_s[0:32, 0:128], B[32, 0])  # shared -> global

    prog = _elementwise(body)
    c = compile_program(prog, "sm_80")
    assert vector_accesses(c.source, "A") == {"uint4"} and vector_accesses(c.source, "B") == {"uint4"}
    assert not re.search(r"\n\s*\(\(half\*\)smem_ptr\)\[", c.source)  # no scalar shared store


def test_pipelined_parallel_and_copy_read_the_stage_being_computed():
    """A float32 -> float16 copy into a 2-stage tile is synchronous, so the emulator can run the pipeline;
    T.Parallel (vector and scalar) and T.copy must read stage k % 2, not stage 0."""
    K, N = 128, 64

    @T.prim_func
    def main(A: T.Tensor((K, N), "float32"), B: T.Tensor((K, N), "float16"), C: T.Tensor((K, N), "float16"),
             D: T.Tensor((N, K), "float16")):
        with T.Kernel(1, threads=128) as bx:
            A_s = T.alloc_shared((16, N), "float16")
            for k in T.Pipelined(K // 16, num_stages=2):
                T.copy(A[k * 16, 0], A_s)
                for i, j in T.Parallel(16, N):
                    B[k * 16 + i, j] = A_s[i, j] + 1
                for i, j in T.Parallel(16, N):
                    D[j, k * 16 + i] = A_s[i, j]  # transposed: the scalar path
                T.copy(A_s, C[k * 16, 0])

    c = compile_program(main, "sm_80")
    assert "cp.async.wait_group" in c.source and c.meta.smem_bytes == 2 * 16 * N * 2
    A = np.random.default_rng(4).uniform(-4, 4, (K, N)).astype(np.float32)
    B, C, D = (np.zeros(s, np.float16) for s in ((K, N), (K, N), (N, K)))
    emulate(main, A=A, B=B, C=C, D=D)
    A16 = A.astype(np.float16)
    np.testing.assert_array_equal(B, A16 + np.float16(1))
    np.testing.assert_array_equal(C, A16)
    np.testing.assert_array_equal(D, A16.T)


@needs_sass
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_sass_has_128_bit_global_and_shared_accesses(arch):
    sass = tile_ops.compile(scale(256, 256), target=arch).sass()
    for op in (r"LDG\.E\.128", r"STG\.E\.128", r"STS\.128", r"LDS\.128"):
        assert re.search(op, sass), op
    assert not re.search(r"\b(LDG|STG)\.E\.U16\b|\bSTS\.U16\b|\bLDS\.U16\b", sass)  # no 2-byte accesses left


# ----------------------------------------------------------------------------- on the GPU

GPU_TARGETS = ["sm_90a", "sm_90"] if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) \
    else [None]


def _run(prog, target, *tensors):
    tile_ops.compile(prog, target=target).launch(*tensors)
    torch.cuda.synchronize()


def _nan(*shape, dtype=torch.float16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("M,N,shift", [(64, 256, 0), (17, 136, 0), (17, 129, 0), (20, 60, 0), (33, 256, 4)])
def test_vectorized_parallel_clear_and_copy_on_the_gpu(M, N, shift, target):
    A = torch.randn(M, N + shift, dtype=torch.float16, device="cuda")
    B = _nan(M, N)
    _run(scale(M, N, shift), target, A, B)
    assert torch.equal(B, A[:, shift:] * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", GPU_TARGETS)
def test_vectorized_casts_copies_and_pipelined_stages_on_the_gpu(target):
    def cast_body(A, B):
        for i, j in T.Parallel(64, 128):
            B[i, j] = T.cast(A[i, j] * T.cast(i, "float32") + 1.0, "float16")

    A = torch.randn(64, 128, device="cuda")
    B = _nan(64, 128)
    _run(_elementwise(cast_body, a_dtype="float32"), target, A, B)
    rows = torch.arange(64, device="cuda", dtype=torch.float32)[:, None]
    # nvcc contracts A * i + 1 into one FFMA (rounded once); torch rounds the product and the sum apart, and
    # the two differ in the last float32 bit often enough to flip a float16 now and then. A * i + 1 is exact
    # in float64 (53 bits reach from 1 down to the last bit of any product over 2^-29), so rounding it to float32
    # gives the FFMA's result.
    assert torch.equal(B, (A.double() * rows.double() + 1).float().half())

    def copy_body(A, B):
        X_s = T.alloc_shared((64, 128), "float16")
        Y_s = T.alloc_shared((64, 128), "float16")
        T.copy(A, B)
        T.copy(A, X_s)
        T.copy(X_s, Y_s)
        T.copy(Y_s[0:32, 0:128], B[32, 0])

    A = torch.randn(64, 128, dtype=torch.float16, device="cuda")
    B = _nan(64, 128)
    _run(_elementwise(copy_body), target, A, B)
    assert torch.equal(B, torch.cat([A[:32], A[:32]]))


def test_indices_non_negative_by_form():
    """What spares an index its `>= 0` predicate: sums and products of variables (all indices) and non-negative
    constants, floormod by a positive divisor, selects of two such, the grid size and warp-uniform copies."""
    from tvm import tirx
    from tvm.script import tirx as TS

    from tile_ops.compiler.exprs import nonneg

    x, y = tirx.Var("x", "int32"), tirx.Var("y", "int32")
    grid = TS.cuda.func_call("tile_ops_grid_x", source_code="", return_type="int32")
    uniform = lambda e: TS.cuda.func_call("tile_ops_warp_uniform", e, source_code="", return_type="int32")  # noqa: E731
    for e in (x * 16 + y + 7, tirx.floordiv(x, 4), tirx.floormod(x - 5, 8), tirx.max(x - 1, 0), x + y * grid,
              tirx.if_then_else(x < 3, 0, y), uniform(tirx.floordiv(x, 128))):
        assert nonneg(e), e
    for e in (x - 1, x * 16 + y - 1, tirx.const(-1, "int32") + x, tirx.if_then_else(x < 3, x - 1, y),
              uniform(x - 1), tirx.min(x - 1, y)):
        assert not nonneg(e), e
