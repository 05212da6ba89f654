"""Stream-K (T.Kernel(stream_k=p), compiler/stream_k.py) on the CPU: the unit schedule every CTA computes,
the lowering (workspace parameter, fixup, flags), and the programs it refuses."""

import itertools
import re

import pytest

import tile_ops
import tile_ops.lang as T
from test_compiler import needs_cuobjdump, needs_nvcc
from tile_ops.compiler.meta import WORKSPACE, KernelMeta
from tile_ops.compiler.schedules.stream_k import MIN_STEPS, plan, unit
from tile_ops.jit.kernel import EntryArgs
from tile_ops.kernels.gemm import gemm
from tile_ops.kernels.gemm_config import GemmConfig
from tile_ops.kernels.gemm_softmax import gemm_softmax
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig
from tile_ops.lang.errors import TileLangError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def _split(tiles, groups, steps, most):
    p = plan(0, tiles, groups, steps, most)
    return p["parts"], p["split_tiles"], p["units"]


@pytest.mark.parametrize("most", [2, 3, 4])
def test_schedule_covers_every_k_step_of_every_tile_once(most):
    """For every (tiles, groups, steps): each tile's K steps are covered exactly once, by consecutive
    parts; a split tile has one owner, its last part, numbered after every writer of the tile; every
    split unit is in the first wave (co-resident); slots and flags fit the grid.  Group counts include the
    H200's: 132 CTAs, 128 (1000^3's grid), 120 (15 clusters of 8)."""
    for tiles, groups, steps in itertools.product(range(1, 70, 3), [*range(1, 40, 3), 64, 120, 128, 132],
                                                 (1, 4, 7, 16, 17, 63)):
        parts, split_tiles, units = _split(tiles, groups, steps, most)
        covered = {t: [] for t in range(tiles)}
        for g in range(groups):
            p = plan(g, tiles, groups, steps, most)
            assert (p["parts"], p["split_tiles"], p["units"]) == (parts, split_tiles, units)
            for it in range(-(-(units - g) // groups)):
                f = unit(g, it, groups, steps, p)
                assert f["slot"] == g + it * groups < units
                covered[f["tile"]].append((f["k_begin"], f["k_steps"], f["slot"], f["writer"], f["owner"]))
        for t, runs in covered.items():
            runs.sort()
            assert sum(n for _, n, *_ in runs) == steps and runs[0][0] == 0, (tiles, groups, steps, t, runs)
            assert all(b + n == nb for (b, n, *_), (nb, *_) in zip(runs, runs[1:]))
            assert all(n >= min(MIN_STEPS, steps) for _, n, *_ in runs)
            if len(runs) == 1:
                assert runs[0][3:] == (0, 0)
                continue
            assert t < split_tiles and len(runs) == parts
            owners = [u for *_, u, w, o in runs if o]
            writers = [u for *_, u, w, o in runs if w]
            assert len(owners) == 1 and owners[0] == max(u for *_, u, _, _ in runs) and len(writers) == parts - 1
            assert all(u < groups for *_, u, _, _ in runs), "split units run in the first wave"
            assert t < groups  # its flag
        if parts > 1:
            assert split_tiles == tiles % groups and parts <= most and steps // parts >= MIN_STEPS
            assert parts * split_tiles <= groups


def test_schedule_fills_the_idle_ctas():
    """The cases the library meets: 1000^3 in 128x128 tiles on 128 CTAs (64 tiles in halves), and the
    fused softmax's 64 row blocks on the H200's 15 clusters of 8 (4 row blocks in thirds, then 60)."""
    assert _split(64, 128, 16, 2) == (2, 64, 128)
    assert _split(64, 15, 16, 3) == (3, 4, 72)
    per_group = [len(range(g, 72, 15)) for g in range(15)]
    assert per_group == [5] * 12 + [4] * 3  # a third of a tile, then 4 whole ones; or 4 whole ones
    assert _split(60, 15, 16, 3) == (1, 0, 60)  # whole waves: nothing to split


def test_entry_args_pass_the_workspace():
    meta = KernelMeta(name="k", entry="k", arch="sm_90a", grid=(1, 1, 1), block=(128, 1, 1), smem_bytes=0,
                      params=[("A", (4,), "float16"), ("C", (4,), "float16")], kept=["A", "C", WORKSPACE], out_idx=[1],
                      workspace_floats=4)
    assert EntryArgs(meta).build([10, 20], 0, workspace=30) == [10, 20, 30]
    with pytest.raises(ValueError, match="workspace"):  # never the last pointer in its place
        EntryArgs(meta).build([10, 20], 0)
    assert KernelMeta.from_json(meta.to_json()).workspace_floats == 4


@needs_nvcc
@needs_cuobjdump
def test_gemm_lowers_a_fixup_through_the_workspace():
    """1000^3 in 128x128 tiles: 64 tiles split in two K halves over 128 CTAs; the writer stores its
    accumulators (coalesced float4s) and counts itself on the tile's flag, the owner waits and adds."""
    cfg = GemmConfig(128, 128, 64, 4, 128, 8, epilogue="shared", stream_k=2)
    k = gemm(1000, 1000, 1000, 1, 1, 1, False, False, False, "float16", "float16", cfg, target="sm_90a")
    assert k.meta.kept[-1] == WORKSPACE and k.meta.workspace_floats == 128 * 128
    assert k.meta.persistent_tiles == 128 and k.meta.grid == (128, 1, 1)
    assert "red.relaxed.gpu.global.add.s32" in k.source and "ld.acquire.gpu.global.s32" in k.source
    assert "fence.acq_rel.gpu" in k.source
    mix = k.instruction_mix()
    assert mix.get("REDG", 0) >= 1 and mix.get("HGMMA", 0) > 0 and k.meta.resources["spill_stores"] == 0, mix
    assert k.workspace_bytes((132, 1, 1)) == (4096 + 132 * 128 * 128) * 4


@needs_nvcc
@needs_cuobjdump
def test_clustered_softmax_lowers_stream_k_without_spills():
    cfg = SoftmaxConfig(128, 256, 64, 3, 256, "full_row", split=8, stream_k=3)
    k = gemm_softmax(8192, 2048, 1024, 0.125, "float16", "float16", cfg, target="sm_90a")
    assert k.meta.kept[-1] == WORKSPACE and k.meta.workspace_floats == 128 * 256
    assert k.meta.resources["spill_stores"] == 0 and k.instruction_mix().get("REDG", 0) >= 1
    with pytest.raises(ValueError, match="one column tile per block"):
        gemm_softmax(1024, 4096, 256, 0.125, "float16", "float16", cfg, target="sm_90a")


def test_stream_k_options_are_checked():
    with pytest.raises(ValueError, match="stream_k=1"):
        GemmConfig(stream_k=1)
    with pytest.raises(ValueError, match="split_k=2"):
        GemmConfig(split_k=2, stream_k=2)


def _program(kind):
    @T.prim_func
    def main(A: T.Tensor((512, 512), "float16"), B: T.Tensor((512, 512), "float16"),
             C: T.Tensor((512, 512), "float16")):
        with T.Kernel(4, 4, threads=128, pingpong=kind == "pingpong", stream_k=2) as (bx, by):
            A_s = T.alloc_shared((128, 64), "float16")
            B_s = T.alloc_shared((64, 128), "float16")
            C_f = T.alloc_fragment((128, 128), "float32")
            if kind != "uncleared":
                T.clear(C_f)
            for k in T.Pipelined(8, num_stages=3):
                T.copy(A[by * 128, k * 64], A_s)
                T.copy(B[k * 64, bx * 128], B_s)
                T.gemm(A_s, B_s, C_f)
                if kind == "carried":
                    for i, j in T.Parallel(128, 128):
                        C_f[i, j] = C_f[i, j] * 0.5
            T.copy(C_f, C[by * 128, bx * 128])

    return main


@pytest.mark.parametrize("kind, message", [("uncleared", "must be cleared"), ("carried", "T.copy and accumulating"),
                                           ("pingpong", "pingpong")])
def test_stream_k_refuses_what_it_cannot_split(kind, message):
    with pytest.raises(TileLangError, match=message):
        tile_ops.compile(_program(kind), out_idx=[2], target="sm_90a")


def test_plan_of_a_stream_k_kernel_is_its_launcher(monkeypatch):
    """The ops' C++ plans cannot hold a per-stream workspace: a stream-K kernel's plan is a callable
    launch(a, b, out, c) that goes through the kernel's launcher, which passes it."""
    from tile_ops.jit.kernel import Kernel

    meta = KernelMeta(name="k", entry="k", arch="sm_90a", grid=(1, 1, 1), block=(256, 1, 1), smem_bytes=0,
                      params=[("A", (4,), "float16"), ("B", (4,), "float16"), ("Bias", (4,), "float16"),
                              ("C", (4,), "float16")], kept=["A", "B", "Bias", "C", WORKSPACE], out_idx=[3],
                      workspace_floats=16)
    kernel, launched = Kernel(meta, "", b""), []
    monkeypatch.setattr(kernel, "launcher", lambda device: lambda ptrs, dims=(): launched.append((ptrs, dims)))
    program = kernel.plan("cuda", [0, 1, 3, 3])  # gemm without bias: the bias slot takes the output's buffer
    program(10, 20, 30, 0)  # a, b, out, c
    assert launched == [([10, 20, 30, 30], ())]


def test_each_cluster_exchange_counts_its_own_uses():
    """Three T.cluster_allreduce calls a tile: each waits on its barriers with the parity and phase of its
    own uses (with one count for all, the third would wait for phase 1 of a barrier still in phase 0 and
    read its slots before the peers' values land)."""
    @T.prim_func
    def three(X: T.Tensor((128, 128), "float16"), Y: T.Tensor((128, 128), "float16")):
        with T.Kernel(2, threads=128, cluster=2) as bx:
            X_s = T.alloc_shared((64, 64), "float16")
            S = T.alloc_fragment((64, 64), "float32")
            m = T.alloc_fragment((64,), "float32")
            l = T.alloc_fragment((64,), "float32")
            n = T.alloc_fragment((64,), "float32")
            T.clear(S)
            T.copy(X[0, bx * 64], X_s)
            T.gemm(X_s, X_s, S)
            T.reduce_max(S, m, dim=1)
            T.reduce_sum(S, l, dim=1)
            T.reduce_max(S, n, dim=1)
            T.cluster_allreduce(m, "max")
            T.cluster_allreduce(l, "sum")
            T.cluster_allreduce(n, "max")
            for r, c in T.Parallel(64, 64):
                S[r, c] = S[r, c] - m[r] + l[r] - n[r]
            T.copy(S, Y[0, bx * 64])

    from tile_ops.compiler import compile_program

    source = compile_program(three, "sm_90a").source
    waits = re.findall(r"tile_ops_cluster_wait\(.*\[\(\(exchanges_ptr\[(\d)\] & 1\) \+ \d+\)\]\)\), "
                       r"\(\(uint\)\(\(exchanges_ptr\[(\d)\] & 3\) >> 1\)\)\);", source)
    assert waits == [("0", "0"), ("1", "1"), ("2", "2")], waits  # barrier parity and phase from one count
