"""The compiler down to CUDA source, cubin and SASS, on the CPU (no GPU needed)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import tile_ops
import tile_ops.lang as T
from programs import matmul
from tile_ops.compiler import compile_program
from tile_ops.jit.build import _find_tool
from tile_ops.kernels.gemm import gemm
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_launch import build_gemm
from tile_ops.kernels.gemm_softmax import gemm_softmax
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig
from tile_ops.kernels.gemm_softmax_defaults import default_config as gemm_softmax_config

needs_nvcc = pytest.mark.skipif(_find_tool("nvcc", "TILE_OPS_NVCC") is None, reason="nvcc not installed")
needs_cuobjdump = pytest.mark.skipif(_find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP") is None, reason="no cuobjdump")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def test_matmul_lowers_to_cp_async_ldmatrix_mma():
    c = compile_program(matmul.fn(1024, 1024, 1024), "sm_80")
    src = c.source
    for needle in ("cp.async.cg.shared.global", "cp.async.wait_group", "ldmatrix.sync.aligned.m8n8.x4",
                   "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "extern __shared__"):
        assert needle in src, needle
    assert c.meta.kept == ["A", "B", "C"] and c.meta.grid == (8, 8, 1) and c.meta.block == (128, 1, 1)
    assert c.meta.smem_bytes == 3 * (128 * 32 + 32 * 128) * 2  # three stages of A and B tiles
    assert c.meta.layouts["C_f"].startswith("fragment mma") and "swizzled" in c.meta.layouts["A_s"]


def test_shared_tiles_are_swizzled_conflict_free():
    from tile_ops.compiler.layout import SharedLayout

    for cols in (32, 64, 128, 256):  # fp16 rows of 64 B .. 512 B
        lay = SharedLayout(64, cols, 16)
        for chunk in range(cols // 8):
            for r0 in range(0, 64, 8):  # 8 rows read at one 16-byte column: 8 distinct bank groups
                groups = {(lay.offset(r0 + r, chunk * 8) * 2 // 16) % 8 for r in range(8)}
                assert len(groups) == 8, (cols, chunk, r0)
        offsets = {lay.offset(i, j) for i in range(64) for j in range(cols)}
        assert offsets == set(range(64 * cols))  # a permutation: nothing overlaps


def test_bf16_and_transposes_and_ragged_shapes_lower():
    c = compile_program(matmul.fn(127, 255, 129, dtype="bfloat16", transpose_A=True, transpose_B=True,
                                  out_dtype="float32"), "sm_80")
    assert "m16n8k16.row.col.f32.bf16.bf16.f32" in c.source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in c.source  # A^T tile
    assert "float* __restrict__ C_ptr" in c.source


def test_gemm_softmax_uses_fragment_reductions():
    c = compile_program(gemm_softmax.fn(512, 1024, 256, 0.5), "sm_80")
    assert "__shfl_xor_sync" in c.source and "exp2" in c.source
    assert c.meta.layouts["m"].startswith("fragment mma_row")


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])  # sm_90 without the "a": the Ampere-class path on Hopper
def test_cubins_contain_the_intended_instructions(arch):
    k = matmul(512, 512, 512, target=arch)
    mix = k.instruction_mix()
    assert mix.get("HMMA", 0) >= 64 and mix.get("LDSM", 0) > 0 and mix.get("LDGSTS", 0) > 0
    assert mix.get("HGMMA", 0) == 0 and k.meta.resources["spill_stores"] == 0
    ks = gemm_softmax(256, 512, 128, 0.5, target=arch)
    mix = ks.instruction_mix()
    assert mix.get("HMMA", 0) > 0 and mix.get("SHFL", 0) > 0 and mix.get("LDGSTS", 0) > 0


@needs_nvcc
def test_library_gemm_batched_bias_builds():
    k = gemm(200, 136, 72, 3, 3, 1, False, True, True, "float16", "float32", GemmConfig(64, 128, 32, 2, 128, 0),
             target="sm_90a")
    assert k.meta.kept == ["A_tmap", "B_tmap", "Bias", "C"] and k.meta.grid == (2, 4, 3)
    assert k.meta.block == (256, 1, 1)  # 128 consumers + the TMA producer warpgroup


# ----------------------------------------------------------------------------- errors name the user's line


def _lower_error(fn):
    with pytest.raises(tile_ops.lang.TileLangError) as e:
        compile_program(fn(), "sm_80")
    return str(e.value)


def test_error_unsupported_dtype_names_line():
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((64, 64), "float32"), C: T.Tensor((64, 64), "float32")):
            with T.Kernel(1, threads=128) as bx:
                A_s = T.alloc_shared((64, 64), "float32")
                C_f = T.alloc_fragment((64, 64), "float32")
                T.copy(A[0, 0], A_s)
                T.gemm(A_s, A_s, C_f)  # float32 operands: mma.sync takes fp16/bf16
                T.copy(C_f, C[0, 0])
        return bad

    msg = _lower_error(prog)
    assert "test_compiler.py" in msg and "T.gemm(A_s, A_s, C_f)" in msg and "float16 or bfloat16" in msg


def test_error_untileable_shape():
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((24, 32), "float16"), B: T.Tensor((32, 24), "float16"), C: T.Tensor((24, 24), "float16")):
            with T.Kernel(1, threads=128) as bx:
                A_s = T.alloc_shared((24, 32), "float16")
                B_s = T.alloc_shared((32, 24), "float16")
                C_f = T.alloc_fragment((24, 24), "float32")
                T.gemm(A_s, B_s, C_f)
        return bad

    msg = _lower_error(prog)
    assert "T.gemm(A_s, B_s, C_f)" in msg and "cannot be tiled by 4 warps" in msg


def test_error_fragment_used_inconsistently():
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((64, 64), "float16"), C: T.Tensor((64, 64), "float16")):
            with T.Kernel(1, threads=128) as bx:
                A_s = T.alloc_shared((64, 64), "float16")
                C1 = T.alloc_fragment((64, 64), "float32")
                C2 = T.alloc_fragment((64, 64), "float32")
                T.gemm(A_s, A_s, C1)
                T.gemm(A_s, A_s, C2, policy="full_row")
                for i, j in T.Parallel(64, 64):
                    C1[i, j] = C1[i, j] + C2[i, j]
        return bad

    msg = _lower_error(prog)
    assert "different layouts" in msg and "T.Parallel" in msg


def test_error_reduce_of_a_fragment_no_gemm_laid_out():
    """A row reduction needs the accumulator layout; a fragment only copied from memory gets a blocked
    one, which was neither refused at the reduction (an AttributeError in lowering) nor named there."""
    def prog(rows):
        @T.prim_func
        def bad(A: T.Tensor((rows, 64), "float32"), O: T.Tensor((rows,), "float32")):
            with T.Kernel(1, threads=128) as bx:
                F = T.alloc_fragment((rows, 64), "float32")
                r = T.alloc_fragment((rows,), "float32")
                T.copy(A[0, 0], F)
                T.reduce_max(F, r, dim=1)
                T.copy(r, O[0])
        return bad

    for rows in (64, 128):  # r: one value a thread or none
        msg = _lower_error(lambda: prog(rows))
        assert "T.reduce_max(F, r, dim=1)" in msg and "gemm accumulator layout" in msg


def test_error_copy_region_past_a_shared_tile():
    """Only global accesses are predicated: a window past a shared tile's end wrote other tiles' bytes."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((32, 32), "float32"), C: T.Tensor((32, 32), "float32")):
            with T.Kernel(1, threads=128) as bx:
                S1 = T.alloc_shared((32, 32), "float32")
                S2 = T.alloc_shared((32, 32), "float32")
                T.copy(A[0, 0], S1)
                T.copy(S1, S2[16, 0])
                T.copy(S2, C[0, 0])
        return bad

    msg = _lower_error(prog)
    assert "T.copy(S1, S2[16, 0])" in msg and "S2[32, 32]" in msg and "16:48" in msg


def test_error_copy_from_a_start_point_of_too_few_dims():
    """A 1-D start point into a 4x16 tile dropped the column index: element (i, j) read A[i]."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((64,), "float32"), B: T.Tensor((4, 16), "float16")):
            with T.Kernel(1, threads=32) as bx:
                T.copy(A[0], B)
        return bad

    msg = _lower_error(prog)
    assert "T.copy(A[0], B)" in msg and "A[64] has 1 dim(s), too few for the 4x16 region" in msg


@pytest.mark.parametrize("policy, regions, message", [
    ("evict_sometimes", lambda A, S, C: (A[0, 0], S),
     r"eviction_policy='evict_sometimes'; accepted: None, 'evict_first', 'evict_last'"),
    ("evict_first", lambda A, S, C: (S, C[0, 0]),
     r"eviction_policy applies to a copy from global into shared memory, got shared -> global")])
def test_error_copy_eviction_policy(policy, regions, message):
    """An L2 priority is a property of global reads: a misspelt one, or one on a store, is refused by name."""
    with pytest.raises(tile_ops.lang.TileLangError, match=message):
        @T.prim_func
        def bad(A: T.Tensor((64, 64), "float16"), C: T.Tensor((64, 64), "float16")):
            with T.Kernel(1, threads=128) as bx:
                S = T.alloc_shared((64, 64), "float16")
                T.copy(*regions(A, S, C), eviction_policy=policy)


def test_error_shared_tile_of_three_dims():
    """A 3-D shared tile was addressed by its first index alone (2048 elements on 2 addresses)."""
    with pytest.raises(tile_ops.lang.TileLangError, match=r"T.alloc_shared\(\(2, 16, 64\)\): shared tiles are 1-D "
                                                          r"or 2-D; fold the leading dims into the rows, e.g. \(32, 64\)"):
        @T.prim_func
        def bad(A: T.Tensor((32, 64), "float32")):
            with T.Kernel(1, threads=32) as bx:
                T.alloc_shared((2, 16, 64), "float32")


def test_error_a_pipelined_tile_used_after_its_loop():
    """Outside the loop the tile resolved to stage 0: with an even trip count the last tile read was n-2's."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((64, 64), "float16"), Last: T.Tensor((16, 64), "float16")):
            with T.Kernel(1, threads=128) as bx:
                A_s = T.alloc_shared((16, 64), "float16")
                C_f = T.alloc_fragment((16, 64), "float32")
                for k in T.Pipelined(4, num_stages=2):
                    T.copy(A[k * 16, 0], A_s)
                    T.copy(A_s, C_f)
                T.copy(A_s, Last)
        return bad

    msg = _lower_error(prog)
    assert "T.copy(A_s, Last)" in msg and "A_s is filled by a T.Pipelined loop (2 stages" in msg


def test_error_parallel_index_past_a_shared_tile():
    """T.copy refused a window past a shared tile; a T.Parallel past it overwrote the next tile unchecked."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((64, 64), "float32"), C: T.Tensor((32, 64), "float32")):
            with T.Kernel(1, threads=128) as bx:
                S = T.alloc_shared((32, 64), "float32")
                for i, j in T.Parallel(64, 64):
                    S[i, j] = A[i, j]
                for i, j in T.Parallel(32, 64):
                    C[i, j] = S[i + 1, j]
        return bad

    msg = _lower_error(prog)
    assert "S[i, j] = A[i, j]" in msg and "S[32, 64]: T.Parallel(64, 64) indexes dim 0 from 0 to 63, outside 0..31" in msg


def test_error_parallel_read_past_a_shared_tile_by_an_offset():
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((32, 64), "float32"), C: T.Tensor((32, 64), "float32")):
            with T.Kernel(1, threads=128) as bx:
                S = T.alloc_shared((32, 64), "float32")
                T.copy(A, S)
                for i, j in T.Parallel(32, 64):
                    C[i, j] = S[i + 1, j]
        return bad

    assert "indexes dim 0 from 1 to 32, outside 0..31" in _lower_error(prog)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_8_bit_fills_and_scalar_arithmetic_build(dtype):
    """16 lanes of a broadcast 8-bit scalar became make_int4 of 16 arguments, which nvcc refused."""
    if _find_tool("nvcc", "TILE_OPS_NVCC") is None:
        pytest.skip("no nvcc")

    @T.prim_func
    def main(A: T.Tensor((64, 128), dtype), B: T.Tensor((64, 128), dtype), C: T.Tensor((64, 128), dtype)):
        with T.Kernel(1, threads=128) as bx:
            S = T.alloc_shared((64, 128), dtype)
            T.clear(S)
            T.copy(S, C)
            for i, j in T.Parallel(64, 128):
                B[i, j] = A[i, j] + T.cast(1, dtype)

    assert tile_ops.compile(main, target="sm_80").cubin


@pytest.mark.parametrize("body, message", [
    ("T.clear(S[0:32, :])", r"T.clear takes whole buffers, got a region of \w+; accepted: a buffer from T.alloc_\*"),
    ("T.reduce_max(S[0:32, :], m)", r"T.reduce_max takes whole buffers, got a region of \w+"),
    ("for i in T.Parallel(bx + 1):\n                    m[i] = 0.0",
     r"T.Parallel extent bx \+ 1 depends on values known only when the kernel runs; accepted: a compile-time integer"),
    ("for i in T.unroll(bx + 1):\n                    m[i] = 0.0", r"T.unroll extent bx \+ 1 depends on values known"),
])
def test_errors_for_regions_and_runtime_extents_name_the_line(body, message):
    """Each raised a bare TypeError, AttributeError or TVM InternalError before."""
    src = textwrap.dedent(f'''
        import tile_ops.lang as T
        from tile_ops.compiler import compile_program
        @T.prim_func
        def f(A: T.Tensor((64, 64), "float32")):
            with T.Kernel(4, threads=128) as bx:
                S = T.alloc_fragment((64, 64), "float32")
                m = T.alloc_fragment((64,), "float32")
                {body}
        compile_program(f, "sm_80")
    ''')
    with pytest.raises(tile_ops.lang.TileLangError, match=message) as e:
        exec(compile(src, "user_kernel.py", "exec"), {})
    assert "user_kernel.py:9: " in str(e.value)


def test_error_float_grid_extent():
    with pytest.raises(tile_ops.lang.TileLangError, match=r"T.Kernel grid extent 6.4 is not an integer \(// divides"):
        @T.prim_func
        def bad(A: T.Tensor((64,), "float32")):
            with T.Kernel(64 / 10, threads=32) as bx:
                A[bx] = 1.0


@pytest.mark.parametrize("cond", ["bx == 0", "bx != 0", "bx < 1"])
def test_error_python_if_on_a_traced_value(cond):
    """TVM answers bool() of == and != by object identity (bx == 0 is False: one branch traced for every
    block, silently) and of other expressions with a bare ValueError; both are refused at the user's line."""
    src = textwrap.dedent(f'''
        import tile_ops.lang as T
        @T.prim_func
        def f(A: T.Tensor((64,), "float32")):
            with T.Kernel(2, threads=32) as bx:
                if {cond}:
                    A[bx] = 1.0
    ''')
    with pytest.raises(tile_ops.lang.TileLangError) as e:
        exec(compile(src, "user_kernel.py", "exec"), {})
    assert f"user_kernel.py:6: " in str(e.value) and "T.if_then_else" in str(e.value)


def test_error_copy_with_a_local_buffer():
    """A copy is spread over the block's threads, and a local buffer is each thread's own array: thread t
    filled element t of its copy (none for t >= 4 here) and read the others uninitialized."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((4,), "float32"), O: T.Tensor((128,), "float32")):
            with T.Kernel(1, threads=128) as bx:
                L = T.alloc_local((4,), "float32")
                T.copy(A[0:4], L)
                for i in T.Parallel(128):
                    O[i] = L[i % 4]
        return bad

    msg = _lower_error(prog)
    assert "T.copy(A[0:4], L)" in msg and "local" in msg and "T.fill" in msg


def test_error_string_annotations_explained():
    src = textwrap.dedent('''
        from __future__ import annotations
        import tile_ops.lang as T
        @T.prim_func
        def f(A: T.Tensor((16,), "float16")):
            pass
    ''')
    with pytest.raises(tile_ops.lang.TileLangError, match="from __future__ import annotations"):
        exec(compile(src, "user_kernel.py", "exec"), {})


# ----------------------------------------------------------------------------- cache hit without TVM


@needs_nvcc
def test_second_process_hits_cache_without_importing_tvm(tmp_path):
    env = dict(os.environ, TILE_OPS_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=os.path.dirname(__file__))
    script = textwrap.dedent('''
        import sys, time
        t = time.perf_counter()
        from programs import matmul
        k = matmul(256, 256, 256, target="sm_90a")
        print("tvm" in sys.modules, len(k.cubin) > 0, round(time.perf_counter() - t, 3))
    ''')
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split()[:2] == ["True", "True"]  # cold: traced and lowered with TVM
    assert second.stdout.split()[:2] == ["False", "True"]  # warm: straight from the disk cache


@needs_nvcc
def test_concurrent_processes_compile_a_key_once(tmp_path):
    env = dict(os.environ, TILE_OPS_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=os.path.dirname(__file__))
    script = textwrap.dedent('''
        import sys
        from programs import matmul
        k = matmul(384, 256, 128, target="sm_80")
        print("built" if "tvm" in sys.modules else "loaded", len(k.cubin) > 0)
    ''')
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = sorted(p.communicate()[0].strip() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert outs == ["built True", "loaded True", "loaded True"]  # one compile; the others waited and loaded
    from tile_ops.jit.cache import DiskCache

    assert DiskCache(tmp_path / "c").info()["entries"] == 1


# ----------------------------------------------------------------------------- the Hopper path (sm_90a)


def _swizzled_byte(offset_bytes: int, swizzle_bytes: int) -> int:
    """CUTLASS's Swizzle<B, 4, 3> on a byte offset: the 16-byte chunk XOR the 128-byte row bits."""
    mask = swizzle_bytes // 16 - 1
    return offset_bytes ^ (((offset_bytes >> 7) & mask) << 4)


@pytest.mark.parametrize("rows,cols", [(128, 64), (64, 32), (32, 16), (64, 256), (64, 96)])
def test_shared_layout_is_the_tma_box_swizzle(rows, cols):
    """Each panel is one TMA box written with CU_TENSOR_MAP_SWIZZLE_<panel row bytes>."""
    from tile_ops.compiler.layout import SharedLayout

    lay = SharedLayout(rows, cols, 16)
    row_bytes = lay.panel * 2
    assert lay.swizzle_bytes == row_bytes and cols % lay.panel == 0
    for i in range(rows):
        for j in range(cols):
            p, jj = divmod(j, lay.panel)
            box_byte = _swizzled_byte(i * row_bytes + jj * 2, row_bytes)
            assert lay.offset(i, j) * 2 == p * rows * row_bytes + box_byte, (i, j)


def _decode_descriptor(d: int) -> dict:
    return dict(start=(d & 0x3FFF) << 4, lbo=((d >> 16) & 0x3FFF) << 4, sbo=((d >> 32) & 0x3FFF) << 4,
                mode=d >> 62)


def test_wgmma_descriptors_follow_the_canonical_layouts():
    """K-major: 8-row groups 8 * 128 B apart; MN-major: also 8-k groups apart, panels LBO apart."""
    import re

    c = compile_program(matmul.fn(1024, 1024, 1024, block_M=128, block_N=256, block_K=64, threads=256,
                                  num_stages=4), "sm_90a")
    consts = {int(x) for x in re.findall(r"(\d{15,})ULL", c.source)}
    fields = sorted((d["lbo"], d["sbo"], d["mode"]) for d in map(_decode_descriptor, consts))
    # A (128 x 64, K-major): LBO unused (16), SBO 1024, 128B swizzle; B (64 x 256, N-major): 4 panels of
    # 64 x 64 (LBO = 64 rows * 128 B), SBO 1024
    assert fields == [(16, 1024, 1), (64 * 128, 1024, 1)], fields


def _hopper_gemm(M, N, K, **kw):
    return matmul(M, N, K, target="sm_90a", **kw)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("kw", [
    dict(),  # the 20-line program unchanged: block_K=32 -> 64-byte swizzle, one consumer warpgroup
    dict(block_M=128, block_N=256, block_K=64, num_stages=4, threads=256),
    dict(block_K=64, num_stages=4, transpose_A=True),
    dict(block_K=64, num_stages=4, transpose_B=True, dtype="bfloat16"),
])
def test_hopper_gemm_is_tma_wgmma_warp_specialized(kw):
    k = _hopper_gemm(1024, 1024, 1024, **kw)
    mix = k.instruction_mix()
    assert mix.get("HGMMA", 0) > 0 and mix.get("UTMALDG", 0) > 0 and mix.get("SYNCS", 0) > 0, mix
    assert mix.get("HMMA", 0) == 0 and mix.get("LDGSTS", 0) == 0
    assert k.meta.block[0] == kw.get("threads", 128) + 128
    assert k.meta.kept[:2] == ["A_tmap", "B_tmap"] and k.meta.resources["spill_stores"] == 0
    if kw.get("threads", 128) == 256:
        assert mix.get("USETMAXREG", 0) == 2  # producer gives registers to the two consumer warpgroups
    tm = k.meta.tensormaps["A_tmap"]
    assert tm["tensor"] == "A" and tm["dims"] == [1024, 1024] and tm["strides"] == [2048]


@needs_nvcc
@pytest.mark.parametrize("M, N, K, promotion", [(1024, 1024, 1024, {"A": 3, "B": 3}), (1000, 1000, 1000, {"A": 2, "B": 2}),
                                               (1000, 1024, 1000, {"A": 2, "B": 3}), (1024, 1000, 4096, {"A": 3, "B": 2})])
def test_tensor_maps_fill_l2_by_128_bytes_where_rows_are_not_128_byte_aligned(M, N, K, promotion):
    """A box row of a 2000-byte-row tensor straddles two L2 lines: 128-byte L2 fills (2) there (256-byte ones
    cost the 1000^3 default 4-9 %), 256-byte (3) where rows are aligned."""
    k = _hopper_gemm(M, N, K, block_M=128, block_N=128, block_K=64, num_stages=4)
    assert {t["tensor"]: t["l2_promotion"] for t in k.meta.tensormaps.values()} == promotion


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("stages, per_sm", [(3, 2), (4, 1)])
def test_hopper_one_warpgroup_pipeline_runs_two_ctas_per_sm_when_shared_memory_fits_twice(stages, per_sm):
    """128x128x64 tiles: 3 stages (96 KiB) fit twice in an SM's 228 KiB, 4 stages (128 KiB) do not.  Two
    resident CTAs cap registers at 128 per thread and move the producer's to the consumers (setmaxnreg)."""
    k = _hopper_gemm(4096, 4096, 4096, block_M=128, block_N=128, block_K=64, num_stages=stages)
    mix = k.instruction_mix()
    bounds = "__launch_bounds__(256, 2)" if per_sm == 2 else "__launch_bounds__(256)"
    assert bounds in k.source
    assert k.meta.grid == (132 * per_sm, 1, 1)  # persistent: one CTA per resident slot walks the 1024 tiles
    assert mix.get("USETMAXREG", 0) == (2 if per_sm == 2 else 0), mix
    assert k.meta.resources["spill_stores"] == 0 and k.meta.resources["spill_loads"] == 0
    if per_sm == 2:
        assert k.meta.resources["registers"] <= 128 and "setmaxnreg.inc.sync.aligned.u32 216" in k.source


@needs_nvcc
@needs_cuobjdump
def test_hopper_falls_back_where_tma_cannot_go():
    """Rows of 129 halves are not 16-byte aligned: no tensor map, synchronous copies, still wgmma."""
    k = _hopper_gemm(127, 255, 129, block_K=64)
    mix = k.instruction_mix()
    assert mix.get("HGMMA", 0) > 0 and mix.get("UTMALDG", 0) == 0 and not k.meta.tensormaps
    assert k.meta.block == (128, 1, 1)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("target", ["sm_90a", "sm_90"])
def test_sm90a_kernels_wait_for_their_predecessor_and_the_later_steps_launch_programmatically(target):
    """On sm_90a every kernel starts with griddepcontrol.wait (SASS ACQBULK), then lets its successor launch
    (PREEXIT); a split-K decode's reduction is launched with programmatic stream serialization, so it starts
    while the partial kernel runs and waits at its entry.  The sm_90 path has neither."""
    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_launch import build_gemm

    k = build_gemm(16, 2048, 8192, 1, 1, 1, False, False, False, "float16", "float16",
                   default_config(16, 2048, 8192, "sm_90a"), target=target)  # 32 tiles of 64 columns: split
    hopper = target == "sm_90a"
    for part in (k.partial, k.reduce):
        mix = part.instruction_mix()
        assert part.meta.waits_at_entry == hopper
        assert (mix.get("ACQBULK", 0) == 1 and mix.get("PREEXIT", 0) == 1) == hopper, mix
    assert not k.partial._fn().programmatic and k.reduce._fn().programmatic == hopper
    assert k.reduce.dependent() is k.reduce and k.partial.dependent().programmatic == hopper


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (2048, 2048, 2048), (1000, 1000, 1000), (16, 8192, 8192),
                                   (704, 704, 4096), (1024, 1024, 1024), (1536, 2048, 2048), (1152, 2048, 2048)])
def test_library_gemm_default_configs_on_hopper_have_no_spills(shape):
    """The configs the ops launch by default on sm_90a: TMA + wgmma + mbarriers in SASS, no register spills."""
    from tile_ops.kernels.gemm_defaults import default_config

    cfg = default_config(*shape, "sm_90a")
    M, N, K = shape
    k = gemm(M, N, K, 1, 1, 1, False, False, True, "float16", "float16", cfg, target="sm_90a")
    mix = k.instruction_mix()
    assert mix.get("HGMMA", 0) > 0 and mix.get("UTMALDG", 0) > 0 and mix.get("SYNCS", 0) > 0, (cfg, mix)
    assert k.meta.resources["spill_stores"] == 0 and k.meta.resources["spill_loads"] == 0, (cfg, k.meta.resources)


def _listing(*instructions):
    """A cuobjdump-style SASS listing of ``instructions``."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(instructions))


def test_wgmma_early_reads_flags_accumulators_read_before_the_final_wait():
    """What ptxas (CUDA 13.0) made of the swapped 2x4 gemm's epilogue at 1001x1001x512: the fp16 packs of the
    m64n72 accumulators (R24-R59) above the wait that retires the last k-step's wgmmas. After it, or
    registers outside the accumulators, are fine."""
    from tile_ops.jit.build import wgmma_early_reads

    loop = ["HGMMA.64x72x16.F32 R24, gdesc[UR12].tnspA, R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
            "@!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R21+UR8], RZ", "@P1 BRA 0x790"]
    pack, other = "F2FP.F16.F32.PACK_AB R2, R59, R58", "IMAD.SHL.U32 R23, R0, 0x80, RZ"
    wait = "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert wgmma_early_reads(_listing(*loop, other, pack, wait)) == [pack]
    assert wgmma_early_reads(_listing(*loop, other, wait, pack)) == []
    assert wgmma_early_reads(_listing(*loop, "MOV R60, R61", wait)) == []  # past m64n72's 36 registers


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("M, N, K, has_bias", [(1001, 1001, 512, False), (650, 1500, 1000, False),
                                               (1001, 1001, 2048, True), (1000, 1000, 4000, False),
                                               (16, 8192, 8192, False), (4096, 4096, 4096, False)])
def test_library_hopper_gemms_read_accumulators_only_after_the_final_wait(M, N, K, has_bias):
    """The default configs, with the operands padded as the op pads them, build (the build refuses a kernel
    with early reads) and no SASS instruction touches a wgmma accumulator before the wait that retires it.
    ptxas hoisted the swapped 2x4 kernel's output packs above that wait when the consumer loop was unrolled
    twice (its C rows not 16-byte multiples, so stored by threads): a quarter of the norm wrong on the GPU,
    never in the emulator. The loop is not unrolled now."""
    from tile_ops.jit.build import wgmma_early_reads
    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_launch import padded_cols

    cfg = default_config(M, N, K, "sm_90a")
    cols = padded_cols(M, N, K, target="sm_90a")
    k = gemm(M, N, K, 1, 1, 1, False, False, has_bias, "float16", "float16", cfg, **cols, target="sm_90a")
    assert wgmma_early_reads(k.sass()) == [], cfg


@needs_nvcc
@needs_cuobjdump
def test_a_kernel_reading_accumulators_before_the_wait_is_refused(monkeypatch):
    """The consumer loop unrolled again (as before commit 70acbc1): ptxas hoists the epilogue's reads above the
    final wait, and the build refuses the kernel, with what it found, rather than run it wrong."""
    from tile_ops.compiler.schedules import warp_specialized
    from tile_ops.kernels.gemm_defaults import SM90A

    serial = warp_specialized.T.serial
    monkeypatch.setattr(warp_specialized.T, "serial", lambda *args, unroll=None, **kw: serial(*args, **kw))
    with pytest.raises(RuntimeError, match=r"read wgmma accumulators before the wgmma.wait_group .*F2FP"):
        gemm(1001, 1001, 1024, 1, 1, 1, False, False, False, "float16", "float16", SM90A.swapped_2x4, b_cols=1008,
             target="sm_90a")


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("shape", [(8192, 2048, 1024), (1000, 1000, 1000)])
def test_gemm_softmax_reads_accumulators_only_after_the_wait(shape):
    """The fused kernel reads each score tile's accumulators inside its walk: after each tile's wait."""
    from tile_ops.jit.build import wgmma_early_reads

    k = gemm_softmax(*shape, 1.0, "float16", "float16", gemm_softmax_config(*shape, "sm_90a"), target="sm_90a")
    assert wgmma_early_reads(k.sass()) == []


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("M, N, K, out_dtype, panels", [(4096, 4096, 4096, "float16", 2), (1000, 1000, 1000, "float32", 4)])
def test_shared_epilogue_is_a_tma_store_on_hopper(M, N, K, out_dtype, panels):
    """GemmConfig(epilogue="shared"): C_f -> shared tile -> TMA store, one box per 128-byte panel (TMA clips
    the ragged edge); no global store instructions are left."""
    from tile_ops.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(128, 128, 64, 2, 128, 8, epilogue="shared")
    k = gemm(M, N, K, 1, 1, 1, False, False, True, "float16", out_dtype, cfg, target="sm_90a")
    mix = k.instruction_mix()
    assert mix.get("UTMASTG", 0) == panels and mix.get("STG", 0) == 0, mix
    assert "C_tmap" in k.meta.tensormaps and k.meta.resources["spill_stores"] == 0
    assert "cp.async.bulk.wait_group.read 0" in k.source


@pytest.mark.parametrize("M, N, overlaid", [(2048, 2048, True), (4096, 4096, False)])
def test_epilogue_tiles_lie_over_the_dead_stages_where_each_cta_runs_one_tile(M, N, overlaid):
    """One wave of 128x256 tiles in 4 stages (192 KiB): the bias and output tiles (64.5 KiB) lie over the
    stages, dead once the main loop ends, and the consumers' barrier before the epilogue's first shared
    write comes after their last wgmma wait.  Over more than a wave the grid is persistent (the producer
    loads the next tile's stages during the epilogue): nothing lies over them, and the output tile does
    not fit beside them, so the gemm stores directly."""
    cfg = GemmConfig(128, 256, 64, 4, 256, 0, epilogue="shared")
    c = compile_program(gemm.fn(M, N, 1024, 1, 1, 1, False, False, True, "bfloat16", "bfloat16", cfg), "sm_90a")
    stages = 4 * (128 * 64 + 64 * 256) * 2
    assert ("C_tmap" in c.meta.tensormaps) == overlaid and (c.meta.persistent_tiles == 0) == overlaid
    assert (c.meta.smem_bytes < stages + 1024) == overlaid, c.meta.smem_bytes  # else the 1 KiB bias tile after the stages
    after_loop = c.source[c.source.rindex("wait_group_sync_aligned_0();"):]
    stmts = after_loop.split(";")
    first_write = next(i for i, (lhs, eq, _) in enumerate(s.partition(" = ") for s in stmts)
                       if eq and "smem_ptr" in lhs)
    assert "bar_sync_count_sync((uint)1" in ";".join(stmts[:first_write])


def test_unaligned_rows_keep_the_epilogue_tiles_beside_the_stages():
    """Rows that are not 16-byte multiples take no TMA, so no warp-specialized pipeline and nothing lies over
    the stages: the kernels' estimates say so too, and a float32 output tile that does not fit beside the
    stages is stored directly (the GPU suite's 127x255x129 softmax to float32 needed 272 KiB of shared memory
    while its estimate counted on the overlay)."""
    cfg = GemmConfig(128, 256, 64, 3, 256, 0, epilogue="shared")
    c = compile_program(gemm.fn(2048, 2048, 1001, 1, 1, 1, False, False, False, "float16", "float32", cfg),
                        "sm_90a")
    assert "C_tmap" not in c.meta.tensormaps and c.meta.smem_bytes <= 232448
    c = compile_program(gemm_softmax.fn(127, 129, 255, 0.1, "float16", "float32",
                                        gemm_softmax_config(127, 129, 255, "sm_90a")), "sm_90a")
    assert c.meta.smem_bytes <= 232448


@needs_nvcc
def test_tma_store_is_waited_on_only_before_the_next_barrier():
    """A persistent GEMM's TMA store is not waited on where it is issued: its issuer waits until TMA has
    read the staged tile just before the next consumer barrier (after the next tile's main loop, before
    the tile is rewritten), and once more before the block exits; the tile loop ends without a barrier
    (the next tile starts with the mbarrier-guarded main loop)."""
    cfg = GemmConfig(128, 256, 64, 3, 256, 8, epilogue="shared")
    k = gemm(4096, 4096, 4096, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_90a")
    body = k.source[k.source.index("tile_iter_1"):]  # the consumers' tile loop
    issue = body.index("bulk_commit_group();")
    after_issue = body[issue:]
    assert after_issue.index("}") < after_issue.index("wait_group_read_0"), "waited on right after issuing"
    waits = [m.start() for m in re.finditer(r"wait_group_read_0\(\);", body)]
    barriers = [m.start() for m in re.finditer(r"bar_sync_count_sync", body)]
    assert len(waits) == len(barriers) + 1  # one before every consumer barrier, one at exit
    assert all(any(0 < b - w < 200 for b in barriers) for w in waits[:-1])
    assert waits[-1] > issue and "bar_sync" not in body[issue:]  # no barrier closes the tile loop


@needs_nvcc
@needs_cuobjdump
def test_shared_epilogue_on_the_ampere_path_stores_from_shared():
    from tile_ops.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(128, 128, 32, 3, 128, 8, epilogue="shared")
    k = gemm(1000, 1000, 1000, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_80")
    mix = k.instruction_mix()
    assert mix.get("UTMASTG", 0) == 0 and mix.get("STG", 0) > 0 and mix.get("HMMA", 0) > 0, mix


@pytest.mark.parametrize("M, N, threads, split_n", [(64, 256, 256, True), (128, 256, 256, True),
                                                    (64, 192, 384, True), (128, 128, 256, False)])
def test_wgmma_accumulator_layouts_cover_the_tile_once(M, N, threads, split_n):
    """Every (row, col) of the accumulator is held by exactly one (thread, register), with warpgroups
    stacked along M or splitting N; each warpgroup's 4 warps are consecutive."""
    from tile_ops.compiler.layout import MmaAccumLayout

    lay = MmaAccumLayout.for_wgmma(M, N, threads, split_n)
    held = [lay.coords(t, r) for t in range(threads) for r in range(lay.local_size)]
    assert sorted(held) == [(i, j) for i in range(M) for j in range(N)]
    for t in range(0, threads, 128):  # a warpgroup's columns are one block of N / warpgroups (or all of N)
        cols = {lay.coords(t + u, r)[1] for u in range(128) for r in range(lay.local_size)}
        width = N // (threads // 128) if split_n else N
        assert cols == set(range(min(cols), min(cols) + width))


@needs_nvcc
@needs_cuobjdump
def test_full_col_policy_splits_wgmma_along_n_between_warpgroups():
    """64-row tiles with two consumer warpgroups: each issues m64n128 on its half of N (the fused softmax's
    two-warpgroup config), the row reductions combine the halves through shared memory; N blocks that
    would start inside a B swizzle panel keep warpgroups along M (or fall back to mma.sync).  The default
    policy splits N too where M is too short to stack the warpgroups."""
    import re

    from tile_ops.kernels.gemm_softmax import gemm_softmax
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", SoftmaxConfig(64, 256, 64, 3, 256, "full_col"),
                     target="sm_90a")
    assert set(re.findall(r"HGMMA\.\w+", k.sass())) == {"HGMMA.64x128x16"}
    assert k.meta.resources["spill_stores"] == 0
    assert k.meta.layouts["S"] == "fragment wgmma, 64 regs/thread", k.meta.layouts  # a 64 x 128 half per warpgroup
    odd = gemm(1024, 1024, 1024, 1, 1, 1, False, False, False, "float16", "float16",
               GemmConfig(64, 192, 64, 3, 256, 8, "full_col"), target="sm_90a")  # 96-column halves, 64-wide panels
    assert "HGMMA.64x96x16" not in odd.sass()
    square = gemm(1024, 1024, 1024, 1, 1, 1, False, False, False, "float16", "float16",
                  GemmConfig(64, 128, 64, 3, 256, 8), target="sm_90a")  # the default policy: too short to stack
    assert set(re.findall(r"H\w*MMA\.\w+", square.sass())) == {"HGMMA.64x64x16"}



@needs_nvcc
@needs_cuobjdump
def test_gemm_softmax_parts_for_attribution():
    """gemm_softmax(parts=...): "no_rescale" drops the final pass (fewer exponentials), "gemm" the softmax
    math too (no exponentials, no row statistics); "all" is the op's kernel. Anything else is refused."""
    from tile_ops.kernels.gemm_softmax import gemm_softmax
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(64, 128, 64, 4, 128)
    mufu = {parts: gemm_softmax(1024, 512, 256, 0.125, "float16", "float16", cfg, parts=parts,
                                target="sm_90a").instruction_mix().get("MUFU", 0)
            for parts in ("all", "no_rescale", "gemm")}
    assert mufu["all"] > mufu["no_rescale"] > 0 and mufu["gemm"] == 0, mufu
    with pytest.raises(ValueError, match="parts='some', accepted: all, no_rescale, gemm"):
        gemm_softmax(1024, 512, 256, 0.125, "float16", "float16", cfg, parts="some", target="sm_90a")


# ----------------------------------------------------------------------------- thread-block clusters


def _row_max_over_cluster(cluster=2, grid_x=2, reduce=True):
    """Each block of a cluster takes a row max of its 64-column slice of X, combined over the cluster."""
    @T.prim_func
    def row_max(X: T.Tensor((128, 64 * grid_x), "float16"), Y: T.Tensor((128, 64 * grid_x), "float16")):
        with T.Kernel(grid_x, threads=128, cluster=cluster) as bx:
            X_s = T.alloc_shared((64, 64), "float16")
            S = T.alloc_fragment((64, 64), "float32")
            m = T.alloc_fragment((64,), "float32")
            T.clear(S)
            T.copy(X[0, bx * 64], X_s)
            T.gemm(X_s, X_s, S)
            T.reduce_max(S, m, dim=1)
            if reduce:
                T.cluster_allreduce(m, "max")
            for r, c in T.Parallel(64, 64):
                S[r, c] = S[r, c] - m[r]
            T.copy(S, Y[0, bx * 64])
    return row_max


@needs_nvcc
@needs_cuobjdump
def test_clustered_softmax_is_one_pass_over_a_cluster():
    """8192x2048 rows split over clusters of 8 blocks with one 128x256 tile each: __cluster_dims__, a
    persistent grid of 16 whole clusters (128 SMs), the row max and sum exchanged through the peers'
    shared memory on mbarriers (the producer runs ahead into the next tile), the output stored once by TMA."""
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8)  # (the default is deferred=True since v10)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert "__cluster_dims__(8, 1, 1)" in k.source and "mapa.shared::cluster" in k.source
    assert k.meta.grid == (128, 1, 1) and k.meta.resources["spill_stores"] == 0
    # one exchange of (max, sum) pairs: st.async into each peer, counted on its mbarrier; no remote arrives
    assert _cluster_puts(k.source) == [2] * (2 * 8) and "mbarrier.arrive.release.cluster" not in k.source
    assert "mbarrier.try_wait.parity.acquire.cluster" in k.source
    mix = k.instruction_mix()
    assert mix["STAS"] == 2 * 8, mix  # 2 rows per owner lane x 8 peers
    # only at entry (consumers and the producer wait): peers have started before anything reaches them
    assert mix["UCGABAR_ARV"] == 1 and mix["UCGABAR_WAIT"] == 2, mix
    # A's tile is the same in every block of the cluster: each loads 16 of its 128 rows into all 8
    assert k.meta.tensormaps["A_tmap"]["box"] == [64, 16] and k.meta.tensormaps["B_tmap"]["box"] == [64, 64]
    assert "bytes.multicast::cluster" in k.source
    assert mix["UTMASTG"] == 4 and mix["HGMMA"] > 0  # one TMA store per 64-column panel, no rescale pass
    # a thread's 128 scores: exp2(s * c - max) is one FFMA and one MUFU.EX2 each (the ftz form: no
    # subnormal fix-up compares), the scale folded in rather than a multiply of its own
    assert mix["MUFU"] >= 128 and mix["FFMA"] >= 128 and mix.get("FSETP", 0) < 64, mix


@needs_nvcc
@pytest.mark.parametrize("persistent", [False, True])
def test_two_dimensional_cluster_multicasts_a_along_n_and_b_along_m(persistent):
    """A 4x2 cluster of 128x128 tiles (4 M tiles x 2 N tiles): B's tile is loaded in 4 slices of 16 rows,
    each multicast to the blocks of its cluster row (same N tile), A's in 2 slices of 64 rows to its
    column (same M tile); a consumer releases a stage on the 4 + 2 - 1 blocks that write into it.
    One wave (1000^3) launches the hardware's 4x2 clusters; more tiles walk a 1-D grid of whole clusters."""
    M = N = 1000 if not persistent else 4096
    cfg = GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", cluster=4, cluster_n=2)
    k = gemm(M, N, 1000, cfg=cfg, target="sm_90a")
    assert k.meta.tensormaps["A_tmap"]["box"] == [64, 64, 1] and k.meta.tensormaps["B_tmap"]["box"] == [64, 16, 1]
    dims = "(8, 1, 1)" if persistent else "(4, 2, 1)"
    assert f"__cluster_dims__{dims}" in k.source and k.meta.grid == ((128, 1, 1) if persistent else (8, 8, 1))
    masks = re.findall(r"bytes_multicast__cluster\(.*\(\(ushort\)\((\d+) << ([^;]*)\);", k.source)
    assert sorted({m[0] for m in masks}) == ["15", "17"], masks  # a row of 4 ranks; a column: ranks r, r + 4
    # a stage's release: lanes 0-4 of each consumer warp arrive at once, each on one of the 5 blocks that
    # write into the stage (its cluster row and column), mapped once before the loop; in the loop and after it
    assert len(re.findall(r"tile_ops_peer_address\(\(&", k.source)) == 1
    releases = re.findall(r"tile_ops_cluster_arrive_if\(\(peer_empty \+ [^;]*& 31\) < 5\)\)\);", k.source)
    assert len(releases) == 2, releases
    assert k.meta.resources["spill_stores"] == 0
    with pytest.raises(ValueError, match=r"cluster_n=2 must divide the 5 column tiles of N=640"):
        gemm(1024, 640, 256, cfg=cfg, target="sm_90a")
    with pytest.raises(ValueError, match=r"a cluster of at most 8 blocks in all"):
        GemmConfig(cluster=4, cluster_n=4)


def _column_multicast(steps):
    """A 2x2 grid in one (1, 2) cluster: A's window does not depend on by, so its column may share it."""
    @T.prim_func
    def column(A: T.Tensor((128, 1024), "float16"), C: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, 2, threads=128, cluster=(1, 2)) as (bx, by):
            A_s = T.alloc_shared((64, 64), "float16")
            S = T.alloc_fragment((64, 64), "float32")
            T.clear(S)
            for k in T.Pipelined(steps(by), num_stages=2):
                T.copy(A[bx * 64, k * 64], A_s)
                T.gemm(A_s, A_s, S, transpose_B=True)
            T.copy(S, C[bx * 64, by * 64])
    return column


@needs_nvcc
def test_multicast_needs_lockstep_pipelines_along_its_axis():
    """Blocks that share a multicast stage must take the same number of steps: a trip count that depends on
    by keeps the column's loads apart (else one block waits for releases its peer never makes)."""
    same = compile_program(_column_multicast(lambda by: 4), "sm_90a")
    assert "multicast::cluster" in same.source and "__cluster_dims__(1, 2, 1)" in same.source
    apart = compile_program(_column_multicast(lambda by: by * 4 + 4), "sm_90a")
    assert "multicast::cluster" not in apart.source and "tile_ops_cluster_arrive_if((" not in apart.source


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("scale, N", [(-0.5, 256), (0.0, 1000), (1e-46, 1000), (0.125, 1000)])
def test_softmax_scale_folds_into_exp2_only_when_it_commutes_with_max(scale, N):
    """c * max(s) == max(c * s) only for c > 0 in float32: a negative, zero, or float32-zero (1e-46 * log2 e)
    scale multiplies the scores before the row max (folding it into exp2 would take a max where a min is
    meant, or make a masked column's -inf * 0 a NaN: N = 1000 has masked columns); a positive one is
    folded into exp2's argument."""
    k = gemm_softmax(256, N, 64, scale, "float16", "float16", target="sm_90a")
    args = re.findall(r"tile_ops_exp2\(\(([^;]*?)\)\);", k.source)
    assert args, k.source[-3000:]
    folded = [a for a in args if a.startswith("(S_ptr[")]
    assert len(folded) == len(args) if scale == 0.125 else not folded, args[:4]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("scale, literal", [(3e38, "0x1.c363ccp+127f"), (-3e38, "-0x1.c363ccp+127f"),
                                            (1e300, "CUDART_INF_F")])
def test_softmax_scale_past_float32_range_scales_the_scores(arch, scale, literal):
    """A finite scale whose scale * log2 e is past float32's range (TVM refused it as a literal) multiplies the
    scores, as the reference's float32 product does (inf past float32's own range), and log2 e goes into exp2."""
    M, N, K = 256, 1000, 64
    src = compile_program(gemm_softmax.fn(M, N, K, scale, cfg=gemm_softmax_config(M, N, K, arch)), arch).source
    assert re.search(rf"S_ptr\[0\] \* {re.escape(literal)}", src)
    scores = [a for a in re.findall(r"tile_ops_exp2\(\(([^;]*?)\)\);", src) if a.startswith("(S_ptr[")]
    assert scores and all("* 0x1.71547652b82fep+0f" in a for a in scores), scores[:4]


def _cluster_puts(source):
    """The values each tile_ops_cluster_put call sends (1, or 2 for a pair), call by call."""
    calls = re.findall(r"tile_ops_cluster_put\(\(&[^;]*\(uint\)\d+, ([^;]*)\);", source)
    return [v.count(",") + 1 for v in calls]


@needs_nvcc
def test_cluster_allreduce_owner_threads_write_each_row_once():
    """One lane per quad (the quad shares a row) stores the row's value into slot rank of every peer;
    one thread expects all of the cluster's bytes (2 blocks x 64 rows x 4 bytes) on its barrier."""
    c = compile_program(_row_max_over_cluster(), "sm_90a")
    assert _cluster_puts(c.source) == [1] * (2 * 2), c.source  # 2 rows x 2 peers, one value each
    assert "__cluster_dims__(2, 1, 1)" in c.source and "% 4) == 0) {" in c.source
    assert re.search(r"expect_tx_shared__cta_b64\(.*\(uint\)512\);", c.source), c.source


@needs_nvcc
def test_a_cluster_allreduce_of_two_fragments_is_one_exchange_of_pairs():
    """(max, sum) pairs travel together (st.async.v2 into slot rank of every peer, 8-byte slots), and the
    merge rescales each block's sum to the cluster max, skipping blocks whose max is -inf."""
    from programs import softmax_stats_over_cluster

    k = softmax_stats_over_cluster(150, target="sm_90a")
    assert _cluster_puts(k.source) == [2] * (2 * 4)  # 2 rows x 4 peers, a (max, sum) pair each
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32" in k.source
    assert re.search(r"expect_tx_shared__cta_b64\(.*\(uint\)2048\);", k.source)  # 4 blocks x 64 rows x 8 B
    assert "== -CUDART_INF_F) ? 0x0p+0f" in k.source  # a block whose max is -inf adds 0, not NaN
    mix = k.instruction_mix()
    assert mix["STAS"] == 2 * 4 and mix["UCGABAR_ARV"] == 1 and k.meta.resources["spill_stores"] == 0, mix


def _row_split_over_a_cluster(N):
    """128x256 tiles, a row split over the widest cluster (the default before deferred stores, v10)."""
    from dataclasses import replace

    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig, _widest_split

    tiles = SoftmaxConfig(128, 256, 64, 3, 256, "full_row")
    return replace(tiles, split=_widest_split(N, tiles))


@needs_nvcc
@pytest.mark.parametrize("N, split", [(640, 3), (2304, 5), (3072, 6)])
def test_persistent_clustered_grid_is_whole_clusters(N, split):
    """Rows of 3, 5 or 6 tiles split over clusters of that size: the persistent grid (before the
    launcher asks the driver) is a multiple of the cluster, so a cluster's blocks walk the same tiles."""
    cfg = _row_split_over_a_cluster(N)
    assert cfg.split == split
    k = gemm_softmax(8192, N, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert k.meta.persistent_tiles == 64 * split and k.meta.grid[0] % split == 0 and k.meta.grid[0] <= 132
    assert f"__cluster_dims__({split}, 1, 1)" in k.source


def test_cluster_errors_say_what_is_accepted():
    from tile_ops.kernels.gemm_softmax import merge_row_statistics

    with pytest.raises(tile_ops.lang.TileLangError, match="sm_90a"):
        compile_program(_row_max_over_cluster(), "sm_80")
    with pytest.raises(tile_ops.lang.TileLangError, match=r"cluster=3: n or \(cx, cy\) blocks, at most 8 .*"
                                                          r"each dividing its grid extent \(grid \[4, 1\]\)"):
        _row_max_over_cluster(cluster=3, grid_x=4)
    with pytest.raises(tile_ops.lang.TileLangError, match=r"cluster=\(4, 4\): .*at most 8 in all"):
        _row_max_over_cluster(cluster=(4, 4), grid_x=4)
    with pytest.raises(tile_ops.lang.TileLangError, match=r"needs a kernel clustered along x"):
        _row_max_over_cluster(cluster=1, grid_x=2)

    def in_a_loop():
        @T.prim_func
        def exchange_per_step(X: T.Tensor((64, 128), "float32")):
            with T.Kernel(2, threads=128, cluster=2) as bx:
                m = T.alloc_fragment((64,), "float32")
                for i in T.serial(2):
                    T.cluster_allreduce(m, "max")
        return exchange_per_step

    with pytest.raises(tile_ops.lang.TileLangError, match=r"top level, not inside a loop"):
        in_a_loop()

    def merge(shape_l=(64,), cluster=2, l_scope="fragment", op=merge_row_statistics, same=False):
        @T.prim_func
        def merge_stats(X: T.Tensor((64, 128), "float32")):
            with T.Kernel(2, threads=128, cluster=cluster) as bx:
                m = T.alloc_fragment((64,), "float32")
                l = T.alloc_fragment(shape_l, "float32") if l_scope == "fragment" else T.alloc_shared(shape_l, "float32")
                T.cluster_allreduce((m, m if same else l), op)
        return merge_stats

    with pytest.raises(tile_ops.lang.TileLangError, match=r"m\[64\], l\[32\]: the fragments must have one shape"):
        merge(shape_l=(32,))
    with pytest.raises(tile_ops.lang.TileLangError, match=r"T.cluster_allreduce: l must be a whole float32 fragment"):
        merge(l_scope="shared")
    with pytest.raises(tile_ops.lang.TileLangError, match=r"T.cluster_allreduce needs a kernel clustered along x"):
        merge(cluster=1)
    with pytest.raises(tile_ops.lang.TileLangError, match="a fragment is given twice"):
        merge(same=True)
    with pytest.raises(tile_ops.lang.TileLangError, match=r"op='max'; accepted: 'max' or 'sum' \(of one fragment\)"):
        merge(op="max")
    with pytest.raises(tile_ops.lang.TileLangError, match=r"combine returned 1 value\(s\) for 2 buffer\(s\)"):
        merge(op=lambda blocks: blocks[0][0])
    with pytest.raises(tile_ops.lang.TileLangError, match=r"op=3; accepted"):
        merge(op=3)
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    with pytest.raises(ValueError, match=r"split=9: must be in \[1, 8\]"):
        SoftmaxConfig(split=9)
    with pytest.raises(ValueError, match="split=4 leaves the last block of a row without columns .*split=3 fits"):
        gemm_softmax(1000, 1100, 200, 0.125, "float16", "float16",
                     SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=4), target="sm_90a")


@needs_nvcc
def test_non_persistent_kernel_keeps_a_block_per_tile():
    """T.Kernel(..., persistent=False): 64 row blocks x 8 blocks a row launch as they are, no tile loop."""
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8, persistent=False)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert k.meta.grid == (8, 64, 1) and k.meta.persistent_tiles == 0 and "tile_ops_grid_x" not in k.source


# ----------------------------------------------------------------------------- ping-pong consumer warpgroups


@needs_nvcc
def test_pingpong_runs_two_consumer_warpgroups_on_alternate_tiles():
    """T.Kernel(threads=128, pingpong=True): 2 x 128 consumer threads + the producer warpgroup; warpgroup
    w takes the CTA's tiles w, w + 2, ... and starts its pipeline count one tile in (the stages are
    consumed in the producer's order); its epilogue tile and named barrier are its own; registers move
    to the consumers (setmaxnreg), nothing spills."""
    from tile_ops.kernels.gemm import gemm
    from tile_ops.kernels.gemm_config import GemmConfig

    plain = gemm(4096, 4096, 4096, 1, 1, 1, False, False, False, "float16", "float16",
                 GemmConfig(64, 256, 64, 4, 128, 8, epilogue="shared"), target="sm_90a")
    k = gemm(4096, 4096, 4096, 1, 1, 1, False, False, False, "float16", "float16",
             GemmConfig(64, 256, 64, 4, 128, 8, epilogue="shared", pingpong=True), target="sm_90a")
    assert k.meta.block == (384, 1, 1) and k.meta.grid == (132, 1, 1) and k.meta.persistent_tiles == 64 * 16
    src = k.source
    # w = tid / 128 broadcast from lane 0 (warp-uniform for nvcc: the wgmma descriptors stay uniform)
    assert "int warpgroup = tile_ops_warp_uniform((((int)threadIdx.x) >> 7));" in src
    assert "(((tile_iter_1 * 2) + warpgroup) * tile_ops_grid_x())" in src  # tile (2 it + w) of the CTA's
    assert "pipeline_step_ptr_1[0] = (warpgroup * 64);" in src  # K = 4096: 64 steps a tile
    assert "bar_sync_count_sync(((uint)(warpgroup + 1)), (uint)128)" in src
    assert "setmaxnreg.inc.sync.aligned.u32 232" in src
    # main loops in turns: w waits on barrier 3 + w (from its second tile of the CTA's on), then frees 4 - w
    assert "if (0 < ((tile_iter_1 * 2) + warpgroup)) {" in src
    assert "bar_sync_count_sync(((uint)3 + ((uint)warpgroup)), (uint)256)" in src
    assert "bar_arrive_arrive(((uint)3 + ((uint)1 - ((uint)warpgroup))), (uint)256)" in src
    c_tile = 64 * 256 * 2
    assert k.meta.smem_bytes - plain.meta.smem_bytes == c_tile  # a second epilogue tile, the stages shared
    assert k.meta.resources["spill_stores"] == 0 and k.instruction_mix()["HGMMA"] > 0
    # the main loop reads its descriptors from uniform registers: no R2UR between the wgmmas
    sass = k.sass().splitlines()
    loop = sass[next(i for i, ln in enumerate(sass) if "TRYWAIT" in ln):]
    loop = loop[: next(i for i, ln in enumerate(loop) if "DEPBAR.LE gsb0, 0x0" in ln)]
    # one k-step (4 k16 of m64n256): the consumer loop is not unrolled (see wgmma_early_reads)
    assert sum("HGMMA" in ln for ln in loop) == 4 and not any("R2UR" in ln for ln in loop)


@needs_nvcc
def test_cooperative_consumers_read_their_wgmma_descriptors_from_uniform_registers():
    """Two consumer warpgroups on one tile (the 128x256 default): the warpgroup index that places A's
    descriptor is bound from lane 0, so nvcc keeps the descriptors uniform; read as threadIdx.x >> 7 in the
    loop it cost 8 R2UR moves between the HGMMAs of a k-step (+0.5 % at the H200's power cap without them)."""
    from tile_ops.kernels.gemm_defaults import default_config
    from tile_ops.kernels.gemm_launch import build_gemm

    cfg = default_config(4096, 4096, 4096, "sm_90a")
    assert cfg.threads == 256 and not cfg.pingpong
    k = build_gemm(4096, 4096, 4096, cfg=cfg, target="sm_90a")
    assert "int wgmma_warpgroup = tile_ops_warp_uniform((((int)threadIdx.x) >> 7));" in k.source
    sass = k.sass().splitlines()
    loop = sass[next(i for i, ln in enumerate(sass) if "TRYWAIT" in ln):]
    loop = loop[: next(i for i, ln in enumerate(loop) if _branches_back(ln)) + 1]  # the k-step, to its back edge
    assert sum("HGMMA" in ln for ln in loop) == 4 and not any("R2UR" in ln for ln in loop)  # 4 k16 of m64n256


def _branches_back(sass_line: str) -> bool:
    m = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA (0x[0-9a-f]+)", sass_line)
    return m is not None and int(m.group(2), 16) < int(m.group(1), 16)


@needs_nvcc
def test_pingpong_softmax_exchanges_per_warpgroup():
    """The clustered softmax with ping-pong: each warpgroup has its own exchange slots and mbarriers (two
    parities each), so its peers' bytes land in its copy; one thread per warpgroup expects them."""
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(64, 256, 64, 3, 128, "full_row", split=8, pingpong=True)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert k.meta.block == (384, 1, 1) and k.meta.resources["spill_stores"] == 0
    # barrier of (warpgroup, parity of the warpgroup's exchanges)
    assert "((warpgroup * 2) + (exchanges_ptr[0] & 1)) + 25606)" in k.source
    inits = re.findall(r"mbarrier_init_init_shared__cta_b64\(.*\[(\d+)\]\)\)\), \(uint\)(\d+)\);", k.source)
    # 3 stages: full (1 arrival), empty (4 warps x 8 blocks); then 2 warpgroups x 2 parities, one arrival each
    assert sorted((int(i), int(n)) for i, n in inits) == (
        [(25600 + s, 1) for s in range(3)] + [(25603 + s, 32) for s in range(3)] + [(25606 + e, 1) for e in range(4)])
    fp32 = gemm_softmax(4096, 1024, 512, 0.125, "float16", "float32",
                        SoftmaxConfig(64, 256, 64, 3, 128, "full_row", split=4, pingpong=True), target="sm_90a")
    assert fp32.meta.smem_bytes <= 227 * 1024  # the fp32 tile per warpgroup does not fit: stored directly


def test_pingpong_errors_say_what_is_accepted():
    from tile_ops.kernels.gemm import gemm
    from tile_ops.kernels.gemm_config import GemmConfig

    def prog(threads=128, persistent=True):
        @T.prim_func
        def k(X: T.Tensor((64, 64), "float32")):
            with T.Kernel(2, threads=threads, persistent=persistent, pingpong=True) as bx:
                T.alloc_fragment((64,), "float32")
        return k

    with pytest.raises(tile_ops.lang.TileLangError, match=r"needs threads=128 \(got 256\) and persistent=True"):
        prog(threads=256)
    with pytest.raises(tile_ops.lang.TileLangError, match=r"\(got False\)"):
        prog(persistent=False)
    with pytest.raises(tile_ops.lang.TileLangError, match="the same number of pipeline steps in every tile"):
        gemm(1000, 1000, 1000, 1, 1, 1, False, False, False, "float16", "float16",
             GemmConfig(128, 128, 64, 4, 128, 8, split_k=2, pingpong=True), target="sm_90a")
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    with pytest.raises(ValueError, match=r"pingpong needs one column tile per block \(N=4096 gives 2 of 256"):
        gemm_softmax(8192, 4096, 1024, 0.125, "float16", "float16",
                     SoftmaxConfig(64, 256, 64, 3, 128, "full_row", split=8, pingpong=True), target="sm_90a")

    def walk_pingpong():  # the main loop inside a loop over column tiles
        @T.prim_func
        def walk(A: T.Tensor((4096, 256), "float16"), B: T.Tensor((256, 512), "float16"),
                 C: T.Tensor((4096, 512), "float16")):
            with T.Kernel(64, threads=128, pingpong=True) as bx:
                A_s = T.alloc_shared((64, 64), "float16")
                B_s = T.alloc_shared((64, 128), "float16")
                S = T.alloc_fragment((64, 128), "float32")
                for j in T.serial(4):
                    T.clear(S)
                    for k in T.Pipelined(4, num_stages=3):
                        T.copy(A[bx * 64, k * 64], A_s)
                        T.copy(B[k * 64, j * 128], B_s)
                        T.gemm(A_s, B_s, S)
                    T.copy(S, C[bx * 64, j * 128])
        return walk

    with pytest.raises(tile_ops.lang.TileLangError, match="T.Pipelined loop at the kernel's top level"):
        compile_program(walk_pingpong(), "sm_90a")


@needs_nvcc
@pytest.mark.parametrize("N", [2304, 2312, 2560])
def test_ragged_softmax_walk_does_not_spill(N):
    """Rows split over 5 blocks that each walk two 256-wide tiles, the last block's second tile partly or
    wholly past N: the column mask must not cost spills."""
    cfg = _row_split_over_a_cluster(N)
    k = gemm_softmax(8192, N, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert cfg.split == 5 and k.meta.resources["spill_stores"] == 0, k.meta.resources


# ----------------------------------------------------------------------------- synchronization of re-reads


def _stage_and_scale(n_tiles=3):
    """A serial loop over column tiles: each loaded into shared memory and stored back (two tile ops on
    one shared tile), then a pass re-reading the block's own output in another thread mapping."""
    @T.prim_func
    def stage_and_scale(X: T.Tensor((64, 64 * n_tiles), "float16"), Y: T.Tensor((64, 64 * n_tiles), "float16")):
        with T.Kernel(1, threads=128) as bx:
            X_s = T.alloc_shared((64, 64), "float16")
            F = T.alloc_fragment((64, 64), "float32")
            for j in T.serial(n_tiles):
                T.copy(X[0, j * 64], X_s)
                T.copy(X_s, Y[0, j * 64])
            T.clear(F)
            T.copy(F, Y[0, 0])  # fragment layout: each thread writes 4-byte pieces of many rows
            for r, c in T.Parallel(64, 64):  # row-major vectors: other threads' pieces
                Y[r, c] = Y[r, c] + 1.0
    return stage_and_scale


def test_serial_loop_of_shared_tile_ops_syncs_at_its_back_edge():
    """An iteration's load into X_s must not overwrite the tile the previous iteration is still storing
    from it: the loop body ends with a barrier."""
    src = compile_program(_stage_and_scale(), "sm_80").source
    loop = src[src.index("for (int i = 0; i < 3; ++i) {"):]
    body = loop[:loop.index("\n  }\n")]
    assert body.rstrip().endswith("tvm_builtin_cuda_cta_sync();"), body[-300:]


def test_global_tile_written_then_read_by_other_threads_is_behind_a_barrier():
    """The fragment store and the row-major pass touch the same elements from different threads: a block
    barrier orders the first's global writes before the second's reads."""
    src = compile_program(_stage_and_scale(), "sm_80").source
    first_reread = src.index("= *(half4*)(Y_ptr")
    last_store = src.rindex("*(half4*)(Y_ptr", 0, first_reread)  # the fragment's, before the pass
    assert "tvm_builtin_cuda_cta_sync();" in src[last_store:first_reread]


@needs_nvcc
def test_softmax_walk_stages_every_tile_and_rescales_after_the_stores_landed():
    """Rows walked by pairs of blocks, four 128x256 tiles each: every tile leaves through the shared tile
    and TMA (no 4-byte fragment stores to global), the last one only once normalized (its first store is
    moved past column N); the rescale pass reads the output only after the issuer waited for the stores'
    writes (not only their reads of shared memory) and the async proxy's writes were fenced, and reads it
    as whole vectors, all loads of a tile in flight before its stores."""
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=2)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    src = k.source
    assert "*(half2*)(Out_ptr" not in src  # no 4-byte fragment stores to global
    assert len(re.findall(r"cp_async_bulk_tensor_s2g\w*\(\(\(void", src)) == 2 * 4  # in the walk, the last tile; 4 panels
    wait = src.index("cp_async_bulk_wait_group_async_bulk_wait_group_0();")
    fence = src.index("fence_proxy_proxy_async_global();")
    first_reread = src.index("= *(half4*)(Out_ptr")
    assert wait < fence < first_reread
    memory = [ln.split()[1] if ln.split()[0].startswith("@") else ln.split()[0]
              for ln in (line.split(";")[0].split("*/")[-1].strip() for line in k.sass().splitlines())
              if re.match(r"(@!?U?P\d )?(LDG|STG)", ln)]
    longest = max(len(run) for run in re.findall(r"(?:LDG\S* )+", " ".join(memory) + " "))
    assert longest // 4 >= 16, memory[-40:]  # "LDG.E.64 " runs: a tile's re-reads issued together
    assert k.meta.resources["spill_stores"] == 0


# ----------------------------------------------------------------------------- T.row_reduce_store


def test_row_reduce_store_exchanges_statistics_off_the_consumers_path():
    """A row's 128x256 tiles over the whole grid (8 per row block, 132 persistent CTAs): the consumers
    publish each tile's (max, sum) to the workspace and arrive on a barrier; the producer warpgroup's
    second warp signals them (GPU-scope fence and count on the row block's flag), waits for the row's
    other tiles, computes the row factors (the kernel's normalize_row of every tile's statistics, merged)
    into shared memory, counts itself a reader (the last resets the flag); the consumers store the previous
    tile right after the next main loop, before its softmax."""
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    src = k.source
    assert k.meta.workspace_fixed_floats == 8 * 64 * 128 * 2 and k.meta.persistent_tiles == 512
    assert k.meta.resources["spill_stores"] == 0 and k.meta.grid == (132, 1, 1)
    start = src.index("(((int)threadIdx.x) >> 5) == 9)")
    helper = src[start:src.index("setmaxnreg_inc", start)]
    for call in ("tile_ops_flag_signal(", "tile_ops_flag_wait(", "tile_ops_exp2(", "tile_ops_row_stats_read("):
        assert call in helper, call
    factors = helper[helper.index("tile_ops_flag_wait("):helper.index("tile_ops_row_stats_read(")]
    # per row (4 a lane): the own tile without values in it, and each of the row's 8 tiles, as merged
    assert factors.count("== -CUDART_INF_F) ?") == 4 * (1 + 8)
    consumer = src[src.index("pending_tile_ptr[0] = 0;"):]
    main_loop_end = consumer.index("wait_group_sync_aligned_0();")
    factors_wait = consumer.index("tvm_builtin_cuda_mbarrier_wait", main_loop_end)
    store = consumer.index("s2g", factors_wait)
    first_exp = consumer.index("tile_ops_exp2(")
    publish = consumer.index("tile_ops_workspace_ptr[", first_exp)
    assert main_loop_end < factors_wait < store < first_exp < publish
    # no barrier between the softmax and the publish (it waits for nothing); one before the stage copy
    assert "bar_sync" not in consumer[first_exp:publish]


def test_row_reduce_store_errors_say_what_is_accepted():
    from tile_ops.kernels.gemm_softmax import merge_row_statistics, normalize_row
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", deferred=True)
    with pytest.raises(ValueError, match="N and K multiples of 8"):
        gemm_softmax(1000, 1100, 200, 0.125, "float16", "float16", cfg, target="sm_90a")
    with pytest.raises(ValueError, match="deferred: one tile per block over the whole grid"):
        SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=2, deferred=True)
    with pytest.raises(tile_ops.lang.TileLangError, match="warp-specialized sm_90a path"):  # (sm_80: too big)
        gemm_softmax(1024, 512, 256, 0.125, "float16", "float16", cfg, target="sm_90")
    # a CTA holding two tiles of one row would wait on its own later tile: rows of at most 16 tiles
    with pytest.raises(ValueError, match="at most 16 tiles"):
        gemm_softmax(1024, 50304, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    from tile_ops.kernels.gemm_softmax_defaults import default_config
    from tile_ops.kernels.gemm_softmax_space import config_space

    assert not default_config(4096, 50304, 1024, "sm_90a").deferred
    assert all(-(-50304 // c.block_N) <= 16 for c in config_space(4096, 50304, 1024) if c.deferred)

    def nested():  # the previous tile is stored after a tile's one main loop: not inside another loop
        @T.prim_func
        def bad(A: T.Tensor((256, 256), "float16"), B: T.Tensor((256, 512), "float16"),
                Y: T.Tensor((256, 512), "float16")):
            with T.Kernel(2, 2, threads=256) as (bx, by):
                A_s = T.alloc_shared((128, 64), "float16")
                B_s = T.alloc_shared((64, 256), "float16")
                S = T.alloc_fragment((128, 256), "float32")
                m = T.alloc_fragment((128,), "float32")
                l = T.alloc_fragment((128,), "float32")
                P_s = T.alloc_shared((128, 256), "float16")
                T.clear(S)
                for h in T.serial(2):
                    for k in T.Pipelined(2, num_stages=2):
                        T.copy(A[by * 128, h * 128 + k * 64], A_s)
                        T.copy(B[h * 128 + k * 64, bx * 256], B_s)
                        T.gemm(A_s, B_s, S, policy="full_row")
                T.reduce_max(S, m, dim=1)
                T.reduce_sum(S, l, dim=1)
                T.row_reduce_store(S, (m, l), merge_row_statistics, normalize_row, P_s, Y[by * 128, bx * 256])
        return bad

    with pytest.raises(tile_ops.lang.TileLangError, match="T.Pipelined loop at the kernel's top level"):
        compile_program(nested(), "sm_90a")

    def clustered():
        @T.prim_func
        def bad(X: T.Tensor((128, 512), "float16"), Y: T.Tensor((128, 512), "float16")):
            with T.Kernel(2, 1, threads=128, cluster=2) as (bx, by):
                S = T.alloc_fragment((64, 256), "float32")
                m = T.alloc_fragment((64,), "float32")
                P_s = T.alloc_shared((64, 256), "float16")
                T.row_reduce_store(S, m, lambda blocks: blocks[0], lambda own, total: 1.0, P_s, Y[0, bx * 256])
        return bad

    with pytest.raises(tile_ops.lang.TileLangError, match="without cluster"):
        compile_program(clustered(), "sm_90a")


def test_a_float32_output_falls_back_from_deferred_to_a_cluster_split(monkeypatch):
    """The deferred default stages a 128x256 output tile, which does not fit in float32 (e.g. under autocast):
    the op launches the row split over the widest cluster instead (it raised: the split was sized on the
    deferred config, which takes none)."""
    import torch

    from tile_ops.compiler.targets import smem_limit
    from tile_ops.kernels import gemm_softmax_defaults, gemm_softmax_launch
    from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig

    monkeypatch.setattr(gemm_softmax_defaults, "default_arch", lambda: "sm_90a")
    built = []
    monkeypatch.setattr(gemm_softmax_launch, "gemm_softmax", lambda *args, **kwargs: built.append((args, kwargs)))
    M, N, K = 1000, 4096, 1000
    assert gemm_softmax_defaults.default_config(M, N, K, "sm_90a").deferred
    a, b = torch.empty(M, K, dtype=torch.float16), torch.empty(K, N, dtype=torch.float16)
    gemm_softmax_launch.get_gemm_softmax_kernel(a, b, torch.empty(M, N, dtype=torch.float32), 0.125)
    (args, kwargs), = built
    assert args[-1] == SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8)
    kwargs.pop("target")
    assert compile_program(gemm_softmax.fn(*args, **kwargs), "sm_90a").meta.smem_bytes <= smem_limit("sm_90a")


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])  # (the Ampere-class path: 65536 columns fit sm_90's smem)
def test_tensors_past_int32_offsets_are_refused_unless_only_tma_touches_them(arch):
    """An lm-head sized output (16384 x 152064 = 2.49e9 elements) overflows a 32-bit offset wherever the kernel
    indexes its pointer: a clear error, not a TVM literal check or wrong addresses. Through TMA (fp16 output
    staged and stored by descriptor, sm_90a) its coordinates stay small, and it compiles."""
    with pytest.raises(ValueError, match=r"Out \(32768, 65536\) \(2,147,483,648 elements\): 2\^31 elements or more"):
        compile_program(gemm_softmax.fn(32768, 65536, 64, 1.0, cfg=gemm_softmax_config(32768, 65536, 64, arch)), arch)
    M, N, K = 16384, 152064, 4096
    cfg = GemmConfig(128, 256, 64, 3, 256, 4, epilogue="shared")
    with pytest.raises(ValueError, match=r"C \(1, 16384, 152064\).*Split the problem"):  # fp32: direct stores
        compile_program(gemm.fn(M, N, K, trans_B=True, out_dtype="float32", cfg=cfg), arch)
    if arch == "sm_90a":
        c = compile_program(gemm.fn(M, N, K, trans_B=True, cfg=cfg), arch)
        assert "C" not in c.meta.kept and "C_tmap" in c.meta.kept


@needs_nvcc
@pytest.mark.parametrize("damaged", [{}, [1], {"grid": "not a grid"}])
def test_a_cache_entry_whose_kernel_description_does_not_load_is_rebuilt(damaged):
    """A kernel description intact on disk (its checksum holds) that no longer loads (written before a field it
    needs existed) is a corrupt entry, warned about and rebuilt, not an error forever."""
    import json

    from tile_ops.jit.cache import DiskCache, description_sha256

    key = matmul.key((64, 64, 64), {}, "sm_80")
    matmul._mem.clear(), matmul._fast.clear()  # built into this test's cache directory
    first = matmul(64, 64, 64, target="sm_80")
    meta_file = DiskCache().path(key) / "meta.json"
    record = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**record, "meta": damaged, "description_sha256": description_sha256(key, damaged)}))
    matmul._mem.clear(), matmul._fast.clear()  # a new process: only the disk cache
    with pytest.warns(UserWarning, match="is corrupt .*its kernel description does not load"):
        again = matmul(64, 64, 64, target="sm_80")
    assert again.cubin == first.cubin and json.loads(meta_file.read_text())["meta"]["grid"] == [1, 1, 1]


def test_an_unknown_target_arch_is_refused_before_anything_builds():
    for bad in ("hopper", "sm_75", "90a", "sm90a"):
        with pytest.raises(ValueError, match=rf"target arch '{bad}' is not one the compiler builds for"):
            matmul(64, 64, 64, target=bad)


def test_a_grid_past_cudas_limits_is_refused_on_the_path_that_would_launch_it():
    """sm_80's gemm puts the batch on grid z and M's row tiles on y (at most 65535 each); sm_90a's persistent
    grid walks any number of tiles."""
    with pytest.raises(ValueError, match=r"a launch grid of \(1, 1, 70000\) blocks, past CUDA's limits"):
        compile_program(gemm.fn(8, 64, 16, 70000, 70000, 70000, cfg=GemmConfig(64, 64, 32, 2, 128, 0)), "sm_80")
    assert compile_program(gemm.fn(8, 64, 16, 70000, 70000, 70000,
                                   cfg=GemmConfig(64, 64, 64, 4, 128, 0)), "sm_90a").meta.grid[1:] == (1, 1)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("a_shape, b_shape, c_shape, transpose_B", [
    ((128, 32), (64, 128), (128, 128), False),  # K differs
    ((128, 32), (32, 128), (128, 64), False),  # N differs
    ((64, 32), (32, 128), (128, 128), False),  # M differs
    ((128, 32), (32, 128), (128, 128), True),  # B^T is (128, 32): K differs
])
def test_gemm_shapes_are_checked_on_every_path(arch, a_shape, b_shape, c_shape, transpose_B):
    """A pipelined wgmma main loop (sm_90a) issues its gemms without the mma.sync lowering: the operand
    checks run in layout inference, for both."""
    def prog():
        @T.prim_func
        def bad(A: T.Tensor((256, 256), "float16"), B: T.Tensor((256, 256), "float16"),
                C: T.Tensor((256, 256), "float32")):
            with T.Kernel(2, 2, threads=128) as (bx, by):
                A_s = T.alloc_shared(a_shape, "float16")
                B_s = T.alloc_shared(b_shape, "float16")
                C_f = T.alloc_fragment(c_shape, "float32")
                T.clear(C_f)
                for k in T.Pipelined(8, num_stages=2):
                    T.copy(A[by * 128, k * 32], A_s)
                    T.copy(B[k * 32, bx * 128], B_s)
                    T.gemm(A_s, B_s, C_f, transpose_B=transpose_B)
                T.copy(C_f, C[by * 128, bx * 128])
        return bad

    with pytest.raises(tile_ops.lang.TileLangError, match=r"test_compiler.py:\d+: T.gemm: shapes do not match"):
        compile_program(prog(), arch)


def test_shared_memory_is_held_to_the_targets_limit():
    """163 KiB on sm_80 (A100), 227 on sm_90: a 192 KiB kernel builds for the H200, not for an A100."""
    cfg = GemmConfig(128, 128, 128, 3, 128, 8)  # 3 x (32 + 32) KiB
    assert compile_program(gemm.fn(1024, 1024, 1024, cfg=cfg), "sm_90").meta.smem_bytes == 196608
    with pytest.raises(tile_ops.lang.TileLangError, match="needs 196608 bytes of shared memory; the limit on sm_80 "
                                                          "is 166912"):
        compile_program(gemm.fn(1024, 1024, 1024, cfg=cfg), "sm_80")


@pytest.mark.parametrize("make, error, message", [
    (lambda: GemmConfig(block_M=0), ValueError, "block sizes, stages and threads must be at least 1"),
    (lambda: GemmConfig(block_K=-64), ValueError, "block sizes, stages and threads must be at least 1"),
    (lambda: GemmConfig(swizzle=-1), ValueError, "swizzle 0 .off. or more"),
    (lambda: SoftmaxConfig(64, 0, 64, 3, 128), ValueError, r"SoftmaxConfig\(.*block_N=0.*\): block sizes, stages and"),
    (lambda: gemm.fn(0, 256, 256), ValueError, "sizes must be at least 1"),
    (lambda: gemm.fn(64, 64, 64, 2, 3, 5), ValueError, "each operand's batch 1 .broadcast. or the batch"),
    (lambda: gemm.fn(64, 64, 64, dtype="int8", out_dtype="int32"), ValueError, "dtype='int8'; accepted"),
    (lambda: build_gemm(64, 64, 64, dtype="float8"), ValueError, "dtype='float8'; accepted"),
    (lambda: gemm_softmax.fn(64, 0, 64), ValueError, "sizes of at least 1"),
])
def test_impossible_configs_and_problems_are_refused_by_name(make, error, message):
    """Not a ZeroDivisionError, a TVM 'Divide by zero', a KeyError in the padding plan, or (swizzle=-1) a
    rasterization that computes tiles outside the grid and skips others."""
    with pytest.raises(error, match=message):
        make()


def test_kernel_grid_and_swizzle_panel_must_be_positive():
    def prog(grid, panel):
        @T.prim_func
        def k(A: T.Tensor((64, 64), "float32")):
            with T.Kernel(*grid, threads=128) as ids:
                T.use_swizzle(panel)
                A[0, 0] = 1.0
        return k

    with pytest.raises(tile_ops.lang.TileLangError, match=r"T.Kernel: grid \[0, 4\]: every extent must be at least 1"):
        prog((0, 4), 8)
    with pytest.raises(tile_ops.lang.TileLangError, match="T.use_swizzle: panel_size=-1; accepted: 1 or more"):
        prog((4, 4), -1)


def test_a_dtype_error_points_at_the_users_line_not_generated_code():
    def prog():
        @T.prim_func
        def k(A: T.Tensor((64, 64), "fp16")):
            with T.Kernel(1, threads=128) as bx:
                A[0, 0] = 1.0
        return k

    with pytest.raises(tile_ops.lang.TileLangError, match=r"test_compiler.py:\d+: unsupported dtype 'fp16'"):
        prog()


@needs_nvcc
def test_a_kernel_that_spills_to_local_memory_says_so():
    """128x256 fp32 accumulators over 128 threads: 256 registers' worth per thread, more than ptxas has."""
    with pytest.warns(UserWarning, match=r"kernel gemm_kernel \(sm_90a.*bytes per thread in local memory .* "
                                         r"expect it to be slow"):
        gemm(512, 512, 512, cfg=GemmConfig(128, 256, 64, 3, 128, 8), target="sm_90a")


@pytest.mark.parametrize("body, message", [
    (lambda A, F: T.copy(A[0 * 64.0, 0], F), r"A indexed with a float32 value \(0.0\); indices are integers"),
    (lambda A, F: F.__setitem__((0, 0), A[F[0, 1], 0]), r"A indexed with a float32 value .*; indices are integers"),
    (lambda A, F: F.__setitem__((0, 0), T.exp2(T.cast(1, "int32"))),
     "T.exp2: needs a floating point argument, got int32"),
])
def test_integer_indices_and_floating_math_are_checked_at_the_users_line(body, message):
    """(Bool and numpy indices, numpy floats to exp: still accepted, see the test below.)"""
    """Not nvcc's 'expression must have integral or unscoped enum type' or '__exp2 is undefined'."""
    def prog():
        @T.prim_func
        def k(A: T.Tensor((64, 64), "float32"), C: T.Tensor((64, 64), "float32")):
            with T.Kernel(1, threads=128) as bx:
                F = T.alloc_fragment((64, 64), "float32")
                body(A, F)
        return k

    with pytest.raises(tile_ops.lang.TileLangError, match=message):
        prog()


def test_bool_and_numpy_indices_and_numpy_floats_still_compile():
    import numpy as np

    @T.prim_func
    def k(A: T.Tensor((64, 64), "float32"), C: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128) as bx:
            F = T.alloc_fragment((64, 64), "float32")
            for i, j in T.Parallel(64, 64):
                F[i, j] = A[bx > 3, np.int32(7)] + T.exp(np.float32(0.5))
            T.copy(F, C[0, 0])
    assert compile_program(k, "sm_80").source


def test_a_huge_operand_no_tma_copies_is_refused_before_tvm_builds_it():
    """sm_80 (no TMA) indexes every operand: at K = 2^31 TVM's build aborted the process (std::bad_alloc after
    ~24 GB) before the 32-bit offset check ran. Refused up front, in a memory-capped child process."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "from tile_ops.compiler import compile_program\n"
            "from tile_ops.kernels.gemm import gemm\n"
            "from tile_ops.kernels.gemm_launch import launch_config\n"
            "M, N, K = 8, 8, 2**31\n"
            "try:\n"
            "    compile_program(gemm.fn(M, N, K, cfg=launch_config(M, N, K, 'float16', arch='sm_80')), 'sm_80')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gemm_kernel: A (1, 8, 2147483648) (17,179,869,184 elements), B" in out.stdout


def test_gemm_softmax_rows_too_wide_for_shared_memory_say_so_in_the_ops_words(monkeypatch):
    """On sm_80 rows of 65537 scores need more shared memory than the GPU has: the compiler's error named the
    library's kernel line and asked to reduce block sizes, nothing an op caller can change."""
    import torch

    from tile_ops.kernels import gemm_softmax_defaults, gemm_softmax_launch

    monkeypatch.setattr(gemm_softmax_defaults, "default_arch", lambda: "sm_80")
    monkeypatch.setattr(sys.modules["tile_ops.jit"], "default_arch", lambda: "sm_80")
    M, N, K = 256, 65537, 64
    a, b, out = torch.empty(M, K, dtype=torch.float16), torch.empty(K, N, dtype=torch.float16), torch.empty(M, N)
    with pytest.raises(ValueError, match=r"rows of N = 65537 scores are too wide for its kernel on sm_80: .*"
                                         r"\(\d+ bytes of shared memory needed, 166912 available\).*torch.softmax"):
        gemm_softmax_launch.get_gemm_softmax_kernel(a, b, out.half(), 1.0)


@needs_nvcc
def test_hopper_one_stage_pipeline_releases_its_stage_in_the_same_step():
    """A gemm-only loop keeps one wgmma group in flight and releases step k - 1's stage in step k, after step
    k's data came: with one stage that data can never come (a hang). One stage waits for its own gemms."""
    one, three = (_hopper_gemm(256, 256, 256, block_K=64, num_stages=s).source for s in (1, 3))
    assert "wait_group_sync_aligned_1" in three and "wait_group_sync_aligned_1" not in one
    assert "wait_group_sync_aligned_0" in one and "mbarrier_wait" in one


@needs_nvcc
@needs_cuobjdump
def test_hopper_setmaxnreg_fits_the_registers_a_640_thread_block_has():
    """ptxas gives a 640-thread block 96 registers a thread (65536 / 640, in 8s): 61440, not 65536. Asking
    the consumers for 112 after the producer's 40 needed 62464: setmaxnreg.inc would wait forever."""
    k = _hopper_gemm(512, 256, 256, block_M=256, block_K=32, num_stages=2, threads=512)
    sass = k.sass()
    inc = [int(x, 16) for x in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", sass)]
    dec = [int(x, 16) for x in re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass)]
    assert k.meta.block == (640, 1, 1) and inc and dec
    assert inc[0] * 512 + dec[0] * 128 <= k.meta.resources["registers"] * 640, (inc, dec, k.meta.resources)


@needs_nvcc
def test_hopper_blocks_past_1024_threads_with_the_producer_are_not_warp_specialized():
    """The producer warpgroup made a 1152-thread block, which CUDA cannot launch: the loop runs unspecialized."""
    src = _hopper_gemm(512, 256, 256, block_M=256, block_N=256, block_K=32, num_stages=2, threads=1024).source
    assert "__launch_bounds__(1024)" in src and "cp.async.bulk.tensor" not in src


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("second", ["load", "load after use"])
def test_a_tile_loaded_twice_in_one_pipelined_iteration_is_refused(arch, second):
    """Both loads landed in the stage the iteration reads, unordered (2 A @ B or 2 A2 @ B, silently)."""
    def prog():
        @T.prim_func
        def main(A: T.Tensor((256, 256), "float16"), A2: T.Tensor((256, 256), "float16"),
                 B: T.Tensor((256, 256), "float16"), C: T.Tensor((256, 256), "float16")):
            with T.Kernel(2, 2, threads=128) as (bx, by):
                A_s = T.alloc_shared((128, 64), "float16")
                B_s = T.alloc_shared((64, 128), "float16")
                C_f = T.alloc_fragment((128, 128), "float32")
                T.clear(C_f)
                for k in T.Pipelined(4, num_stages=2):
                    T.copy(A[by * 128, k * 64], A_s)
                    T.copy(B[k * 64, bx * 128], B_s)
                    if second == "load after use":
                        T.gemm(A_s, B_s, C_f)
                    T.copy(A2[by * 128, k * 64], A_s)
                    T.gemm(A_s, B_s, C_f)
                T.copy(C_f, C[by * 128, bx * 128])
        return main

    with pytest.raises(tile_ops.lang.TileLangError, match=r"A_s is loaded here after an earlier load or use of it in "
                                                          r"the same T.Pipelined iteration") as e:
        compile_program(prog(), arch)
    assert "T.copy(A2[by * 128, k * 64], A_s)" in str(e.value)


def _pipelined_sum(write_first: bool, threads=128, rank6=False):
    """Y = the sum over column tiles of X (or of W, which the kernel first writes), staged and stored by TMA."""
    M, N, bM, bN = 256, 256, 64, 64

    @T.prim_func
    def main(X: T.Tensor((M, N), "float32"), W: T.Tensor((M, N), "float32"), Y: T.Tensor((M, bN), "float32")):
        with T.Kernel(M // bM, threads=threads) as bx:
            X_s = T.alloc_shared((bM, bN), "float32")
            Y_s = T.alloc_shared((bM, bN), "float32")
            acc = T.alloc_fragment((bM, bN), "float32")
            T.clear(acc)
            if write_first:
                for i, j in T.Parallel(bM, N):
                    W[bx * bM + i, j] = X[bx * bM + i, j] * 2.0
            for k in T.Pipelined(N // bN, num_stages=2):
                T.copy((W if write_first else X)[bx * bM, k * bN], X_s)
                for i, j in T.Parallel(bM, bN):
                    acc[i, j] = acc[i, j] + X_s[i, j]
            T.copy(acc, Y_s)
            T.copy(Y_s, Y[bx * bM, 0])
    return main


def test_hopper_loads_of_a_tensor_the_kernel_writes_are_not_warp_specialized():
    """The producer warpgroup joins no consumer barrier: its TMA loads of W would not wait for the block's
    own writes of W (stale data). Such a loop runs as a cp.async pipeline, after the block's barrier."""
    plain, written = (compile_program(_pipelined_sum(w), "sm_90a").source for w in (False, True))
    assert "cp.async.bulk.tensor" in plain and "mbarrier" in plain
    assert "cp.async.bulk.tensor.2d.shared" not in written


@needs_nvcc
@needs_cuobjdump
def test_hopper_tma_store_of_generic_writes_is_fenced_without_wgmma():
    """The proxy fence before a TMA store was emitted only in kernels with wgmma: the store could read the
    staged tile before the consumers' st.shared reached the async proxy."""
    ops = [line.split("*/", 1)[1].split(";")[0].strip().split()
           for line in tile_ops.compile(_pipelined_sum(False), target="sm_90a").sass().splitlines()
           if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]
    ops = [o[1] if o[0].startswith("@") else o[0] for o in ops if o]  # opcodes, predicates dropped
    store = ops.index(next(o for o in ops if o.startswith("UTMASTG")))
    last_write = max(i for i, o in enumerate(ops[:store]) if o.startswith("STS"))
    assert any(o.startswith("FENCE.VIEW.ASYNC.S") for o in ops[last_write:store]), ops[last_write:store + 1]


def test_hopper_loads_of_a_6_dim_tensor_take_cp_async():
    """A tensor map has at most 5 dims: lowering raised TVM's bare ValueError."""
    @T.prim_func
    def main(X: T.Tensor((2, 2, 2, 2, 64, 64), "float16"), Y: T.Tensor((64, 64), "float16")):
        with T.Kernel(1, threads=128) as bx:
            X_s = T.alloc_shared((64, 64), "float16")
            for k in T.Pipelined(2, num_stages=2):
                T.copy(X[k, 1, 0, 1, 0, 0], X_s)
                T.copy(X_s, Y[0, 0])

    assert "cp.async" in compile_program(main, "sm_90a").source


def test_build_directories_of_killed_builds_are_swept(tmp_path):
    """Issue 45: a build killed with SIGKILL leaves its directory; the next process's first build removes the
    directories of processes that are gone (and those of the pid-less layout after a day), not live ones'."""
    import subprocess
    import time

    from tile_ops.jit.build import BUILD_DIR_PREFIX, sweep_build_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    dirs = {name: tmp_path / f"{BUILD_DIR_PREFIX}{name}" for name in
            (f"{dead.pid}_x1", f"{os.getpid()}_x2", "old_layout", "new_layout")}
    for path in dirs.values():
        (path / "nvcc_tmp").mkdir(parents=True)
    os.utime(dirs["old_layout"], (time.time() - 2 * 86400,) * 2)
    assert sweep_build_dirs(str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(dirs[n].name for n in (f"{os.getpid()}_x2", "new_layout"))


@needs_nvcc
def test_nvcc_runs_in_its_own_directory_and_leaves_nothing(tmp_path, monkeypatch):
    import tempfile

    from tile_ops.jit.build import build_cubin

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cubin, _ = build_cubin('extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }', "sm_80", "k")
    assert cubin and list(tmp_path.iterdir()) == []


def test_code_generation_compiles_nothing_where_tvm_has_a_cuda_runtime():
    """On a machine with a GPU driver TVM builds its CUDA module through the CUDA runtime, which compiles the
    source on the spot (seconds, thrown away: nvcc builds the cubin); the codegen keeps the source alone."""
    import tvm_ffi

    name = "ffi.Module.create.cuda"
    if tvm_ffi.get_global_func(name, allow_missing=True) is not None:
        pytest.skip("this TVM has its CUDA runtime loaded; the stand-in would replace it")
    calls = []

    def runtime_module(code, fmt, fmap, source):  # the CUDA runtime's factory, as a GPU machine has it
        calls.append(fmt)
        raise RuntimeError("the CUDA runtime compiled the source")

    tvm_ffi.register_global_func(name, runtime_module)
    try:
        c = compile_program(matmul.fn(256, 256, 64), "sm_80")
    finally:
        tvm_ffi.remove_global_func(name)
    assert calls == [] and "mma.sync" in c.source
    assert "TVM_COMPILE_FORCE_FALLBACK" not in os.environ
