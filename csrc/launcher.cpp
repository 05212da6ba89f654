// tile_ops._C: load cubins and launch kernels through the CUDA driver API.
//
// The driver (libcuda.so.1) is dlopen'ed lazily on first use and the few types
// and functions we need are declared here, so this file builds with no CUDA
// toolkit and no GPU (CI machines, CPU-only installs).  Every CUDA error turns
// into a Python RuntimeError; nothing here aborts the process.
//
// Python API (see tile_ops/jit/INTERFACES.md):
//   load_module(cubin: bytes, device: int) -> int
//   get_function(module: int, name: str, dynamic_smem_bytes: int) -> int
//   launch(function, grid, block, smem, stream, args: list[int], kernel_name)
//   unload_module(module: int) -> None
//   driver_available() -> bool

#include <pybind11/pybind11.h>

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

namespace py = pybind11;

namespace {

// ---- the subset of cuda.h we use -------------------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
constexpr CUresult CUDA_SUCCESS = 0;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int kStaticSmemLimit = 48 * 1024;
constexpr int kApiVersion = 1;  // bump when the Python-visible API changes

struct Driver {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void**, void**);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
};

std::mutex g_mutex;            // guards everything below
bool g_tried = false;          // dlopen attempted (result is sticky)
bool g_ok = false;             // driver loaded and cuInit succeeded
std::string g_load_error;      // full RuntimeError text when !g_ok
Driver g_drv{};
std::unordered_map<int, CUcontext> g_primary;   // device -> retained primary context
struct ModuleInfo { CUcontext ctx; };
struct FunctionInfo { CUcontext ctx; CUmodule module; };
std::unordered_map<CUmodule, ModuleInfo> g_modules;
std::unordered_map<CUfunction, FunctionInfo> g_functions;

std::string error_text(CUresult rc, const char* api, const char* kernel) {
  const char* name = nullptr;
  const char* desc = nullptr;
  if (g_drv.cuGetErrorName == nullptr || g_drv.cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name)
    name = nullptr;
  if (g_drv.cuGetErrorString == nullptr || g_drv.cuGetErrorString(rc, &desc) != CUDA_SUCCESS || !desc)
    desc = nullptr;
  std::string msg = "tile_ops: CUDA error ";
  msg += name ? std::string(name) : "CUDA_ERROR_" + std::to_string(rc);
  msg += " (";
  msg += desc ? desc : "unrecognized error code";
  msg += ") in ";
  msg += api;
  if (kernel != nullptr) {
    msg += " for kernel '";
    msg += kernel;
    msg += "'";
  }
  return msg;
}

[[noreturn]] void throw_cuda(CUresult rc, const char* api, const char* kernel = nullptr) {
  throw std::runtime_error(error_text(rc, api, kernel));
}

#define TILE_OPS_CHECK(call, api, kernel)          \
  do {                                             \
    CUresult rc_ = (call);                         \
    if (rc_ != CUDA_SUCCESS) throw_cuda(rc_, api, kernel); \
  } while (0)

// Loads libcuda and runs cuInit once; caller holds g_mutex.  Never throws.
void try_load_driver_locked() {
  if (g_tried) return;
  g_tried = true;
  const std::string prefix = "tile_ops: the CUDA driver (libcuda.so.1) could not be loaded: ";
  const std::string suffix =
      "; launching kernels needs an NVIDIA GPU and driver (compiling to CUDA source and cubin "
      "does not)";
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    g_load_error = prefix + (err ? err : "dlopen failed") + suffix;
    return;
  }
  Driver d{};
  bool missing = false;
  std::string missing_name;
  auto sym = [&](const char* name) -> void* {
    void* p = dlsym(lib, name);
    if (p == nullptr && !missing) {
      missing = true;
      missing_name = name;
    }
    return p;
  };
#define TILE_OPS_SYM(fn) d.fn = reinterpret_cast<decltype(d.fn)>(sym(#fn))
  TILE_OPS_SYM(cuInit);
  TILE_OPS_SYM(cuDeviceGet);
  TILE_OPS_SYM(cuDevicePrimaryCtxRetain);
  TILE_OPS_SYM(cuCtxGetCurrent);
  TILE_OPS_SYM(cuCtxSetCurrent);
  TILE_OPS_SYM(cuModuleLoadData);
  TILE_OPS_SYM(cuModuleUnload);
  TILE_OPS_SYM(cuModuleGetFunction);
  TILE_OPS_SYM(cuFuncSetAttribute);
  TILE_OPS_SYM(cuLaunchKernel);
  TILE_OPS_SYM(cuGetErrorName);
  TILE_OPS_SYM(cuGetErrorString);
#undef TILE_OPS_SYM
  if (missing) {
    g_load_error = prefix + "symbol " + missing_name + " not found (driver too old?)" + suffix;
    return;  // keep the handle open: harmless, and dlclose of libcuda is not worth the risk
  }
  g_drv = d;
  CUresult rc = g_drv.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    g_load_error = error_text(rc, "cuInit", nullptr);
    return;
  }
  g_ok = true;
}

// Caller holds g_mutex.  Throws RuntimeError if the driver is unusable.
void require_driver_locked() {
  try_load_driver_locked();
  if (!g_ok) throw std::runtime_error(g_load_error);
}

CUcontext primary_context_locked(int device) {
  auto it = g_primary.find(device);
  if (it != g_primary.end()) return it->second;
  CUdevice dev = 0;
  TILE_OPS_CHECK(g_drv.cuDeviceGet(&dev, device), "cuDeviceGet", nullptr);
  CUcontext ctx = nullptr;
  TILE_OPS_CHECK(g_drv.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", nullptr);
  g_primary.emplace(device, ctx);  // retained for the life of the process, like torch does
  return ctx;
}

// Makes `ctx` current for a scope.  If no context was current, `ctx` stays
// current afterwards (so torch and later launches find it); otherwise the
// previous context is restored.
class ContextScope {
 public:
  ContextScope(CUcontext ctx, const char* kernel) {
    TILE_OPS_CHECK(g_drv.cuCtxGetCurrent(&prev_), "cuCtxGetCurrent", kernel);
    if (prev_ != ctx) {
      TILE_OPS_CHECK(g_drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", kernel);
      restore_ = prev_ != nullptr;
    }
  }
  ~ContextScope() {
    if (restore_) g_drv.cuCtxSetCurrent(prev_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext prev_ = nullptr;
  bool restore_ = false;
};

uint64_t load_module(py::bytes cubin, int device) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(cubin.ptr(), &data, &size) != 0) throw py::error_already_set();
  if (device < 0) throw py::value_error("tile_ops: load_module: device must be >= 0");
  std::lock_guard<std::mutex> lock(g_mutex);
  require_driver_locked();
  CUcontext ctx = primary_context_locked(device);
  ContextScope scope(ctx, nullptr);
  // The driver needs the image to stay valid only during the call.
  CUmodule module = nullptr;
  TILE_OPS_CHECK(g_drv.cuModuleLoadData(&module, data), "cuModuleLoadData", nullptr);
  g_modules[module] = ModuleInfo{ctx};
  return reinterpret_cast<uint64_t>(module);
}

uint64_t get_function(uint64_t module_handle, const std::string& name, int dynamic_smem_bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  require_driver_locked();
  CUmodule module = reinterpret_cast<CUmodule>(module_handle);
  auto it = g_modules.find(module);
  if (it == g_modules.end())
    throw py::value_error("tile_ops: get_function: unknown module handle (not from load_module, or unloaded)");
  ContextScope scope(it->second.ctx, name.c_str());
  CUfunction fn = nullptr;
  TILE_OPS_CHECK(g_drv.cuModuleGetFunction(&fn, module, name.c_str()), "cuModuleGetFunction",
                 name.c_str());
  if (dynamic_smem_bytes > kStaticSmemLimit) {
    TILE_OPS_CHECK(g_drv.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            dynamic_smem_bytes),
                   "cuFuncSetAttribute", name.c_str());
  }
  g_functions[fn] = FunctionInfo{it->second.ctx, module};
  return reinterpret_cast<uint64_t>(fn);
}

void unload_module(uint64_t module_handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  require_driver_locked();
  CUmodule module = reinterpret_cast<CUmodule>(module_handle);
  auto it = g_modules.find(module);
  if (it == g_modules.end())
    throw py::value_error("tile_ops: unload_module: unknown module handle (not from load_module, or unloaded)");
  CUcontext ctx = it->second.ctx;
  for (auto f = g_functions.begin(); f != g_functions.end();) {
    if (f->second.module == module) f = g_functions.erase(f);
    else ++f;
  }
  g_modules.erase(it);
  ContextScope scope(ctx, nullptr);
  TILE_OPS_CHECK(g_drv.cuModuleUnload(module), "cuModuleUnload", nullptr);
}

// Reads exactly 3 non-negative ints from a tuple/list into out[3].
void read_dim3(PyObject* seq, const char* what, unsigned out[3]) {
  PyObject* fast = PySequence_Fast(seq, what);  // no copy for tuple/list
  if (fast == nullptr) throw py::error_already_set();
  py::object guard = py::reinterpret_steal<py::object>(fast);
  if (PySequence_Fast_GET_SIZE(fast) != 3)
    throw py::value_error(std::string("tile_ops: launch: ") + what + " must have exactly 3 entries");
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (int i = 0; i < 3; ++i) {
    unsigned long v = PyLong_AsUnsignedLong(items[i]);
    if (v == static_cast<unsigned long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    if (v > 0xffffffffUL) throw py::value_error(std::string("tile_ops: launch: ") + what + " entry too large");
    out[i] = static_cast<unsigned>(v);
  }
}

void launch(uint64_t function_handle, py::handle grid, py::handle block, unsigned smem,
            uint64_t stream, py::handle args, py::handle kernel_name) {
  constexpr Py_ssize_t kStackArgs = 16;
  unsigned g[3], b[3];
  read_dim3(grid.ptr(), "grid", g);
  read_dim3(block.ptr(), "block", b);

  PyObject* fast = PySequence_Fast(args.ptr(), "args must be a list of ints");
  if (fast == nullptr) throw py::error_already_set();
  py::object guard = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  uint64_t stack_vals[kStackArgs];
  void* stack_params[kStackArgs];
  std::vector<uint64_t> heap_vals;
  std::vector<void*> heap_params;
  uint64_t* vals = stack_vals;
  void** params = stack_params;
  if (n > kStackArgs) {
    heap_vals.resize(n);
    heap_params.resize(n);
    vals = heap_vals.data();
    params = heap_params.data();
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    vals[i] = v;
    params[i] = &vals[i];
  }

  // A str's UTF-8 form is cached inside the object: no allocation, no Python code.
  const char* kname = PyUnicode_Check(kernel_name.ptr()) ? PyUnicode_AsUTF8(kernel_name.ptr()) : nullptr;
  if (kname == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::type_error("tile_ops: launch: kernel_name must be a str");
  }

  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_ok) require_driver_locked();
  CUfunction fn = reinterpret_cast<CUfunction>(function_handle);
  auto it = g_functions.find(fn);
  if (it == g_functions.end())
    throw py::value_error(std::string("tile_ops: launch: unknown function handle for kernel '") +
                          kname + "' (not from get_function, or its module was unloaded)");
  const CUcontext ctx = it->second.ctx;
  CUcontext cur = nullptr;
  TILE_OPS_CHECK(g_drv.cuCtxGetCurrent(&cur), "cuCtxGetCurrent", kname);
  if (cur != ctx) TILE_OPS_CHECK(g_drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", kname);
  CUresult rc = g_drv.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], smem,
                                     reinterpret_cast<CUstream>(stream), n ? params : nullptr,
                                     nullptr);
  if (cur != nullptr && cur != ctx) g_drv.cuCtxSetCurrent(cur);  // leave the caller's context alone
  if (rc != CUDA_SUCCESS) throw_cuda(rc, "cuLaunchKernel", kname);
}

bool driver_available() {
  std::lock_guard<std::mutex> lock(g_mutex);
  try_load_driver_locked();
  return g_ok;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tile_ops CUDA driver launcher (libcuda is dlopen'ed on first use)";
  m.attr("API_VERSION") = kApiVersion;
  m.def("load_module", &load_module, py::arg("cubin"), py::arg("device"),
        "Load a cubin into the device's primary context; returns a module handle.");
  m.def("get_function", &get_function, py::arg("module"), py::arg("name"),
        py::arg("dynamic_smem_bytes") = 0,
        "Look up a kernel; opts in to >48 KiB dynamic shared memory when asked.");
  m.def("launch", &launch, py::arg("function"), py::arg("grid"), py::arg("block"),
        py::arg("smem"), py::arg("stream"), py::arg("args"), py::arg("kernel_name"),
        "Launch a kernel whose parameters are all 64-bit values (device pointers).");
  m.def("unload_module", &unload_module, py::arg("module"));
  m.def("driver_available", &driver_available,
        "True if libcuda.so.1 loads and cuInit succeeds.");
}
