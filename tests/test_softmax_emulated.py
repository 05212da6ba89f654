"""The library's fused GEMM + softmax (tile_ops.kernels.gemm_softmax) lowered for sm_90a and run on the CPU
emulator (tile_ops/jit/emulator.py), in each of its three ways of combining a row's statistics across blocks:

- a thread-block cluster splitting the row (T.cluster_allreduce of (max, sum) pairs): every block sends its (max, sum) pairs
  into each peer's exchange slots with st.async, completing on the peer's mbarrier, and merges them;
- the same with two consumer warpgroups taking alternate row blocks (pingpong: named-barrier bar.arrive
  hand-offs) over a persistent grid, so the exchange's two slot sets alternate;
- rows spread over the whole grid (``deferred``, T.row_reduce_store): the statistics go through global
  memory, each row block's flag counted and spun on, each tile stored after the block's next one.

Inputs are multiples of 1/8, so the scores are exact in float32; the output is the float64 softmax within
float16 rounding.  The grid's blocks run together (``resident``) and drift apart (``stagger``)."""

import numpy as np
import pytest

from tile_ops.compiler.lower import lower
from tile_ops.kernels.gemm_softmax import gemm_softmax
from tile_ops.kernels.gemm_softmax_config import SoftmaxConfig
from tile_ops.kernels.gemm_softmax_defaults import default_config
from tile_ops.jit.emulator import Emulator

WORKSPACE = "tile_ops_workspace"
SMALL = dict(block_M=64, block_N=64, block_K=64, threads=128, policy="full_row")  # one consumer warpgroup


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def run_softmax(M, N, K, cfg, scale=1.0, ctas=None, stagger=True, seed=0):
    """softmax(scale * A @ B) by the lowered kernel on the emulator (``ctas``: the persistent grid's size, as
    the launcher sizes it to the device; the kernel's own estimate otherwise): the float16 output, the float64
    reference, the lowered kernel, the emulator and the workspace (flags first) when the kernel has one."""
    lk = lower(gemm_softmax.fn(M, N, K, scale, "float16", "float16", cfg), "sm_90a")
    rng = np.random.default_rng(seed)
    a, b = (rng.integers(-16, 17, s) / 8 for s in ((M, K), (K, N)))
    arrays = {"A": a.astype(np.float16), "B": b.astype(np.float16), "Out": np.full((M, N), np.nan, np.float16)}
    if any(p.name == WORKSPACE for p in lk.func.params):  # zeroed once by the launcher, left zeroed by kernels
        arrays[WORKSPACE] = np.zeros(4096 + 8 * M * -(-N // cfg.block_N), np.float32)
    emu = Emulator(lk.func, arrays, tensormaps=lk.meta.tensormaps)
    emu.run(lk.meta.grid if ctas is None else (ctas, 1, 1), lk.meta.cluster_dims, stagger=stagger, resident=True)
    s = scale * (a @ b)
    ref = np.exp(s - s.max(1, keepdims=True))
    return arrays["Out"], ref / ref.sum(1, keepdims=True), lk, emu, arrays.get(WORKSPACE)


def assert_softmax(out, ref):
    """Within float16 rounding (half an ulp, and the float32 sums' few ulps) of the float64 softmax."""
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("shape, cfg, ctas, scale, ran", [
    # the library's default below K = 512: 128x256 tiles, a row over a pair, one tile each
    pytest.param((128, 512, 128), None, None, 1.0, {"st.async.v2.f32", "wgmma.m64n256k16.f16.trans-b"},
                 id="default-pair"),
    # 2 tiles a block (the walk: earlier tiles rescaled from the stored output), ragged K, 3 k-steps on 2 stages
    pytest.param((64, 256, 136), SoftmaxConfig(**SMALL, num_stages=2, split=2), None, 0.5, {"st.async.v2.f32"},
                 id="walk-pair"),
    # two consumer warpgroups on alternate row blocks; a resident grid of 2 clusters, each walking 4 of the 8
    # row blocks: each warpgroup's exchange slot sets and barrier phases alternate over its two, the warpgroups
    # hand the main loop over with bar.arrive
    pytest.param((512, 128, 136), SoftmaxConfig(**SMALL, num_stages=3, split=2, pingpong=True), 4, -0.75,
                 {"st.async.v2.f32", "bar.arrive"}, id="pingpong-pair-persistent"),
])
def test_clustered_softmax_matches_float64(shape, cfg, ctas, scale, ran):
    """A row split over a cluster: each block's (max, sum) of its rows reach every peer by st.async (landing at
    the round's end, completing on the peer's exchange mbarrier), and every block scales its tiles by the
    merged statistics."""
    cfg = cfg or default_config(*shape, "sm_90a")
    assert cfg.split == 2 and not cfg.deferred
    out, ref, lk, emu, _ = run_softmax(*shape, cfg, scale=scale, ctas=ctas)
    assert lk.meta.cluster_dims == (2, 1, 1)
    assert ran | {"barrier.cluster.wait"} <= set(emu.ran), sorted(emu.ran)
    assert_softmax(out, ref)


def test_clustered_softmax_without_the_peers_values_fails(monkeypatch):
    """A broken exchange: each block's st.async lands in its own slots only (the peer's rank ignored), so the
    exchange mbarrier completes (the bytes arrive) but the peer's slots are never written: the merge reads
    them as they were (the emulator's unwritten shared memory is NaN)."""
    put = Emulator._st_async

    def local_put(self, call, env):
        put(self, call, env)
        cta, d, data, bar = self.stores[-1]
        self.stores[-1] = (self.cta, d, data, bar)

    monkeypatch.setattr(Emulator, "_st_async", local_put)
    out, ref, *_ = run_softmax(64, 256, 136, SoftmaxConfig(**SMALL, num_stages=2, split=2))
    assert not np.allclose(out.astype(np.float64), ref, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("shape, cfg, ctas", [
    # the library's default from K = 512 (8192x2048x1024's kernel): 128x256 tiles, one a block, 2 row blocks
    pytest.param((256, 512, 512), None, None, id="default"),
    # 4 CTAs walking 6 tiles of 3 row blocks: each tile stored after the block's next main loop
    pytest.param((192, 128, 128), SoftmaxConfig(**SMALL, num_stages=3, deferred=True), 4, id="persistent-walk"),
])
def test_deferred_softmax_matches_float64(shape, cfg, ctas):
    """Rows over the grid without clusters: each tile's row statistics go to the workspace, a flag per row
    block counts them, a warp spins on it and computes the row factors; the flags are zero at the end, as the
    next launch (sharing the workspace) needs them."""
    cfg = cfg or default_config(*shape, "sm_90a")
    assert cfg.deferred
    out, ref, lk, emu, ws = run_softmax(*shape, cfg, ctas=ctas, stagger=(3, 1, 2))
    assert {"tile_ops_flag_signal", "tile_ops_flag_wait", "tile_ops_row_stats_read",
            "tma.store.2d.swizzle128"} <= set(emu.ran), sorted(emu.ran)
    assert_softmax(out, ref)
    assert not ws[:4096].view(np.int32).any()


def test_deferred_softmax_without_waiting_for_the_row_fails(monkeypatch):
    """A broken variant: the statistics warp does not wait for the row block's other tiles (the flag spin is
    skipped), so a block that runs ahead normalizes its tile with statistics not yet published."""
    flag = Emulator._flag

    def no_wait(self, call, env):
        if call.args[0].value != "tile_ops_flag_wait":
            yield from flag(self, call, env)

    monkeypatch.setattr(Emulator, "_flag", no_wait)
    out, ref, *_ = run_softmax(192, 128, 128, SoftmaxConfig(**SMALL, num_stages=3, deferred=True), ctas=4,
                               stagger=(1, 3, 3, 3))
    assert not np.allclose(out.astype(np.float64), ref, rtol=1e-3, atol=1e-7)


def test_deferred_softmax_without_its_warp_sync_deadlocks(monkeypatch):
    """The statistics warp's __syncwarp keeps every lane past its spin on the row block's flag before lane 0,
    the row block's last reader, resets it. Without it lane 0 runs ahead and resets the flag, and the lanes still
    to leave their spin read 0 and wait for good: the hang the GPU would show."""
    from tile_ops.jit import emulator as tir_emulator

    monkeypatch.setattr(tir_emulator, "_NO_OPS", tir_emulator._NO_OPS | {"tirx.cuda.warp_sync"})
    with pytest.raises(RuntimeError, match=r"deadlock.*flag\.wait"):
        run_softmax(192, 128, 128, SoftmaxConfig(**SMALL, num_stages=3, deferred=True), ctas=4, stagger=(3, 1, 2))
