"""wgmma's register-A ("rs") form on sm_90a: T.gemm(A_fragment, B_shared, C_fragment), as in
FlashAttention's P @ V.  CPU only: CUDA source, SASS and errors."""

import re

import pytest

import tile_ops
import tile_ops.lang as T
from programs import chained_matmul, chained_matmul_sum
from test_compiler import needs_cuobjdump, needs_nvcc
from tile_ops.compiler import compile_program
from tile_ops.compiler.layout import MmaAccumLayout, MmaWarps

# the rs line: {d...}, {a0, a1, a2, a3}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b (no imm-trans-a)
RS_PTX = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(f16|bf16)\.\1 \{[%\d, ]+\}, "
                    r"\{%\d+, %\d+, %\d+, %\d+\}, %\d+, ps0, 1, 1, [01];")
# cuobjdump prints A from registers as a register before B's descriptor, A from shared as gdesc alone
RS_SASS = re.compile(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, R\d+, gdesc\[")
SS_SASS = re.compile(r"HGMMA\.64x\d+x16\.F32(\.BF16)? R\d+, gdesc\[")
CONFIGS = [dict(), dict(block_M=128, threads=256), dict(block_M=128, threads=256, dtype="bfloat16")]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("wgmma", [True, False])
@pytest.mark.parametrize("threads,M,K", [(128, 64, 32), (256, 128, 64), (256, 256, 16)])
def test_register_a_words_are_the_isa_fragment(threads, M, K, wgmma):
    """Word q of k step kk holds A[row, col], A[row, col + 1] with row = the warp's 16-row slice +
    groupID + 8 * (q % 2), col = 16 kk + 2 * (lane % 4) + 8 * (q // 2) (PTX ISA: the A register
    fragment of wgmma .m64nNk16 per warp, and of mma.m16n8k16).  wgmma slices stack like its
    accumulator's, m0 = mi * 64 * n_wg + wg * 64 (issue_wgmma); mma.sync warps own WM adjacent rows."""
    warps = threads // 32
    lay = MmaAccumLayout.for_wgmma(M, K, threads) if wgmma else MmaAccumLayout(MmaWarps(M, K, warps, 1))
    for tid in range(threads):
        wg, warp, lane = tid // 128, tid // 32, tid % 32
        for mi in range(lay.mi):
            slice0 = mi * 64 * (threads // 128) + wg * 64 + warp % 4 * 16 if wgmma else warp * (M // warps) + mi * 16
            for kk in range(K // 16):
                for q, w in enumerate(lay.a_operand_words(mi, kk)):
                    row = slice0 + lane // 4 + 8 * (q % 2)
                    col = kk * 16 + 2 * (lane % 4) + 8 * (q // 2)
                    assert [lay.coords(tid, 2 * w + e) for e in (0, 1)] == [(row, col), (row, col + 1)]


@pytest.mark.parametrize("kw", CONFIGS)
def test_chained_matmul_issues_register_a_wgmma(kw):
    c = compile_program(chained_matmul.fn(512, 128, 64, 256, **kw), "sm_90a")
    el = "bf16" if kw.get("dtype") == "bfloat16" else "f16"
    assert RS_PTX.search(c.source) and f"m64n128k16.f32.{el}.{el}" in c.source  # P @ D from registers
    assert c.meta.layouts["P_f"] == c.meta.layouts["S_f"] and c.meta.layouts["P_f"].startswith("fragment wgmma")
    assert c.meta.block[0] == kw.get("threads", 128) + 128  # still warp-specialized (TMA producer)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("kw", CONFIGS)
def test_chained_matmul_sass_has_rs_hgmma_and_no_spills(kw):
    k = chained_matmul(512, 128, 64, 256, target="sm_90a", **kw)
    sass = k.sass()
    assert RS_SASS.search(sass) and SS_SASS.search(sass)  # P @ D from registers, A @ B from shared
    mix = k.instruction_mix()
    assert mix.get("HMMA", 0) == 0 and mix.get("UTMALDG", 0) > 0
    assert k.meta.resources["spill_stores"] == 0 and k.meta.resources["spill_loads"] == 0, k.meta.resources


@needs_nvcc
@needs_cuobjdump
def test_deferred_wait_loop_keeps_register_a_wgmma_in_flight():
    """A pipelined loop of only rs gemms keeps one wgmma group in flight (all reading P's registers):
    P is written before the loop, and the loop's final wait comes before anything can overwrite it."""
    k = chained_matmul_sum(512, 128, 64, 64, 4, target="sm_90a")
    sass = k.sass()
    assert RS_SASS.search(sass) and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert k.meta.resources["spill_stores"] == 0 and k.meta.resources["spill_loads"] == 0, k.meta.resources


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("program,args", [(chained_matmul, (512, 128, 64, 256)), (chained_matmul_sum, (512, 128, 64, 64, 4))])
def test_chained_matmul_on_sm80_uses_mma_sync_a_fragments(program, args):
    k = program(*args, target="sm_80")
    assert "mma.sync.aligned.m16n8k16" in k.source and "wgmma" not in k.source
    mix = k.instruction_mix()
    assert mix.get("HMMA", 0) > 0 and mix.get("HGMMA", 0) == 0 and k.meta.resources["spill_stores"] == 0


# ----------------------------------------------------------------------------- fragments wgmma cannot read


def _fragment_a_program(a_dtype="float16", K=32, transpose_A=False):
    @T.prim_func
    def bad(B: T.Tensor((K, 64), "float16"), C: T.Tensor((64, 64), "float32")):
        with T.Kernel(1, threads=128) as bx:
            B_s = T.alloc_shared((K, 64), "float16")
            P_f = T.alloc_fragment((K, 64) if transpose_A else (64, K), a_dtype)
            C_f = T.alloc_fragment((64, 64), "float32")
            T.copy(B[0, 0], B_s)
            T.fill(P_f, 1.0)
            T.gemm(P_f, B_s, C_f, transpose_A=transpose_A, clear_accum=True)
            T.copy(C_f, C[0, 0])
    return bad


@pytest.mark.parametrize("kw,reason", [
    (dict(transpose_A=True), "cannot be transposed"),
    (dict(K=24), "K a multiple of 16"),
    (dict(a_dtype="float32"), "float16 or bfloat16"),
])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_fragment_a_that_cannot_feed_the_tensor_cores_is_an_error(kw, reason, arch):
    with pytest.raises(tile_ops.lang.TileLangError) as e:
        compile_program(_fragment_a_program(**kw), arch)
    msg = str(e.value)
    assert "test_wgmma_rs.py" in msg and "T.gemm(P_f, B_s, C_f" in msg and reason in msg, msg


def test_valid_fragment_a_program_compiles():
    """The error cases' program with a valid fragment: wgmma rs on sm_90a."""
    assert RS_PTX.search(compile_program(_fragment_a_program(), "sm_90a").source)
