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
    for name in ("load_module", "get_function", "launch", "unload_module", "driver_available"):
        assert callable(getattr(lib, name))
    assert launcher_mod.launcher_source().is_file()


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


# -- CudaFunction bookkeeping, with a pure-Python stand-in for the extension -----------------

class _FakeLib:
    def __init__(self):
        self.calls = []

    def load_module(self, cubin, device):
        self.calls.append(("load_module", device))
        return 1000 + device

    def get_function(self, module, name, smem):
        self.calls.append(("get_function", module, name, smem))
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
struct mod { void* ctx; };
struct fn { void* ctx; int max_smem; };
static __thread void* cur_ctx = 0;
int tile_ops_fake_driver(void) { return 1; }
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { if (ordinal < 0 || ordinal > 1) return 101; *d = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) { *ctx = (void*)(uintptr_t)(0x1000 + dev); return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = cur_ctx; return 0; }
CUresult cuCtxSetCurrent(void* c) { cur_ctx = c; return 0; }
CUresult cuModuleLoadData(void** m, const void* image) {
  if (memcmp(image, "FAKECUBIN", 9) != 0) return 200;
  if (!cur_ctx) return 201;
  struct mod* p = malloc(sizeof *p); p->ctx = cur_ctx; *m = p; return 0;
}
CUresult cuModuleUnload(void* m) { if (((struct mod*)m)->ctx != cur_ctx) return 201; free(m); return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
  if (((struct mod*)m)->ctx != cur_ctx) return 201;
  if (strcmp(name, "fill_kernel") != 0) return 500;
  struct fn* p = malloc(sizeof *p); p->ctx = cur_ctx; p->max_smem = 48 * 1024; *f = p; return 0;
}
CUresult cuFuncSetAttribute(void* f, int attr, int value) {
  if (attr != 8 || value > 227 * 1024) return 1;
  ((struct fn*)f)->max_smem = value; return 0;
}
/* "kernel": out = arg0 (host memory here), n = arg1; out[0..3] = grid/block/smem/stream, out[4+i] = arg(2+i) */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, void* stream, void** params, void** extra) {
  struct fn* k = f;
  if (cur_ctx != k->ctx) return 201;
  if (!gx || !gy || !gz || !bx || !by || !bz || bx * by * bz > 1024 || smem > (unsigned)k->max_smem || extra)
    return 1;
  uint64_t* out = (uint64_t*)(uintptr_t)*(uint64_t*)params[0];
  uint64_t n = *(uint64_t*)params[1];
  out[0] = (uint64_t)gx * gy * gz; out[1] = bx * by * bz; out[2] = smem; out[3] = (uint64_t)(uintptr_t)stream;
  for (uint64_t i = 0; i < n; ++i) out[4 + i] = *(uint64_t*)params[2 + i];
  return 0;
}
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
import ctypes, importlib.util, sys
name, path = sys.argv[1], sys.argv[2]
if name != "tile_ops._C":
    import torch  # a JIT-built copy links against libtorch
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
raises(OverflowError, "", C.launch, f0, (1, 1, 1), (1, 1, 1), 0, 0, [addr, -1], "k")
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


def test_launch_marshalling_and_errors_with_fake_driver(lib, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"), str(src)], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("LD_LIBRARY_PATH")])))
    proc = subprocess.run([sys.executable, "-c", FAKE_DRIVER_CHECKS, lib.__name__, lib.__file__],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAKE DRIVER OK" in proc.stdout


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


@pytest.fixture(scope="module")
def axpb_cubin(tmp_path_factory):
    nvcc = shutil.which("nvcc") or next(
        (p for p in ["/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"] if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    d = tmp_path_factory.mktemp("cubin")
    (d / "k.cu").write_text(KERNEL_SRC)
    subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-o", str(d / "k.cubin"), str(d / "k.cu")], check=True)
    return (d / "k.cubin").read_bytes()


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
