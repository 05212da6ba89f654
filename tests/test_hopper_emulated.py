"""The README's GEMM (tests/programs.py's matmul) lowered for sm_90a and run on the CPU emulator
(tile_ops/jit/emulator.py): a producer warpgroup issuing TMA tile loads onto mbarriers, consumer warpgroups
waiting on their phases and running wgmma m64nNk16 on 128B-swizzled shared tiles through matrix
descriptors, stages released back to the producer.  Several blocks, more k-steps than stages, ragged M, N
and K (TMA's out-of-bounds zero fill), K-major and M/N-major operands; the library gemm's thread-block
clusters (multicast TMA loads, stages released on every writer block, the cluster barrier).  Inputs are
multiples of 1/8 in [-2, 2], exact in float16, so the float32 accumulation is exact and C is the float64
reference rounded once: every element must match.  The instruction-level tests check the emulator's wgmma,
descriptor, TMA and mbarrier semantics against the PTX ISA's own tables and examples."""

from types import SimpleNamespace

import numpy as np
import pytest

from tile_ops.compiler.lower import lower
from tile_ops.compiler.meta import evaluate
from programs import matmul
from tile_ops.jit.emulator import (_PEER_SHIFT, Emulator, _Cta, _descriptor_addresses, _swizzled, _tma_box, _tma_box_store,
                          _wgmma)

HOPPER = dict(block_M=128, block_N=128, block_K=64, num_stages=3, threads=256)  # 2 consumer warpgroups


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path / "cache"))


def run_matmul_sm90(M, N, K, transpose_A=False, transpose_B=False, **tiles):
    """C = A @ B (float16) lowered for sm_90a, on the emulator: C, the float64 reference rounded once, the
    grid and the PTX that ran."""
    lk = lower(matmul.fn(M, N, K, transpose_A=transpose_A, transpose_B=transpose_B, **tiles), "sm_90a")
    rng = np.random.default_rng(M * N * K)
    a, b = (rng.integers(-16, 17, shape) / 8 for shape in ((M, K), (K, N)))
    A = (a.T.copy() if transpose_A else a).astype(np.float16)
    B = (b.T.copy() if transpose_B else b).astype(np.float16)
    C = np.full((M, N), np.nan, np.float16)  # written everywhere, or NaN shows
    emu = Emulator(lk.func, {"A": A, "B": B, "C": C}, tensormaps=lk.meta.tensormaps)
    emu.run(lk.meta.grid)
    return C, (a @ b).astype(np.float16), lk.meta.grid, emu.ran


@pytest.mark.parametrize("shape, kw, grid, ran", [
    pytest.param((256, 256, 256), HOPPER, (2, 2, 1),  # 4 k-steps over 3 stages
                 {"tma.load.2d.swizzle128", "mbarrier.arrive.expect_tx", "wgmma.m64n128k16.f16.trans-b"},
                 id="aligned-2-warpgroups"),
    pytest.param((200, 136, 200), HOPPER, (2, 2, 1),  # ragged: boxes past every edge, zero-filled
                 {"tma.load.2d.swizzle128", "wgmma.m64n128k16.f16.trans-b"}, id="ragged"),
    pytest.param((200, 72, 200), dict(HOPPER, block_N=64, threads=128, transpose_A=True, transpose_B=True),
                 (2, 2, 1), {"wgmma.m64n64k16.f16.trans-a"}, id="ragged-AtBt-M-major-A-K-major-B"),
])
def test_sm90_matmul_matches_numpy(shape, kw, grid, ran):
    C, ref, lk_grid, emu_ran = run_matmul_sm90(*shape, **kw)
    assert lk_grid == grid
    assert ran <= set(emu_ran), sorted(emu_ran)  # the PTX this case is for ran
    np.testing.assert_array_equal(C, ref)


def test_sm90_gemm_kernel_tma_store_epilogue_matches_numpy():
    """tile_ops.kernels.gemm with epilogue="shared": the accumulators go to a 128B-swizzled shared tile (named
    barriers between the consumer warps), then TMA stores (cp.async.bulk.tensor global <- shared, bulk groups
    waited for with .read) write C through its 3-d tensor map."""
    from tile_ops.kernels.gemm_config import GemmConfig

    C, ref, _, emu = run_library_gemm(256, 256, 256, GemmConfig(128, 128, 64, 3, 128, 8, epilogue="shared"), seed=3)
    assert {"tma.store.3d.swizzle128", "tma.load.3d.swizzle128"} <= set(emu.ran), sorted(emu.ran)
    np.testing.assert_array_equal(C, ref)


@pytest.mark.parametrize("shape, cluster_kw, grid, cluster_dims, ran", [
    # the library's 1000^3 sm_90a config: pairs of 64-row tiles of one N tile multicasting their B tile
    # halves; 2 clusters x 2 N tiles, 4 k-steps
    pytest.param((256, 256, 256), dict(num_stages=8, cluster=2), (4, 2, 1), (2, 1, 1),
                 {"tma.load.3d.swizzle128", "tma.load.3d.swizzle128.multicast"}, id="pairs-multicast-B"),
    # 2 x 2 clusters (A multicast along the cluster's N tiles too), ragged M, N, K, 3 k-steps over 2 stages
    pytest.param((100, 200, 136), dict(num_stages=2, cluster=2, cluster_n=2), (2, 2, 1), (2, 2, 1),
                 {"tma.load.3d.swizzle128.multicast"}, id="ragged-2x2-multicast-A-and-B-stages-wrap"),
])
def test_sm90_clustered_gemm_kernel_matches_numpy(shape, cluster_kw, grid, cluster_dims, ran):
    """tile_ops.kernels.gemm with thread-block clusters: each cluster's blocks run together (staggered: rank
    r every (r + 1)-th round), TMA loads with .multicast::cluster land in every block of the CTA mask and
    complete on each one's full barrier, the consumers release a stage on every block that writes into it
    (mapa + remote mbarrier.arrive), and the blocks meet at barrier.cluster.arrive/wait after the mbarrier
    inits."""
    C, ref, lk, emu = run_clustered_gemm(*shape, **cluster_kw)
    assert (lk.meta.grid, lk.meta.cluster_dims) == (grid, cluster_dims)
    assert ran | {"mbarrier.arrive.shared::cluster", "barrier.cluster.arrive", "barrier.cluster.wait",
                  "tma.store.3d.swizzle128"} <= set(emu.ran), sorted(emu.ran)
    np.testing.assert_array_equal(C, ref)


@pytest.mark.parametrize("operands", [{}, dict(trans_A=True, trans_B=True, bias=True)],
                         ids=["plain", "transposed-with-bias"])
def test_sm90_short_grid_default_in_128_deep_k_steps_matches_numpy(operands):
    """The library's default for short grids with K of 512-2048 (1000x700x1000): pairs of 64x128 tiles multicasting
    B, 128-deep k-steps (two 64-column boxes of each operand a stage) on 4 stages; ragged M and K, 5 k-steps,
    so the pipeline wraps, with the ranks run at different rates; A and B as stored or transposed, a bias."""
    from tile_ops.kernels.gemm_defaults import SM90A, default_config

    assert default_config(1000, 700, 1000, "sm_90a") == SM90A.half_wave_k128
    C, ref, lk, emu = run_library_gemm(200, 256, 600, SM90A.half_wave_k128, seed=11, stagger=True, **operands)
    assert (lk.meta.grid, lk.meta.cluster_dims) == ((4, 2, 1), (2, 1, 1))
    assert "tma.load.3d.swizzle128.multicast" in emu.ran, sorted(emu.ran)
    np.testing.assert_array_equal(C, ref)


def test_sm90_swapped_2x4_default_matches_numpy():
    """The default of short grids whose rows are not whole lines (1000^3): C^T = B^T A^T in 72x128 tiles, one
    2x4 cluster here (B's tile multicast along M, A's 72 rows in 18-row slices along N), each stage released
    on its 5 writers by lanes 0-4 of every consumer warp at once; ragged M and K, 10 k-steps on 8 stages, so
    the pipeline wraps, with the ranks run at different rates; a bias along C^T's rows."""
    from tile_ops.kernels.gemm_defaults import SM90A, default_config

    assert default_config(1000, 1000, 1000, "sm_90a") == SM90A.swapped_2x4
    C, ref, lk, emu = run_library_gemm(140, 512, 600, SM90A.swapped_2x4, seed=5, stagger=True, bias=True)
    assert (lk.meta.grid, lk.meta.cluster_dims) == ((2, 4, 1), (2, 4, 1))
    # each of 8 blocks: 8 consumer warps, 10 k-steps, an arrival on each of 5 writers
    assert emu.ran["mbarrier.arrive.shared::cluster"] == 8 * 8 * 10 * 5
    np.testing.assert_array_equal(C, ref)


def test_sm90_decode_default_reads_b_evict_first_matches_numpy():
    """The decode default (16x8192x8192: swapped 16x64 tiles, 16 stages) reads each of B's tiles once, with
    the L2 priority evict_first that a createpolicy makes (A, which every block reads, without); ragged M, N
    and K, 10 k-steps."""
    from tile_ops.kernels.gemm_defaults import default_config

    cfg = default_config(16, 8192, 8192, "sm_90a")
    assert cfg.swap_ab and cfg.b_evict_first
    C, ref, lk, emu = run_library_gemm(5, 200, 600, cfg, seed=7)
    assert emu.ran["tma.load.3d.swizzle128.evict_first"] == lk.meta.grid[0] * 10  # B: a box a k-step in each block
    assert emu.ran["tma.load.3d.swizzle128"] > 0  # A
    np.testing.assert_array_equal(C, ref)


def test_sm90_clustered_gemm_releasing_stages_only_locally_fails(monkeypatch):
    """A broken variant: consumers that release a stage only on their own block (the remote arrive lands on
    the local mbarrier) let a peer's multicast overwrite it before its wgmmas retire; with the blocks
    staggered the emulated result shows it."""
    def local_arrive(self, call, env):
        address, pred = (int(self._eval(a, env)) for a in call.args[1:3])
        if pred:  # the arrival counts on this block's mbarrier at the peer's offset
            self._mbarrier(address & ((1 << _PEER_SHIFT) - 1), arrivals=1)

    monkeypatch.setattr(Emulator, "_remote_arrive", local_arrive)
    C, ref, _, _ = run_clustered_gemm(100, 200, 136, num_stages=2, cluster=2, cluster_n=2)
    assert (C != ref).any()


def run_library_gemm(M, N, K, cfg, seed, stagger=False, ctas=None, workspace=None, trans_A=False, trans_B=False,
                     bias=False, runtime_m=None):
    """tile_ops.kernels.gemm with ``cfg`` lowered for sm_90a and run on the emulator (a cluster's blocks
    together, or with ``ctas`` (a persistent grid of that many CTAs) the whole grid; ``stagger``: see
    Emulator.run; ``workspace``: a stream-K kernel's, zeroed; A or B stored transposed, a bias row): C, the
    float64 reference rounded once, the lowered kernel and the emulator.  ``runtime_m``: the kernel takes M at
    run time, with these keyword arguments (one_wave, m_multiple)."""
    from tile_ops.kernels.gemm import gemm

    lk = lower(gemm.fn(None if runtime_m is not None else M, N, K, 1, 1, 1, trans_A, trans_B, bias, "float16",
                       "float16", cfg, **(runtime_m or {})), "sm_90a")
    if runtime_m is not None:  # the launch's view: the grid and the tensor maps at this M
        named = {"M": M}
        at = lambda values: [evaluate(v, named) for v in values]  # noqa: E731
        lk = lk._replace(meta=lk.meta.replace(grid=tuple(at(lk.meta.grid)), tensormaps={
            n: dict(t, dims=at(t["dims"]), strides=at(t["strides"])) for n, t in lk.meta.tensormaps.items()}))
    rng = np.random.default_rng(seed)
    a, b = (rng.integers(-16, 17, s) / 8 for s in ((M, K), (K, N)))
    bias_row = rng.integers(-16, 17, N) / 8 if bias else np.zeros(N)
    arrays = {"A": np.ascontiguousarray(a.T if trans_A else a).astype(np.float16)[None],
              "B": np.ascontiguousarray(b.T if trans_B else b).astype(np.float16)[None],
              "Bias": bias_row.astype(np.float16), "C": np.full((1, M, N), np.nan, np.float16),
              "tile_ops_workspace": workspace, "M": M}
    emu = Emulator(lk.func, arrays, tensormaps=lk.meta.tensormaps)
    emu.run(lk.meta.grid if ctas is None else (ctas, 1, 1), lk.meta.cluster_dims, stagger=stagger, resident=ctas is not None)
    return arrays["C"][0], (a @ b + bias_row).astype(np.float16), lk, emu


@pytest.mark.parametrize("M, cluster_kw, runtime_m", [
    (100, dict(cluster=2), dict(one_wave=True)),  # 2 M tiles, one cluster
    (40, dict(cluster=2), dict(one_wave=True)),  # the cluster's second M tile lies wholly past M
    (200, dict(cluster=2, cluster_n=2), dict(one_wave=True)),  # 4 M tiles rounded up to whole 2x2 clusters
])
def test_runtime_m_clustered_gemm_rounds_its_grid_to_whole_clusters(M, cluster_kw, runtime_m):
    """The library gemm with M at run time in clusters: the M tiles are rounded up to whole clusters; a block
    whose tile lies past M loads zeros, multicasts its share of B to its peers and stores nothing."""
    from tile_ops.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(64, 128, 64, threads=128, swizzle=8, epilogue="shared", **cluster_kw)
    C, ref, lk, emu = run_library_gemm(M, 256, 192, cfg, seed=M, stagger=True, runtime_m=runtime_m)
    assert lk.meta.grid[0] % cfg.cluster == 0 and "tma.load.3d.swizzle128.multicast" in emu.ran
    np.testing.assert_array_equal(C, ref)


def run_clustered_gemm(M, N, K, **cluster_kw):
    """tile_ops.kernels.gemm (64 x 128 x 64 tiles, one consumer warpgroup, TMA-store epilogue) with
    ``cluster_kw``, run staggered (``run_library_gemm``)."""
    from tile_ops.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(64, 128, 64, threads=128, swizzle=8, epilogue="shared", **cluster_kw)
    return run_library_gemm(M, N, K, cfg, seed=5, stagger=True)


def run_stream_k_gemm(stagger):
    """The stream-K gemm (64 x 64 tiles, up to 2 K parts) at 128 x 128 x 512 on a persistent grid of 3 CTAs:
    4 tiles leave one alone in the last wave, so it splits into two parts of 4 k-steps, CTA 0 writing its
    partial to the workspace and counting it on the tile's flag, CTA 1 waiting for the flag and adding it."""
    from tile_ops.kernels.gemm_config import GemmConfig

    ws = np.zeros(4096 + 3 * 64 * 64, np.float32)
    C, ref, lk, emu = run_library_gemm(128, 128, 512, GemmConfig(64, 64, 64, 3, 128, stream_k=2), seed=7,
                                       stagger=stagger, ctas=3, workspace=ws)
    return C, ref, emu, ws


def test_sm90_stream_k_gemm_matches_numpy():
    """The writer (CTA 0) runs three times slower than the owner (CTA 1), which must wait for the partial; the
    flags are zero at the end, as the next launch sharing the workspace needs them."""
    C, ref, emu, ws = run_stream_k_gemm(stagger=(3, 1, 1))
    assert {"tile_ops_flag_signal", "tile_ops_flag_wait"} <= set(emu.ran), sorted(emu.ran)
    np.testing.assert_array_equal(C, ref)
    assert not ws[:4096].view(np.int32).any()


def test_sm90_stream_k_gemm_without_the_flag_wait_fails(monkeypatch):
    """A broken variant: the owner adds the workspace slot without waiting for the writer's flag."""
    flag = Emulator._flag

    def no_wait(self, call, env):
        if call.args[0].value != "tile_ops_flag_wait":
            yield from flag(self, call, env)

    monkeypatch.setattr(Emulator, "_flag", no_wait)
    C, ref, _, _ = run_stream_k_gemm(stagger=(3, 1, 1))
    assert (C != ref).any()


# ---------------------------------------------------------------- instructions, against the PTX ISA


def _descriptor(start, lbo, sbo, mode):
    """A wgmma matrix descriptor (PTX ISA "Matrix Descriptor Format"): (x & 0x3FFFF) >> 4 of the start address,
    LBO and SBO in bits 0-13, 16-29, 32-45; the swizzle mode in bits 62-63."""
    enc = lambda x: (x & 0x3FFFF) >> 4  # noqa: E731
    return enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | mode << 62


def _cute(shape, stride, coord):
    """A CuTe layout's offset of a flat index along each mode (colexicographic), as the ISA writes them."""
    off = 0
    for s, d in zip(shape, stride):
        off, coord = off + (coord % s) * d, coord // s
    return off


def _swizzle(byte, bits):
    """CuTe's Swizzle<bits, 4, 3> on a byte offset."""
    return byte ^ (((byte >> 7) & ((1 << bits) - 1)) << 4)


@pytest.mark.parametrize("mn_major, mode, rows, layout, lbo, sbo, bits", [
    # the ISA's examples ("Canonical Layouts"), bf16, exact layouts in elements:
    (True, 2, 64, (((8, 4, 2), (1, 8, 256)), ((8, 2), (32, 512))), 256 * 2, 512 * 2, 2),  # MN-major 64B
    (True, 3, 32, (((8, 2, 2), (1, 8, 128)), ((8, 2), (16, 256))), 128 * 2, 256 * 2, 1),  # MN-major 32B
    (True, 0, 16, (((8, 1, 2), (1, 8, 64)), ((8, 2), (8, 128))), 128 * 2, 64 * 2, 0),  # MN-major none
    # the canonical forms with T = 8: K-major 128B ((8,m),(T,2k)):((8T,SBO),(1,T)); MN-major 128B
    # ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) (SBO, LBO in elements here)
    (False, 1, 64, (((8, 8), (64, 512)), ((8, 2), (1, 8))), 16, 1024, 3),
    (True, 1, 128, (((8, 8, 2), (1, 8, 4096)), ((8, 2), (64, 512))), 8192, 1024, 3),
])
def test_descriptor_addresses_follow_the_ptx_canonical_layouts(mn_major, mode, rows, layout, lbo, sbo, bits):
    (mn_shape, mn_stride), (k_shape, k_stride) = layout
    start = 3 * 1024  # a swizzle-atom-aligned start
    got = _descriptor_addresses(_descriptor(start, lbo, sbo, mode), rows, mn_major)
    for mn in range(rows):
        for k in range(16):
            elem = _cute(mn_shape, mn_stride, mn) + _cute(k_shape, k_stride, k)
            assert got[mn, k] == _swizzle(start + 2 * elem, bits), (mn, k)


def test_descriptor_k_steps_move_the_start_inside_the_swizzle_atom():
    """A k16 step of a K-major 128B tile adds 32 bytes to the start: the swizzle (on address bits) then
    reads columns 16..31 of the rows as TMA stored them."""
    base = _descriptor_addresses(_descriptor(0, 16, 1024, 1), 64, False)
    step = _descriptor_addresses(_descriptor(32, 16, 1024, 1), 64, False)
    unswizzled = lambda r, col: r // 8 * 1024 + r % 8 * 128 + 2 * col  # noqa: E731  row-major 64 columns
    for r in range(64):
        assert list(step[r]) == [_swizzled(unswizzled(r, 16 + k), 128) for k in range(16)]
        assert list(base[r]) == [_swizzled(unswizzled(r, k), 128) for k in range(16)]


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (0, 1), (1, 1)])
def test_wgmma_follows_the_ptx_accumulator_layout(trans_a, trans_b):
    """wgmma m64n16k16 from swizzled shared tiles: thread t = 32w + l's register d[4j + e] is
    D[16w + l/4 + 8(e/2), 8j + 2(l%4) + e%2] (the ISA's m64nNk16 D figure); scale-d keeps D, scale-a -1
    negates A."""
    rng = np.random.default_rng(2)
    A, B = rng.integers(-8, 9, (64, 16)).astype(np.float16), rng.integers(-8, 9, (16, 16)).astype(np.float16)
    C = rng.integers(-8, 9, (64, 16)).astype(np.float32)
    smem = np.full(16384, 0xFF, np.uint8)

    def store(at, m, mn_major):  # a 128B-swizzled tile: rows of 64 elements, as TMA lays a box out
        tile = np.zeros((64 if mn_major else m.shape[0], 64), np.float16)
        src = m.T if mn_major else m  # (rows, cols): K-major rows are M/N, MN-major rows are K
        tile[:src.shape[0], :src.shape[1]] = src
        for r in range(tile.shape[0]):
            for c in range(8):
                d = _swizzled(at + r * 128 + c * 16, 128)
                smem[d:d + 16] = tile[r, 8 * c:8 * c + 8].view(np.uint8)

    store(0, A, trans_a)  # A: M x K
    store(8192, B.T, trans_b)  # B as N x K
    regs = []
    for t in range(128):
        w, lane = divmod(t, 32)
        rows = [16 * w + lane // 4 + 8 * (e // 2) for j in range(2) for e in range(4)]
        cols = [8 * j + 2 * (lane % 4) + e % 2 for j in range(2) for e in range(4)]
        regs.append((C[rows, cols].copy(), np.arange(8), rows, cols))
    lbo, sbo = 8192, 1024  # MN-major: panels of 64 M/N apart (one here); 8-row groups of 128B rows
    key = ((16, "f16"), _descriptor(0, lbo, sbo, 1), _descriptor(8192, lbo, sbo, 1), 1, -1, 1, trans_a, trans_b)
    _wgmma(smem, key, [(r, i) for r, i, _, _ in regs])
    D = -A.astype(np.float64) @ B.astype(np.float64) + C
    for d, _, rows, cols in regs:
        assert list(d) == list(D[rows, cols])


def test_tma_box_zero_fills_out_of_bounds():
    """A 2-D box (inner dim first) at coordinates partly outside the tensor: those elements read as 0."""
    T = np.arange(1, 5 * 24 + 1, dtype=np.float16).reshape(5, 24)  # 24 columns: 48-byte rows, but the
    spec = dict(dtype="float16", dims=[20, 5], strides=[48], box=[8, 4], element_strides=[1, 1],  # map says 20
                swizzle=3, oob_fill=0)
    box = _tma_box(spec, T, [16, 3]).view(np.float16).reshape(4, 8)
    want = np.zeros((4, 8), np.float16)
    want[:2, :4] = T[3:5, 16:20]
    np.testing.assert_array_equal(box, want)


def test_tma_box_store_drops_out_of_bounds():
    """A TMA store's box partly outside the tensor: only its in-bounds elements are written."""
    T = np.zeros((5, 24), np.float16)
    spec = dict(dtype="float16", dims=[20, 5], strides=[48], box=[8, 4], element_strides=[1, 1], swizzle=3,
                oob_fill=0)
    _tma_box_store(spec, T, [16, 3], np.arange(1, 33, dtype=np.float16))
    want = np.zeros((5, 24), np.float16)
    want[3:5, 16:20] = np.arange(1, 33, dtype=np.float16).reshape(4, 8)[:2, :4]
    np.testing.assert_array_equal(T, want)


def test_mbarrier_phases_and_transaction_counts():
    """init(2); a phase completes when both arrivals are in and the expected bytes have landed; wait(parity p)
    passes once the phase of parity p is over (a fresh barrier's 'previous' phase, parity 1, is)."""
    emu = Emulator.__new__(Emulator)
    emu.block, emu.mbarriers = (0, 0, 0), {}
    emu._mbarrier_init(64, 2)
    assert emu._phase_done(64, 1) and not emu._phase_done(64, 0)
    emu._mbarrier(64, arrivals=1, tx=256)  # arrive.expect_tx
    emu._mbarrier(64, arrivals=1)
    assert not emu._phase_done(64, 0)  # 256 bytes outstanding
    emu._mbarrier(64, tx=-256)  # complete_tx
    assert emu._phase_done(64, 0) and not emu._phase_done(64, 1)
    emu._mbarrier(64, arrivals=2)
    assert emu._phase_done(64, 1) and not emu._phase_done(64, 0)
    with pytest.raises(RuntimeError, match="more arrivals"):
        emu._mbarrier(64, arrivals=3)


def cluster_emulator(blocks, arena, bar, tx):
    """An emulator holding one cluster of ``blocks`` blocks, each with an ``arena``-byte shared arena of 0xFF and
    an mbarrier at byte ``bar`` whose one arrival has come (arrive.expect_tx) and that awaits ``tx`` bytes."""
    emu, cluster = Emulator.__new__(Emulator), []
    emu.ctas = [_Cta((i, 0, 0), i, cluster) for i in range(blocks)]
    for cta in emu.ctas:
        emu._enter(cta)
        cta.smem = emu.smem = np.full(arena, 0xFF, np.uint8)
        emu._mbarrier_init(bar, 1)
        emu._mbarrier(bar, arrivals=1, tx=tx)
    return emu


def test_multicast_tma_lands_in_every_block_of_the_mask():
    """A .multicast::cluster TMA box lands at the same (swizzled) shared offset in each block of the CTA
    mask and completes its bytes on each one's mbarrier at the same offset; a block outside the mask sees
    nothing; a remote arrive on a block that has exited raises."""
    emu = cluster_emulator(3, arena=4096, bar=2048, tx=1024)
    data = np.arange(1024, dtype=np.uint16).astype(np.uint8)
    emu.tma, emu.stores = [([emu.ctas[0], emu.ctas[2]], 0, data, 128, 2048)], []  # ctaMask 0b101
    emu._land_tma()
    addrs = _swizzled(np.arange(0, 1024, 16), 128)
    for cta, landed in zip(emu.ctas, (True, False, True)):
        got = cta.smem[addrs[:, None] + np.arange(16)].reshape(-1)
        assert (got == data).all() if landed else (cta.smem[:1024] == 0xFF).all()
        assert (cta.mbarriers[2048]["phase"] == 1) == landed
    emu.ctas[1].done = True
    emu.tma = [([emu.ctas[1]], 0, data, 128, 2048)]
    with pytest.raises(RuntimeError, match="after it exited"):
        emu._land_tma()


def test_st_async_lands_in_the_peer_at_the_round_end():
    """st.async (tile_ops_cluster_put) writes into the peer's shared memory only when the round's stores land,
    then completes its bytes on the peer's mbarrier at the same offset; nothing reaches the sender."""
    emu = cluster_emulator(2, arena=256, bar=128, tx=8)  # the bytes of one v2.f32
    data = np.array([1.5, -2.0], np.float32).view(np.uint8)
    emu.tma, emu.stores = [], [(emu.ctas[1], 16, data, 128)]
    assert np.isnan(emu.ctas[1].smem[16:24].view(np.float32)).all()  # not yet
    emu._land_tma()
    assert emu.ctas[1].smem[16:24].view(np.float32).tolist() == [1.5, -2.0]
    assert emu.ctas[1].mbarriers[128]["phase"] == 1 and emu.ctas[0].mbarriers[128]["phase"] == 0
    assert (emu.ctas[0].smem == 0xFF).all()


def test_integer_division_truncates_toward_zero():
    """TIR's truncdiv/truncmod are C's / and % (the persistent loops' tile counts use them); floordiv and
    floormod round down."""
    from tvm import tirx

    emu, x = Emulator.__new__(Emulator), tirx.Var("x", "int32")
    env = {x.__chandle__(): -7}
    assert [emu._eval(e, env) for e in (tirx.truncdiv(x, 3), tirx.truncmod(x, 3))] == [-2, -1]
    assert [emu._eval(e, env) for e in (tirx.floordiv(x, 3), tirx.floormod(x, 3))] == [-3, 2]


def test_sm90_epilogue_over_the_dead_stages_matches_numpy():
    """One wave, two consumer warpgroups, 2 stages over 3 k-steps (the last in stage 0), pairs of blocks
    multicasting B, run staggered (a peer's producer writes into this block's stages early): the bias and
    output tiles lie over the stages (Lowerer._epilogue_overlay) and C is exact.  (The
    emulator steps a block's warpgroups together, so the barrier that keeps one warpgroup's epilogue writes
    after the other's last wgmma reads is checked in the CUDA source: test_compiler's
    test_epilogue_tiles_lie_over_the_dead_stages_where_each_cta_runs_one_tile.)"""
    from tile_ops.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(128, 128, 64, 2, 256, 0, epilogue="shared", cluster=2)
    C, ref, lk, emu = run_library_gemm(256, 256, 192, cfg, seed=7, stagger=True, bias=True)
    stages = 2 * (128 * 64 + 64 * 128) * 2
    assert lk.meta.smem_bytes < stages + 1024 and "C_tmap" in lk.meta.tensormaps  # the 32 KiB output tile inside them
    np.testing.assert_array_equal(C, ref)
