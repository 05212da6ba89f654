"""tile_ops._C / tile_ops.jit.launcher: builds and imports without a GPU, reports a missing driver
cleanly, marshals launches correctly (checked against a fake libcuda on CPU machines), and runs
a real cubin on a GPU."""

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from tile_ops.jit import launcher as launcher_mod
from tile_ops.jit.launcher import CudaFunction, get_launcher

HAS_REAL_DRIVER = ctypes.util.find_library("cuda") is not None


@pytest.fixture(scope="module")
def lib():
    return get_launcher()


def test_extension_builds_and_imports(lib):
    assert get_launcher() is lib  # cached per process
    assert lib.API_VERSION == launcher_mod.API_VERSION
    for name in ("load_module", "get_function", "launch", "unload_module", "driver_available", "encode_tensor_map",
                 "plans_configure", "plans_record", "plans_call", "plans_clear", "plans_size"):
        assert callable(getattr(lib, name))
    assert all(source.is_file() for source in launcher_mod.launcher_sources())


def test_driver_available_matches_machine(lib):
    if torch.cuda.is_available():
        assert lib.driver_available() is True
    elif not HAS_REAL_DRIVER:
        assert lib.driver_available() is False


@pytest.mark.skipif(HAS_REAL_DRIVER, reason="a CUDA driver is installed here")
def test_missing_driver_raises_clean_error(lib):
    expected = r"tile_ops: the CUDA driver \(libcuda\.so\.1\) could not be loaded: .*launching kernels needs an NVIDIA GPU"
    with pytest.raises(RuntimeError, match=expected):
        lib.load_module(b"junk", 0)
    with pytest.raises(RuntimeError, match="libcuda"):  # the failure is sticky, never a crash
        lib.load_module(b"junk", 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        lib.launch(1, (1, 1, 1), (1, 1, 1), 0, 0, [0], "k")
    with pytest.raises(RuntimeError, match="libcuda"):
        CudaFunction(b"junk", "k", 0).launch((1, 1, 1), (32, 1, 1), [0], 0, 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        lib.launch(1, (1, 1, 1), (1, 1, 1), 0, 0, [0, bytes(128)], "k")
    with pytest.raises(RuntimeError, match="libcuda"):  # a valid spec gets as far as the driver
        lib.encode_tensor_map(**VALID_TMAP)


# -- TMA descriptors and by-value arguments: checked before the driver is needed -------------

# fp16 (128 rows, 64 cols) row-major, 64x64 boxes with the 128B swizzle
VALID_TMAP = dict(dtype="float16", global_address=0x10000, dims=[64, 128], strides_bytes=[128], box=[64, 64],
                  element_strides=[1, 1], swizzle=3)


@pytest.mark.parametrize("change, message", [
    (dict(dtype="half"),
     "dtype 'half' is not supported (accepted: float16, bfloat16, float32, float64, int8, uint8, int32)"),
    (dict(dims=[]), "dims has length 0; the rank must be 1..5"),
    (dict(dims=[2] * 6), "dims has length 6; the rank must be 1..5"),
    (dict(strides_bytes=[]), "strides_bytes has length 0, want 1 (the byte strides of dims 1..rank-1"),
    (dict(box=[64]), "box has length 1, want 2 (one per dim)"),
    (dict(element_strides=[1, 1, 1]), "element_strides has length 3, want 2"),
    (dict(global_address=0x10008), "global_address 0x10008 must be 16-byte aligned"),
    (dict(dims=[0, 128]), "dims[0] = 0 is out of range: each must be in 1..4294967296"),
    (dict(strides_bytes=[64 * 2 + 8]), "strides_bytes[0] = 136 must be a positive multiple of 16 bytes below 2^40"),
    (dict(strides_bytes=[0]), "strides_bytes[0] = 0 must be a positive multiple of 16"),
    (dict(strides_bytes=[1 << 40]), "below 2^40"),
    (dict(box=[64, 257]), "box[1] = 257 is out of range: each must be in 1..256"),
    (dict(box=[0, 64]), "box[0] = 0 is out of range"),
    (dict(element_strides=[1, 9]), "element_strides[1] = 9 is out of range: each must be in 1..8"),
    (dict(box=[4, 64], swizzle=0), "the inner box row, box[0] * 2 = 8 bytes, must be a multiple of 16 bytes"),
    (dict(dims=[128, 128], strides_bytes=[256], box=[128, 64]),
     "the inner box row, box[0] * 2 = 256 bytes, must be <= the swizzle span of 128 bytes (swizzle = 3)"),
    (dict(box=[32, 64], swizzle=1), "box[0] * 2 = 64 bytes, must be <= the swizzle span of 32 bytes (swizzle = 1)"),
    (dict(swizzle=4), "swizzle = 4 is not accepted: use 0 (none), 1 (32B), 2 (64B) or 3 (128B)"),
    (dict(interleave=3), "interleave = 3 is not accepted: use 0 (none), 1 (16B) or 2 (32B)"),
    (dict(interleave=1), "interleave != 0 needs rank >= 3"),
    (dict(dims=[8, 4, 4], strides_bytes=[32, 128], box=[8, 4, 4], element_strides=[1, 1, 1], interleave=2),
     "interleave = 2 (32B) needs swizzle = 1 (32B)"),
    (dict(l2_promotion=4), "l2_promotion = 4 is not accepted: use 0 (none), 1 (64B), 2 (128B) or 3 (256B)"),
    (dict(oob_fill=2), "oob_fill = 2 is not accepted: use 0 (zeros) or 1 (NaN, floating-point dtypes only)"),
    (dict(dtype="int32", dims=[32, 128], box=[32, 64], oob_fill=1),
     "oob_fill = 1 (NaN) needs a floating-point dtype, got int32"),
    (dict(device=-1), "device must be >= 0 (or None for the current context)"),
])
def test_encode_tensor_map_rejects_bad_specs_before_the_driver(lib, change, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        lib.encode_tensor_map(**{**VALID_TMAP, **change})
    assert str(error.value).startswith("tile_ops: encode_tensor_map: ")


@pytest.mark.parametrize("args, message", [
    ([1, "x"], "argument 1 of kernel 'k' must be an int (a pointer or 64-bit value) or non-empty bytes "
               "(passed by value, e.g. a CUtensorMap), got str"),
    ([b"", 1], "argument 0 of kernel 'k' must be an int"),
    ([bytearray(8)], "got bytearray"),
    # a descriptor passed as the whole list iterated into one int argument per byte (the fake kernel crashed)
    pytest.param(bytes(128), "args must be a tuple or list of ints and bytes, got bytes", id="a descriptor"),
    ({0: 1}, "args must be a tuple or list of ints and bytes, got dict"),
])
def test_launch_rejects_args_that_are_not_ints_or_bytes(lib, args, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        lib.launch(1, (1, 1, 1), (1, 1, 1), 0, 0, args, "k")


@pytest.mark.parametrize("grid, args, error, message", [  # were bare OverflowErrors and TypeErrors naming nothing
    ((1, 1, 1), [1, -1], ValueError, "argument 1 of kernel 'k' = -1 is out of range 0..18446744073709551615"),
    ((1, 1, 1), [2**64], ValueError, "argument 0 of kernel 'k' = 18446744073709551616 is out of range"),
    ((1, -1, 1), [1], ValueError, "grid[1] = -1 is out of range 0..4294967295"),
    ((2**32, 1, 1), [1], ValueError, "grid[0] = 4294967296 is out of range 0..4294967295"),
    ((1, 1, 4.0), [1], TypeError, "grid[2] must be an int, got float"),
    (5, [1], TypeError, "grid must be a tuple or list of 3 ints (x, y, z), got int"),
    ("abc", [1], TypeError, "grid must be a tuple or list of 3 ints (x, y, z), got str"),
])
def test_launch_names_a_bad_grid_or_int_argument(lib, grid, args, error, message):
    with pytest.raises(error, match=re.escape("tile_ops: launch: " + message)):
        lib.launch(1, grid, (1, 1, 1), 0, 0, args, "k")


# -- CudaFunction bookkeeping, with a pure-Python stand-in for the extension -----------------

class _FakeLib:
    def __init__(self):
        self.calls = []

    def load_module(self, cubin, device):
        self.calls.append(("load_module", device))
        return 1000 + device

    def get_function(self, module, name, smem, programmatic=False):
        self.calls.append(("get_function", module, name, smem) + (("programmatic",) if programmatic else ()))
        return 2000 + module

    def launch(self, fn, grid, block, smem, stream, args, name):
        self.calls.append(("launch", fn, tuple(grid), tuple(block), smem, stream, tuple(args), name))

    def unload_module(self, module):
        self.calls.append(("unload_module", module))


def test_cuda_function_loads_lazily_once_per_device(monkeypatch):
    fake = _FakeLib()
    monkeypatch.setattr(launcher_mod, "_launcher", fake)
    f = CudaFunction(b"cubin", "gemm_kernel", 64 * 1024)
    assert fake.calls == []
    f.launch((4, 1, 1), (128, 1, 1), [11, 22], 7, 0)
    f.launch((4, 1, 1), (128, 1, 1), [33], 7, 0)
    f.launch((1, 1, 1), (32, 1, 1), [44], 9, 1)
    assert fake.calls == [
        ("load_module", 0), ("get_function", 1000, "gemm_kernel", 65536),
        ("launch", 3000, (4, 1, 1), (128, 1, 1), 65536, 7, (11, 22), "gemm_kernel"),
        ("launch", 3000, (4, 1, 1), (128, 1, 1), 65536, 7, (33,), "gemm_kernel"),
        ("load_module", 1), ("get_function", 1001, "gemm_kernel", 65536),
        ("launch", 3001, (1, 1, 1), (32, 1, 1), 65536, 9, (44,), "gemm_kernel"),
    ]
    fake.calls.clear()
    f.unload()
    assert sorted(fake.calls) == [("unload_module", 1000), ("unload_module", 1001)]


# -- the real extension against a fake libcuda.so.1 (runs on any machine with a C compiler) ---

FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
struct fn { void* ctx; int max_smem; int takes_tmap; };
struct mod { void* ctx; int n; struct fn fns[8]; struct mod* next_free; };
/* functions live in their module, and an unloaded module's memory is the next one loaded: a module loaded
   after an unload hands out the same function addresses, as the real driver may */
static struct mod* free_mods = 0;
static __thread void* cur_ctx = 0;
static int last_programmatic = -1;  /* 1: the last launch came through cuLaunchKernelEx with the attribute */
int tile_ops_fake_last_programmatic(void) { return last_programmatic; }
int tile_ops_fake_driver(void) { return 1; }
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { if (ordinal < 0 || ordinal > 1) return 101; *d = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) { *ctx = (void*)(uintptr_t)(0x1000 + dev); return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = cur_ctx; return 0; }
CUresult cuCtxSetCurrent(void* c) { cur_ctx = c; return 0; }
CUresult cuModuleLoadData(void** m, const void* image) {
  if (memcmp(image, "FAKECUBIN", 9) != 0) return 200;
  if (!cur_ctx) return 201;
  struct mod* p = free_mods ? free_mods : malloc(sizeof *p);
  if (p == free_mods) free_mods = p->next_free;
  memset(p, 0, sizeof *p); p->ctx = cur_ctx; *m = p; return 0;
}
CUresult cuModuleUnload(void* m) {
  struct mod* p = m;
  if (p->ctx != cur_ctx) return 201;
  p->next_free = free_mods; free_mods = p; return 0;
}
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
  if (((struct mod*)m)->ctx != cur_ctx) return 201;
  int takes_tmap = strcmp(name, "tmap_kernel") == 0;
  if (strcmp(name, "fill_kernel") != 0 && !takes_tmap) return 500;
  struct mod* mp = m;
  if (mp->n == 8) return 1;
  struct fn* p = &mp->fns[mp->n++];
  p->ctx = cur_ctx; p->max_smem = 48 * 1024; p->takes_tmap = takes_tmap; *f = p;
  return 0;
}
CUresult cuFuncSetAttribute(void* f, int attr, int value) {
  if (attr != 8 || value > 227 * 1024) return 1;
  ((struct fn*)f)->max_smem = value; return 0;
}
/* "fill_kernel": out = arg0 (host memory here), n = arg1; out[0..3] = grid/block/smem/stream, out[4+i] = arg(2+i).
   "tmap_kernel(out, CUtensorMap map, uint64 v)": out[0..15] = map, out[16] = address of map % 128, out[17] = v. */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
  struct fn* k = f;
  if (cur_ctx != k->ctx) return 201;
  if (!gx || !gy || !gz || !bx || !by || !bz || bx * by * bz > 1024 || smem > (unsigned)k->max_smem || extra)
    return 1;
  last_programmatic = 0;
  uint64_t* out = (uint64_t*)(uintptr_t)*(uint64_t*)params[0];
  if (k->takes_tmap) {
    memcpy(out, params[1], 128); out[16] = (uintptr_t)params[1] % 128; out[17] = *(uint64_t*)params[2];
    return 0;
  }
  uint64_t n = *(uint64_t*)params[1];
  out[0] = (uint64_t)gx * gy * gz; out[1] = bx * by * bz; out[2] = smem; out[3] = (uint64_t)(uintptr_t)stream;
  for (uint64_t i = 0; i < n; ++i) out[4 + i] = *(uint64_t*)params[2 + i];
  return 0;
}
#ifndef FAKE_DRIVER_WITHOUT_TMA
struct attr { int id; char pad[4]; union { char bytes[64]; int programmatic; } value; };
struct launch_config { unsigned gx, gy, gz, bx, by, bz, smem; void* stream; struct attr* attrs; unsigned n; };
/* cuLaunchKernelEx with exactly one attribute, programmatic stream serialization (6) = 1 */
CUresult cuLaunchKernelEx(const struct launch_config* c, void* f, void** params, void** extra) {
  if (sizeof(struct attr) != 72 || c->n != 1 || c->attrs[0].id != 6 || c->attrs[0].value.programmatic != 1)
    return 1;
  CUresult r = cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->smem, c->stream, params, extra);
  last_programmatic = 1;
  return r;
}
#endif
#ifndef FAKE_DRIVER_WITHOUT_TMA
/* Packs its arguments into the descriptor for the test to read back; dims[0] == 12345 is "invalid". */
CUresult cuTensorMapEncodeTiled(uint64_t* map, int dtype, unsigned rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const unsigned* box, const unsigned* element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
  if ((uintptr_t)map % 64 || rank < 1 || rank > 5 || dims[0] == 12345) return 1;
  if (!cur_ctx) return 201;
  memset(map, 0, 128);
  map[0] = dtype; map[1] = rank; map[2] = (uint64_t)(uintptr_t)address;
  for (unsigned i = 0; i < rank; ++i)
    map[3 + i] = dims[i] | (uint64_t)box[i] << 40 | (uint64_t)element_strides[i] << 52;
  for (unsigned i = 0; i + 1 < rank; ++i) map[8 + i] = strides[i];
  map[12] = interleave | swizzle << 8 | l2_promotion << 16 | oob_fill << 24;
  return 0;
}
#endif
CUresult cuGetErrorName(CUresult e, const char** s) {
  switch (e) {
    case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; return 0;
    case 201: *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    case 500: *s = "CUDA_ERROR_NOT_FOUND"; return 0;
  }
  return 1;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  switch (e) {
    case 1: *s = "invalid argument"; return 0;
    case 101: *s = "invalid device ordinal"; return 0;
    case 200: *s = "device kernel image is invalid"; return 0;
    case 201: *s = "invalid device context"; return 0;
    case 500: *s = "named symbol not found"; return 0;
  }
  return 1;
}
"""

FAKE_DRIVER_CHECKS = r"""
import ctypes, importlib.util, struct, sys
import torch  # the extension links against libtorch
name, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(name, path)
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
drv = ctypes.CDLL("libcuda.so.1")
assert drv.tile_ops_fake_driver() == 1, "not the fake driver"
drv.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
drv.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

def current():
    c = ctypes.c_void_p()
    assert drv.cuCtxGetCurrent(ctypes.byref(c)) == 0
    return c.value

def raises(exc, text, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert text in str(e), (str(e), text)
    else:
        raise AssertionError(f"no {exc.__name__}: {text}")

assert C.driver_available() is True
assert current() is None

# TMA descriptors: the arguments reach the driver as documented; its errors name the parameters
def unpack(desc):
    assert isinstance(desc, bytes) and len(desc) == 128, desc
    return struct.unpack("<16Q", desc)

TMAP = dict(dtype="bfloat16", global_address=0x7f0000001000, dims=[64, 100, 3], strides_bytes=[256, 25600],
            box=[64, 32, 1], element_strides=[1, 2, 1], swizzle=3)
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_INVALID_CONTEXT (invalid device context) in "
       "cuTensorMapEncodeTiled for dtype=bfloat16 global_address=0x7f0000001000 dims=[64, 100, 3] "
       "strides_bytes=[256, 25600] box=[64, 32, 1] "
       "element_strides=[1, 2, 1] interleave=0 swizzle=3 l2_promotion=2 oob_fill=0",
       lambda: C.encode_tensor_map(**TMAP))
q = unpack(C.encode_tensor_map(**TMAP, device=1))  # the device's primary context is made current for the call
assert current() == 0x1001
assert q[:3] == (9, 3, 0x7f0000001000), q  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, address
assert [(d & (2**40 - 1), d >> 40 & 4095, d >> 52) for d in q[3:6]] == [(64, 64, 1), (100, 32, 2), (3, 1, 1)], q
assert q[8:10] == (256, 25600) and q[12] == 0 | 3 << 8 | 2 << 16 | 0 << 24, q
q = unpack(C.encode_tensor_map("int8", 0x2000, [4096], [], [256], [1], 0, interleave=0, l2_promotion=3, oob_fill=0))
assert q[:4] == (0, 1, 0x2000, 4096 | 256 << 40 | 1 << 52) and q[12] == 3 << 16, q  # int8 travels as UINT8
for dtype, cu in [("float16", 6), ("float32", 7), ("float64", 8), ("uint8", 0), ("int32", 3)]:
    assert unpack(C.encode_tensor_map(dtype, 0x2000, [64], [], [16], [1], 0))[0] == cu, dtype
assert unpack(C.encode_tensor_map("float32", 0x2000, [64], [], [16], [1], 0, oob_fill=1))[12] == 2 << 16 | 1 << 24
raises(RuntimeError, "CUDA_ERROR_INVALID_VALUE (invalid argument) in cuTensorMapEncodeTiled for dtype=float16 "
       "global_address=0x2000 dims=[12345]", C.encode_tensor_map, "float16", 0x2000, [12345], [], [8], [1], 0)
desc = C.encode_tensor_map(**TMAP)
assert drv.cuCtxSetCurrent(None) == 0
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid) in cuModuleLoadData", C.load_module, b"junk", 0)
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_INVALID_DEVICE (invalid device ordinal) in cuDeviceGet", C.load_module, b"FAKECUBIN", 7)
m0 = C.load_module(b"FAKECUBIN", 0)
assert current() == 0x1000  # no context was current: device 0's primary context stays current
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_NOT_FOUND (named symbol not found) in cuModuleGetFunction for kernel 'nope'", C.get_function, m0, "nope", 0)
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_INVALID_VALUE (invalid argument) in cuFuncSetAttribute for kernel 'fill_kernel'", C.get_function, m0, "fill_kernel", 300 * 1024)
f_small = C.get_function(m0, "fill_kernel", 0)
f0 = C.get_function(m0, "fill_kernel", 100 * 1024)

out = (ctypes.c_uint64 * 64)()
addr = ctypes.addressof(out)
vals = [10, 20, 2**64 - 1]
C.launch(f0, (2, 3, 4), (128, 1, 1), 100 * 1024, 77, [addr, len(vals)] + vals, "fill_kernel")
assert list(out[:7]) == [24, 128, 100 * 1024, 77] + vals, list(out[:7])
vals = list(range(100, 130))  # more than 16 args: heap path
C.launch(f0, [1, 1, 1], [32, 2, 1], 0, 0, tuple([addr, len(vals)] + vals), "fill_kernel")
assert list(out[:4 + len(vals)]) == [1, 64, 0, 0] + vals
C.launch(f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, 0], "fill_kernel")

# bytes args are passed by value from 128-byte aligned copies, mixed with ints, on both paths
f_tmap = C.get_function(m0, "tmap_kernel", 0)
C.launch(f_tmap, (1, 1, 1), (1, 1, 1), 0, 0, [addr, desc, 99], "tmap_kernel")
assert tuple(out[:16]) == unpack(desc) and out[16] == 0 and out[17] == 99, list(out[:18])
as_bytes = lambda v, size=8: v.to_bytes(8, "little") + bytes(size - 8)
C.launch(f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, 4, as_bytes(5, 200), 6, as_bytes(7), as_bytes(8, 129)], "fill_kernel")
assert list(out[4:8]) == [5, 6, 7, 8], list(out[4:8])
vals = list(range(200, 230))
C.launch(f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, len(vals)] + [as_bytes(v) if v % 3 else v for v in vals], "fill_kernel")
assert list(out[4:4 + len(vals)]) == vals

# a function loaded as programmatic launches through cuLaunchKernelEx with programmatic stream serialization
f_prog = C.get_function(m0, "fill_kernel", 100 * 1024, True)
C.launch(f_prog, (2, 1, 1), (64, 1, 1), 100 * 1024, 5, [addr, 1, 31], "fill_kernel")
assert drv.tile_ops_fake_last_programmatic() == 1 and list(out[:5]) == [2, 64, 100 * 1024, 5, 31], list(out[:5])
C.launch(f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, 0], "fill_kernel")
assert drv.tile_ops_fake_last_programmatic() == 0
raises(RuntimeError, "in cuLaunchKernelEx for kernel 'fill_kernel'", C.launch, f_prog, (0, 1, 1), (32, 1, 1), 0, 0,
       [addr, 0], "fill_kernel")

# the exact error format, with the kernel name
raises(RuntimeError, "tile_ops: CUDA error CUDA_ERROR_INVALID_VALUE (invalid argument) in cuLaunchKernel for kernel 'gemm_kernel'",
       C.launch, f0, (1, 1, 1), (2048, 1, 1), 0, 0, [addr, 0], "gemm_kernel")
raises(RuntimeError, "in cuLaunchKernel for kernel 'fill_kernel'", C.launch, f_small, (1, 1, 1), (32, 1, 1), 64 * 1024, 0, [addr, 0], "fill_kernel")
raises(RuntimeError, "in cuLaunchKernel for kernel 'k'", C.launch, f0, (0, 1, 1), (32, 1, 1), 0, 0, [addr, 0], "k")

# another device's module: loaded into its own primary context; the caller's context is restored
m1 = C.load_module(b"FAKECUBIN", 1)
assert current() == 0x1000
f1 = C.get_function(m1, "fill_kernel", 0)
assert current() == 0x1000
C.launch(f1, (5, 1, 1), (1, 1, 1), 0, 3, [addr, 0], "fill_kernel")
assert out[0] == 5 and current() == 0x1000
assert drv.cuCtxSetCurrent(None) == 0
C.launch(f1, (6, 1, 1), (1, 1, 1), 0, 3, [addr, 0], "fill_kernel")
assert out[0] == 6 and current() == 0x1001

# bad Python arguments are Python errors, not crashes
raises(ValueError, "grid must have exactly 3 entries", C.launch, f0, (1, 1), (1, 1, 1), 0, 0, [addr, 0], "k")
raises(TypeError, "", C.launch, f0, 5, (1, 1, 1), 0, 0, [addr, 0], "k")
raises(ValueError, "argument 1 of kernel 'k' = -1 is out of range", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, -1], "k")
raises(TypeError, "args must be a tuple or list", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, desc, "k")
raises(TypeError, "", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, "x"], "k")
raises(TypeError, "kernel_name must be a str", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, 0], None)
raises(ValueError, "unknown function handle for kernel 'k'", C.launch, 12345, (1, 1, 1), (1, 1, 1), 0, 0, [], "k")

C.unload_module(m0)
raises(ValueError, "unknown function handle", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, 0], "fill_kernel")
raises(ValueError, "unknown module handle", C.unload_module, m0)
raises(ValueError, "unknown module handle", C.get_function, m0, "fill_kernel", 0)
C.unload_module(m1)
print("FAKE DRIVER OK")
"""


def _run_with_fake_driver(tmp_path, lib, checks, *cflags):
    """Runs ``checks`` in a fresh Python on ``lib`` whose dlopen("libcuda.so.1") finds the fake driver."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", *cflags, "-o", str(tmp_path / "libcuda.so.1"), str(src)],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("LD_LIBRARY_PATH")])))
    proc = subprocess.run([sys.executable, "-c", checks, lib.__name__, lib.__file__],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def jit_built_lib(tmp_path_factory, monkeypatch_module):
    """The JIT fallback: the same csrc/ sources built with torch.utils.cpp_extension, in a private cache dir."""
    monkeypatch_module.setenv("TILE_OPS_CACHE_DIR", str(tmp_path_factory.mktemp("jit_cache")))
    return launcher_mod._jit_build()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("which", ["built", "jit_built"])
def test_launch_marshalling_and_errors_with_fake_driver(which, request, tmp_path):
    lib = request.getfixturevalue("lib" if which == "built" else "jit_built_lib")
    assert lib.API_VERSION == launcher_mod.API_VERSION
    assert "FAKE DRIVER OK" in _run_with_fake_driver(tmp_path, lib, FAKE_DRIVER_CHECKS)


FAKE_DRIVER_PLANS = r"""
import ctypes, importlib.util, struct, sys
import torch
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
A, B, C_, OUT, SCRATCH = range(5)
C.plans_configure((torch.Tensor,), lambda device: 0)
module = C.load_module(b"FAKECUBIN", 0)
tmap_kernel = C.get_function(module, "tmap_kernel", 0)
SPEC = dict(tensor="A", dtype="float16", dims=[32, 16], strides=[64], box=[32, 16], element_strides=[1, 1],
            swizzle=0, l2_promotion=2, oob_fill=0)
# step 1 writes into the scratch buffer, step 2 into the output: the descriptor of A's pointer, then one pointer
steps = [(tmap_kernel, (1, 1, 1), (32, 1, 1), 0, "tmap_kernel", [(SCRATCH, None), (A, SPEC), (B, None)]),
         (tmap_kernel, (1, 1, 1), (32, 1, 1), 0, "tmap_kernel", [(OUT, None), (A, SPEC), (SCRATCH, None)])]
a, b = torch.zeros(16, 32, dtype=torch.float16), torch.zeros(32, 24, dtype=torch.float16)
out = torch.empty(18, dtype=torch.int64)
assert C.plans_record(0, (a, b, None), (None, None), [([18], torch.int64)], ([((18,), torch.int64)], steps))
def call(x, y):
    return C.plans_call(0, (x, y, None), (None, None), True)
for _ in range(6):  # fresh A pointers: more than the descriptor cache holds per tensor map
    x = torch.randn(16, 32).half()
    got = call(x, b)
    assert got.shape == (18,) and got.dtype == torch.int64, got
    assert got[2].item() == x.data_ptr(), "the descriptor encodes this call's A"
    assert got[3].item() == 32 | 32 << 40 | 1 << 52 and got[8].item() == 64, "the recorded spec"
    assert got[16].item() == 0, "descriptor copies are 128-byte aligned"
    assert got[17].item() != 0 and got[17].item() % 16 == 0, "the scratch buffer's pointer"
assert call(torch.zeros(16, 33, dtype=torch.float16), b) is None, "another signature has no plan"
# a module loaded after an unload may get the same function address: the plan must not run it
C.unload_module(module)
module2 = C.load_module(b"FAKECUBIN", 0)
again = C.get_function(module2, "tmap_kernel", 0)
assert call(a, b) is None, "a plan of an unloaded kernel is dropped"
assert C.plans_size() == 0
assert again == tmap_kernel, "the fake driver reuses the freed module's memory"
print("FAKE DRIVER PLANS OK")
"""


def test_plans_launch_through_the_driver_with_fake_driver(lib, tmp_path):
    """A plan's native steps on the fake driver (pointers are host memory): buffers, scratch, TMA descriptors
    per pointer, and a kernel reloaded at a reused address never running a stale plan."""
    assert "FAKE DRIVER PLANS OK" in _run_with_fake_driver(tmp_path, lib, FAKE_DRIVER_PLANS)


def test_driver_without_tensor_maps_still_launches(lib, tmp_path):
    checks = FAKE_DRIVER_CHECKS.split("assert C.driver_available() is True")[0] + textwrap.dedent("""
        assert C.driver_available() is True
        raises(RuntimeError, "tile_ops: encode_tensor_map: the CUDA driver has no cuTensorMapEncodeTiled; "
               "TMA descriptors need a CUDA 12.0 or newer driver",
               C.encode_tensor_map, "float16", 0x2000, [64], [], [8], [1], 0)
        m = C.load_module(b"FAKECUBIN", 0)
        out = (ctypes.c_uint64 * 8)()
        C.launch(C.get_function(m, "fill_kernel", 0), (1, 1, 1), (1, 1, 1), 0, 0, [ctypes.addressof(out), 1, 42], "k")
        assert out[4] == 42
        # no cuLaunchKernelEx either (a pre-12.0 driver): a programmatic function gets a plain launch
        C.launch(C.get_function(m, "fill_kernel", 0, True), (1, 1, 1), (1, 1, 1), 0, 0, [ctypes.addressof(out), 1, 43], "k")
        assert out[4] == 43 and drv.tile_ops_fake_last_programmatic() == 0
        print("NO-TMA DRIVER OK")
    """)
    assert "NO-TMA DRIVER OK" in _run_with_fake_driver(tmp_path, lib, checks, "-DFAKE_DRIVER_WITHOUT_TMA")


# -- get_launcher's version check -------------------------------------------------------------

def _fake_extension(name, api_version):
    mod = types.ModuleType(name)
    mod.API_VERSION = api_version
    mod.__file__ = f"/nowhere/{name}.so"
    return mod


@pytest.fixture
def fresh_launcher(monkeypatch):
    """get_launcher() as in a new process whose tile_ops._C has API_VERSION 1 (built before version 2)."""
    import tile_ops

    stale = _fake_extension("tile_ops._C", 1)
    monkeypatch.setattr(launcher_mod, "_launcher", None)
    monkeypatch.setattr(tile_ops, "_C", stale, raising=False)
    monkeypatch.setitem(sys.modules, "tile_ops._C", stale)
    return monkeypatch


def test_stale_extension_is_replaced_by_a_jit_build(fresh_launcher):
    rebuilt = _fake_extension("tile_ops_C", launcher_mod.API_VERSION)
    fresh_launcher.setattr(launcher_mod, "_jit_build", lambda: rebuilt)
    assert launcher_mod.get_launcher() is rebuilt


def test_jit_build_of_another_version_is_an_error(fresh_launcher):
    fresh_launcher.setattr(launcher_mod, "_jit_build", lambda: _fake_extension("tile_ops_C", 1))
    with pytest.raises(RuntimeError, match=r"tile_ops: the launcher JIT-built from .*csrc has API_VERSION 1, "
                                           r"want \d+; reinstall tile_ops"):
        launcher_mod.get_launcher()


# -- on a real GPU -------------------------------------------------------------------------

KERNEL_SRC = textwrap.dedent("""
    extern "C" __global__ void axpb_kernel(const float* x, float* y) {
      extern __shared__ float buf[];
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      buf[threadIdx.x] = x[i];
      __syncthreads();
      y[i] = 2.0f * buf[threadIdx.x] + 1.0f;
    }
""")


# A CUtensorMap-sized struct passed by value: checks bytes arguments on any GPU.
BLOB_KERNEL_SRC = textwrap.dedent("""
    struct __align__(64) Blob { unsigned long long q[16]; };

    extern "C" __global__ void blob_kernel(unsigned long long* out, const Blob blob, unsigned long long tail) {
      if (threadIdx.x < 16) out[threadIdx.x] = blob.q[threadIdx.x] + tail;
    }
""")

# Out = X (64x64 float32), one 8x32 tile per block, loaded by TMA through the X_tmap descriptor (sm_90+).
TMA_COPY_KERNEL_SRC = textwrap.dedent(r"""
    #include <cuda.h>  // CUtensorMap

    constexpr int kCols = 64, kBoxCols = 32, kBoxRows = 8;

    extern "C" __global__ void __launch_bounds__(128) tma_copy_kernel(const __grid_constant__ CUtensorMap X_tmap,
                                                                      float* Out) {
      __shared__ alignas(128) float tile[kBoxRows * kBoxCols];
      __shared__ alignas(8) unsigned long long bar;
      const int x = blockIdx.x * kBoxCols, y = blockIdx.y * kBoxRows;
      const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
      const unsigned tile_addr = static_cast<unsigned>(__cvta_generic_to_shared(tile));
      if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar_addr), "r"(static_cast<unsigned>(sizeof(tile))) : "memory");
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];"
                     :: "r"(tile_addr), "l"(reinterpret_cast<unsigned long long>(&X_tmap)), "r"(x), "r"(y),
                        "r"(bar_addr) : "memory");
      }
      asm volatile("{\n.reg .pred done;\nWAIT:\n"
                   "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                   "@!done bra WAIT;\n}" :: "r"(bar_addr) : "memory");
      for (int i = threadIdx.x; i < kBoxRows * kBoxCols; i += blockDim.x)
        Out[(y + i / kBoxCols) * kCols + x + i % kBoxCols] = tile[i];
    }
""")


def _cubin_for_this_gpu(tmp_path_factory, source):
    nvcc = shutil.which("nvcc") or next(
        (p for p in ["/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"] if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    d = tmp_path_factory.mktemp("cubin")
    (d / "k.cu").write_text(source)
    subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-o", str(d / "k.cubin"), str(d / "k.cu")], check=True)
    return (d / "k.cubin").read_bytes()


@pytest.fixture(scope="module")
def axpb_cubin(tmp_path_factory):
    return _cubin_for_this_gpu(tmp_path_factory, KERNEL_SRC)


@pytest.fixture(scope="module")
def needs_tma():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need compute capability 9.0 or newer")


@pytest.mark.gpu
@pytest.mark.parametrize("smem_bytes", [1024 * 4, 100 * 1024])  # the second needs the >48 KiB opt-in
def test_gpu_launch_real_cubin(axpb_cubin, smem_bytes):
    n, block = 1 << 16, 256
    x = torch.randn(n, device="cuda")
    y = torch.full_like(x, float("nan"))
    f = CudaFunction(axpb_cubin, "axpb_kernel", smem_bytes)
    stream = torch.cuda.current_stream()
    f.launch((n // block, 1, 1), (block, 1, 1), [x.data_ptr(), y.data_ptr()], stream.cuda_stream, x.device.index)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, 2 * x + 1)
    f.launch((n // block, 1, 1), (block, 1, 1), [y.data_ptr(), x.data_ptr()], stream.cuda_stream, 0)
    torch.cuda.synchronize()
    torch.testing.assert_close(x, 2 * y + 1)


@pytest.mark.gpu
def test_gpu_bad_launch_raises_formatted_error(lib, axpb_cubin):
    x = torch.zeros(1024, device="cuda")
    f = CudaFunction(axpb_cubin, "axpb_kernel", 256 * 4)  # the kernel stages blockDim floats
    with pytest.raises(RuntimeError, match=re.escape(
            "tile_ops: CUDA error CUDA_ERROR_INVALID_VALUE (invalid argument) in cuLaunchKernel for kernel 'axpb_kernel'")):
        f.launch((1, 1, 1), (4096, 1, 1), [x.data_ptr(), x.data_ptr()], 0, 0)  # block too large
    with pytest.raises(RuntimeError, match=r"tile_ops: CUDA error CUDA_ERROR_\w+ \(.+\) in cuModuleLoadData"):
        lib.load_module(b"definitely not a cubin", 0)
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_NOT_FOUND \(.+\) in cuModuleGetFunction for kernel 'nope'"):
        CudaFunction(axpb_cubin, "nope", 0).launch((1, 1, 1), (32, 1, 1), [x.data_ptr()] * 2, 0, 0)
    # the context is still healthy after the failed launches
    f.launch((4, 1, 1), (256, 1, 1), [x.data_ptr(), x.data_ptr()], torch.cuda.current_stream().cuda_stream, 0)
    torch.cuda.synchronize()
    assert torch.all(x == 1)


@pytest.mark.gpu
def test_gpu_encode_tensor_map_for_a_real_tensor(lib, needs_tma):
    x = torch.randn(256, 64, device="cuda", dtype=torch.float16)
    spec = dict(dtype="float16", dims=[64, 256], strides_bytes=[64 * 2], box=[64, 128], element_strides=[1, 1],
                swizzle=3)
    desc = lib.encode_tensor_map(global_address=x.data_ptr(), **spec, device=x.device.index)
    assert isinstance(desc, bytes) and len(desc) == 128 and any(desc)
    assert lib.encode_tensor_map(global_address=x.data_ptr(), **spec) == desc  # torch's context is current
    y = torch.empty_like(x)
    assert lib.encode_tensor_map(global_address=y.data_ptr(), **spec, device=y.device.index) != desc


@pytest.mark.gpu
def test_gpu_launch_passes_bytes_by_value(tmp_path_factory):
    cubin = _cubin_for_this_gpu(tmp_path_factory, BLOB_KERNEL_SRC)
    q = [(i + 1) * 0x0101010101 for i in range(16)]
    blob = b"".join(v.to_bytes(8, "little") for v in q)
    out = torch.zeros(16, dtype=torch.int64, device="cuda")
    f = CudaFunction(cubin, "blob_kernel", 0)
    f.launch((1, 1, 1), (32, 1, 1), [out.data_ptr(), blob, 1000], torch.cuda.current_stream().cuda_stream,
             out.device.index)
    torch.cuda.synchronize()
    assert out.tolist() == [v + 1000 for v in q]


@pytest.mark.gpu
def test_gpu_kernel_with_a_tensormap_parameter(tmp_path_factory, needs_tma):
    from tile_ops.compiler.meta import KernelMeta
    from tile_ops.jit.kernel import Kernel

    major, minor = torch.cuda.get_device_capability()
    x_tmap = {"tensor": "X", "dtype": "float32", "dims": [64, 64], "strides": [64 * 4], "box": [32, 8],
              "element_strides": [1, 1], "swizzle": 0, "l2_promotion": 2, "oob_fill": 0}
    meta = KernelMeta(name="tma_copy", entry="tma_copy_kernel", arch=f"sm_{major}{minor}a", grid=(2, 8, 1),
                      block=(128, 1, 1), smem_bytes=0,
                      params=[("X", (64, 64), "float32"), ("Out", (64, 64), "float32")],
                      kept=["X_tmap", "Out"], out_idx=[1], tensormaps={"X_tmap": x_tmap})
    kernel = Kernel(meta, TMA_COPY_KERNEL_SRC, _cubin_for_this_gpu(tmp_path_factory, TMA_COPY_KERNEL_SRC))
    for _ in range(2):  # a new buffer gets its own descriptor
        x = torch.randn(64, 64, device="cuda")
        torch.testing.assert_close(kernel(x), x, rtol=0, atol=0)
    out = torch.full_like(x, float("nan"))
    kernel.launch_ptrs([x.data_ptr(), out.data_ptr()], x.device)  # the cached descriptor of x
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x, rtol=0, atol=0)
