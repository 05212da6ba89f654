"""tile_ops.jit.kernel: KernelMeta's JSON form (with and without TMA descriptors) and the CUDA entry's
argument list built from program pointers (checked with fake pointers and a fake encoder; no GPU)."""

import ctypes.util
import json

import pytest

from tile_ops.jit import _load_or_build
from tile_ops.jit.cache import CacheEntry, DiskCache
from tile_ops.compiler.meta import KernelMeta
from tile_ops.jit.kernel import EntryArgs, Kernel

A_TMAP = {"tensor": "A", "dtype": "float16", "dims": [64, 256], "strides": [128], "box": [64, 128],
          "element_strides": [1, 1], "swizzle": 3, "l2_promotion": 2, "oob_fill": 0}


def _meta(kept=("A_tmap", "B", "C"), tensormaps=None):
    return KernelMeta(
        name="gemm", entry="gemm_kernel", arch="sm_90a", grid=(2, 1, 1), block=(384, 1, 1), smem_bytes=99328,
        params=[("A", (256, 64), "float16"), ("B", (64, 128), "float16"), ("C", (256, 128), "float16")],
        kept=list(kept), out_idx=[2], resources={"registers": 168}, layouts={},
        tensormaps={"A_tmap": A_TMAP} if tensormaps is None else tensormaps)


def fake_descriptor(ptr):
    return b"D" + ptr.to_bytes(8, "little") + bytes(119)


class FakeEncoder:
    """Stands in for the launcher's encode_tensor_map (same signature) and records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, dtype, ptr, dims, strides, box, element_strides, swizzle, *, l2_promotion, oob_fill, device):
        self.calls.append((dtype, ptr, dims, strides, box, element_strides, swizzle, l2_promotion, oob_fill, device))
        return fake_descriptor(ptr)


def test_meta_json_round_trip_keeps_tensormaps():
    meta = _meta()
    loaded = KernelMeta.from_json(json.loads(json.dumps(meta.to_json())))
    assert loaded == meta
    assert loaded.tensormaps == {"A_tmap": A_TMAP}


def test_meta_from_an_old_cache_entry_has_no_tensormaps():
    old = _meta(kept=("A", "B", "C"), tensormaps={}).to_json()
    del old["tensormaps"]
    assert KernelMeta.from_json(json.loads(json.dumps(old))).tensormaps == {}


def test_old_disk_cache_entry_loads_as_a_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TILE_OPS_CACHE_DIR", str(tmp_path))
    key = "cd" + "0" * 30
    old = _meta(kept=("A", "B", "C"), tensormaps={}).to_json()
    del old["tensormaps"]
    DiskCache().store(key, CacheEntry("// source", b"cubin", {**old, "lower_s": 0.1, "nvcc": "12.8"}))
    kernel = _load_or_build(key, lambda: pytest.fail("a cache hit must not trace"), "sm_90a", [2])
    assert isinstance(kernel, Kernel) and kernel.meta.tensormaps == {} and kernel.meta.kept == ["A", "B", "C"]


def test_entry_args_without_tensormaps_are_the_kept_pointers_in_entry_order():
    meta = _meta(kept=("A", "C"), tensormaps={})  # TVM dropped B, which the kernel never reads
    assert EntryArgs(meta, encode=FakeEncoder()).build([0x100, 0x200, 0x300], device=0) == [0x100, 0x300]


def test_entry_args_pass_the_descriptor_of_the_named_tensor():
    enc = FakeEncoder()
    args = EntryArgs(_meta(), encode=enc)
    assert args.build([0x1000, 0x2000, 0x3000], device=1) == [fake_descriptor(0x1000), 0x2000, 0x3000]
    assert enc.calls == [("float16", 0x1000, [64, 256], [128], [64, 128], [1, 1], 3, 2, 0, 1)]


def test_entry_args_encode_once_per_pointer():
    enc = FakeEncoder()
    args = EntryArgs(_meta(), encode=enc)
    first = args.build([0x1000, 0x2000, 0x3000], device=0)
    assert args.build([0x1000, 0x2400, 0x3400], device=0)[0] is first[0]  # same A buffer: cached
    assert [c[1] for c in enc.calls] == [0x1000]
    args.build([0x5000, 0x2000, 0x3000], device=0)
    assert [c[1] for c in enc.calls] == [0x1000, 0x5000]


def test_entry_args_descriptor_cache_stays_small():
    enc = FakeEncoder()
    args = EntryArgs(_meta(), encode=enc)
    for i in range(1000):
        args.build([0x10000 + 256 * i, 0x2000, 0x3000], device=0)
    assert len(args._descriptors) <= EntryArgs._MAX_DESCRIPTORS


def test_two_tensormaps_of_one_tensor_are_cached_apart():
    a_store = {**A_TMAP, "box": [64, 64]}
    enc = FakeEncoder()
    args = EntryArgs(_meta(kept=("A_tmap", "A_store", "B", "C"), tensormaps={"A_tmap": A_TMAP, "A_store": a_store}),
                     encode=enc)
    args.build([0x1000, 0x2000, 0x3000], device=0)
    assert [(c[1], c[4]) for c in enc.calls] == [(0x1000, [64, 128]), (0x1000, [64, 64])]


def test_tensormap_of_an_unknown_tensor_is_rejected_at_load():
    with pytest.raises(ValueError, match=r"gemm: the CUDA entry parameter A_tmap needs the pointer of X, "
                                         r"which is not a parameter \(A, B, C\)"):
        EntryArgs(_meta(tensormaps={"A_tmap": {**A_TMAP, "tensor": "X"}}))


def test_kept_name_that_is_neither_param_nor_tensormap_is_rejected():
    with pytest.raises(ValueError, match="gemm: the CUDA entry parameter A_tmap needs the pointer of A_tmap"):
        Kernel(_meta(tensormaps={}), "// source", b"cubin")


def test_incomplete_tensormap_spec_is_rejected():
    spec = {k: v for k, v in A_TMAP.items() if k not in ("box", "swizzle")}
    with pytest.raises(ValueError, match="gemm: tensormap A_tmap lacks box, swizzle"):
        Kernel(_meta(tensormaps={"A_tmap": spec}), "// source", b"cubin")


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_entry_args_call_the_launchers_encoder_with_its_signature():
    args = EntryArgs(_meta())  # looks up get_launcher().encode_tensor_map on first use
    with pytest.raises(RuntimeError, match="libcuda"):  # past argument binding, as far as the (missing) driver
        args.build([0x1000, 0x2000, 0x3000], device=0)


class _FakeFunction:
    def __init__(self, clusters):
        self.clusters, self.calls = clusters, []

    def max_active_clusters(self, device, cluster, block_threads):
        self.calls.append((device, cluster, block_threads))
        return self.clusters


def _persistent(cluster=1, tiles=512, ctas_per_sm=1, grid=(132, 1, 1)):
    import dataclasses

    return Kernel(dataclasses.replace(_meta(), grid=grid, cluster=cluster, persistent_tiles=tiles,
                                      ctas_per_sm=ctas_per_sm), "", b"")


def test_persistent_clustered_grid_is_the_clusters_that_fit(monkeypatch):
    """A persistent kernel in clusters of 8 launches the clusters the device holds at once (15 on a GPU
    whose GPCs cannot all take two), never more CTAs than tiles; asked once per device."""
    k = _persistent(cluster=8, grid=(128, 1, 1))
    k._function = fn = _FakeFunction(15)
    assert k.grid_on(0) == (120, 1, 1) and k.grid_on(0) == (120, 1, 1) and fn.calls == [(0, 8, 384)]
    small = _persistent(cluster=8, tiles=64, grid=(64, 1, 1))
    small._function = _FakeFunction(15)
    assert small.grid_on(0) == (64, 1, 1)
    unknown = _persistent(cluster=8, grid=(128, 1, 1))
    unknown._function = _FakeFunction(-1)  # a driver without cuOccupancyMaxActiveClusters
    assert unknown.grid_on(0) == (128, 1, 1)


def test_persistent_grid_follows_the_sm_count(monkeypatch):
    """One CTA per SM (or two) of the device it runs on: a 114-SM H100 PCIe must not get the H200's 132
    (18 CTAs would run a second wave of everything they own)."""
    import importlib

    kernel_mod = importlib.import_module("tile_ops.jit.kernel")

    monkeypatch.setattr(kernel_mod, "_sm_count", lambda index: 114)
    assert _persistent().grid_on(0) == (114, 1, 1)
    assert _persistent(ctas_per_sm=2).grid_on(0) == (228, 1, 1)
    assert _persistent(tiles=100).grid_on(0) == (100, 1, 1)
    monkeypatch.setattr(kernel_mod, "_sm_count", lambda index: None)  # no CUDA torch: the compile-time grid
    assert _persistent().grid_on(0) == (132, 1, 1)
    plain = Kernel(_meta(), "", b"")
    assert plain.grid_on(0) == (2, 1, 1)  # not persistent: the program's grid


class _LaunchRecorder:
    """Stands in for a Kernel's CudaFunction: ``bind`` hands out a launch that records (handle, stream, args)."""

    smem_bytes, name = 0, "k_kernel"

    def __init__(self):
        self.launches = []

    def bind(self, index):
        return (lambda handle, grid, block, smem, stream, args, name: self.launches.append((handle, stream, args)),
                100 + index)


def _cuda_like(shape, dtype="float16"):
    """A CPU tensor that says it is on cuda:0: what Kernel.launch reads of a CUDA tensor, on a CPU-only torch."""
    import torch

    class CudaLike(torch.Tensor):
        device = torch.device("cuda", 0)

    return torch.zeros(shape, dtype=getattr(torch, dtype)).as_subclass(CudaLike)


@pytest.fixture
def launching_kernel(monkeypatch):
    """A kernel of gemm's three parameters (no tensormaps) launching into a recorder, on a fake stream per device."""
    import importlib

    monkeypatch.setattr(importlib.import_module("tile_ops.jit.kernel"), "_current_stream_getter",
                        lambda: lambda index: 1000 + index)
    k = Kernel(_meta(kept=("A", "B", "C"), tensormaps={}), "", b"")
    k._function = _LaunchRecorder()
    return k


@pytest.mark.parametrize("count", [0, 2, 4])
def test_launch_takes_one_tensor_per_parameter(launching_kernel, count):
    """Missing tensors were a bare IndexError (or, with none, an AttributeError); an extra one (here on the CPU)
    was ignored unchecked."""
    import torch

    tensors = [_cuda_like(shape, dtype) for _, shape, dtype in launching_kernel.meta.params]
    with pytest.raises(TypeError, match=r"gemm.launch takes 3 tensors, one per parameter \(A, B, C\), got " + str(count)):
        launching_kernel.launch(*(tensors + [torch.zeros(3)])[:count])
    launching_kernel.launch(*tensors)
    assert launching_kernel._function.launches == [(100, 1000, [t.data_ptr() for t in tensors])]


def test_call_with_a_non_tensor_says_which(launching_kernel):
    with pytest.raises(TypeError, match="gemm: parameter A must be a torch.Tensor, got list"):
        launching_kernel([[1.0]], _cuda_like((64, 128)))


def test_launcher_of_the_current_device_follows_it(launching_kernel, monkeypatch):
    """torch.device("cuda") means the current device: bound once under that name, every later launch went to the
    device current at the first one (its function and stream, with another device's pointers)."""
    import torch

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    launching_kernel.launch_ptrs([0x10, 0x20, 0x30], torch.device("cuda"))
    current[0] = 1
    launching_kernel.launch_ptrs([0x40, 0x50, 0x60], torch.device("cuda"))
    launching_kernel.launch_ptrs([0x70, 0x80, 0x90], torch.device("cuda", 0))
    assert launching_kernel._function.launches == [(100, 1000, [0x10, 0x20, 0x30]), (101, 1001, [0x40, 0x50, 0x60]),
                                                   (100, 1000, [0x70, 0x80, 0x90])]
