// tile_ops._C: load cubins and launch kernels through the CUDA driver API.
//
// The driver (libcuda.so.1) is dlopen'ed lazily on first use and the few types
// and functions we need are declared in driver.h, so this file builds with no CUDA
// toolkit and no GPU (CI machines, CPU-only installs).  Every CUDA error turns
// into a Python RuntimeError; nothing here aborts the process.  The ops' plans
// (plans_*, the eager fast path) are in plans.cpp.
//
// Python API (see tile_ops/jit/INTERFACES.md):
//   load_module(cubin: bytes, device: int) -> int
//   get_function(module: int, name: str, dynamic_smem_bytes: int, programmatic=False) -> int
//   launch(function, grid, block, smem, stream, args: list[int | bytes], kernel_name)
//   unload_module(module: int) -> None
//   max_active_clusters(function: int, cluster: int, block_threads: int, smem: int) -> int  (-1: unknown)
//   driver_available() -> bool
//   encode_tensor_map(dtype, global_address, dims, strides_bytes, box, element_strides, swizzle,
//                     interleave=0, l2_promotion=2, oob_fill=0, device=None) -> bytes  (a CUtensorMap)

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>

#include "driver.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

namespace py = pybind11;

namespace tile_ops {
namespace {

constexpr int kApiVersion = 8;  // bump when the Python-visible API changes

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
  // Optional: drivers older than CUDA 12.0 lack it, and only encode_tensor_map needs it.
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, uint32_t, void*,
                                     const uint64_t*, const uint64_t*, const uint32_t*,
                                     const uint32_t*, int, int, int, int);
  // Optional (CUDA 12.0+): only max_active_clusters needs it.
  CUresult (*cuOccupancyMaxActiveClusters)(int*, CUfunction, const CUlaunchConfig*);
  // Optional (CUDA 12.0+): programmatic launches; without it they are plain ones (equally correct).
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
};

std::mutex g_mutex;            // guards everything below
bool g_tried = false;          // dlopen attempted (result is sticky)
bool g_ok = false;             // driver loaded and cuInit succeeded
std::string g_load_error;      // full RuntimeError text when !g_ok
Driver g_drv{};
std::unordered_map<int, CUcontext> g_primary;   // device -> retained primary context
struct ModuleInfo { CUcontext ctx; };
struct FunctionInfo { CUcontext ctx; CUmodule module; uint64_t generation; bool programmatic; };
uint64_t g_last_generation = 0;
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
  d.cuTensorMapEncodeTiled =
      reinterpret_cast<decltype(d.cuTensorMapEncodeTiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
  d.cuOccupancyMaxActiveClusters = reinterpret_cast<decltype(d.cuOccupancyMaxActiveClusters)>(
      dlsym(lib, "cuOccupancyMaxActiveClusters"));
  d.cuLaunchKernelEx = reinterpret_cast<decltype(d.cuLaunchKernelEx)>(dlsym(lib, "cuLaunchKernelEx"));
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

uint64_t get_function(uint64_t module_handle, const std::string& name, int dynamic_smem_bytes,
                      bool programmatic) {
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
  auto known = g_functions.find(fn);  // the driver hands out one handle per (module, name)
  if (known != g_functions.end() && known->second.programmatic != programmatic)
    throw py::value_error("tile_ops: get_function: '" + name + "' of this module is already loaded as " +
                          (programmatic ? "a plain" : "a programmatic") +
                          " launch; load the cubin again (load_module) for the other kind");
  g_functions[fn] = FunctionInfo{it->second.ctx, module, ++g_last_generation, programmatic};
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

// How many clusters of a kernel with compile-time cluster dims (__cluster_dims__) can be resident at
// once: a persistent clustered kernel launches that many.  GPCs hold whole clusters, so it is not the
// SM count over the cluster size.  -1 when the driver cannot say (older than CUDA 12.0).
int max_active_clusters(uint64_t function, unsigned cluster, unsigned block_threads, unsigned smem) {
  std::lock_guard<std::mutex> lock(g_mutex);
  require_driver_locked();
  CUfunction fn = reinterpret_cast<CUfunction>(function);
  auto it = g_functions.find(fn);
  if (it == g_functions.end())
    throw py::value_error("tile_ops: max_active_clusters: unknown function handle (not from get_function)");
  if (g_drv.cuOccupancyMaxActiveClusters == nullptr) return -1;
  ContextScope scope(it->second.ctx, nullptr);
  CUlaunchConfig config{};
  config.gridDimX = cluster;  // a grid of one cluster (the driver rejects grids the cluster does not divide)
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = block_threads;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = smem;
  int clusters = 0;
  TILE_OPS_CHECK(g_drv.cuOccupancyMaxActiveClusters(&clusters, fn, &config), "cuOccupancyMaxActiveClusters",
                 nullptr);
  return clusters;
}

// A tuple or list's items: a str, bytes or dict would iterate into something the caller did not mean.
PyObject** sequence_items(PyObject* seq, Py_ssize_t* size, const char* what, const char* accepted) {
  if (PyList_Check(seq) || PyTuple_Check(seq)) {
    *size = PySequence_Fast_GET_SIZE(seq);
    return PySequence_Fast_ITEMS(seq);
  }
  throw py::type_error(std::string("tile_ops: launch: ") + what + " must be a tuple or list of " + accepted + ", got " +
                       Py_TYPE(seq)->tp_name);
}

// `item` as an int in 0..max; false (no Python error set) when it is not one.
bool as_uint(PyObject* item, uint64_t max, uint64_t* out) {
  if (!PyLong_Check(item)) return false;
  *out = PyLong_AsUnsignedLongLong(item);
  if (*out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // an OverflowError that names nothing: negative or too large
    return false;
  }
  return *out <= max;
}

// What as_uint refused, as a Python error naming `what` and what is accepted.
[[noreturn]] void refuse_uint(PyObject* item, uint64_t max, const std::string& what) {
  if (!PyLong_Check(item))
    throw py::type_error("tile_ops: launch: " + what + " must be an int, got " + Py_TYPE(item)->tp_name);
  throw py::value_error("tile_ops: launch: " + what + " = " + py::str(item).cast<std::string>() +
                        " is out of range 0.." + std::to_string(max));
}

// Reads exactly 3 ints in 0..2^32-1 (x, y, z) from a tuple or list into out[3].
void read_dim3(PyObject* seq, const char* what, unsigned out[3]) {
  Py_ssize_t size = 0;
  PyObject** items = sequence_items(seq, &size, what, "3 ints (x, y, z)");
  if (size != 3) throw py::value_error(std::string("tile_ops: launch: ") + what + " must have exactly 3 entries");
  for (int i = 0; i < 3; ++i) {
    uint64_t v = 0;
    if (!as_uint(items[i], UINT32_MAX, &v)) refuse_uint(items[i], UINT32_MAX, std::string(what) + "[" + std::to_string(i) + "]");
    out[i] = static_cast<unsigned>(v);
  }
}

// cuLaunchKernel's kernelParams for a list of Python args: an int is a 64-bit value (a device
// pointer), a bytes object is passed by value (a CUtensorMap) from an aligned copy.  Up to
// kStackArgs all-int args need no heap allocation (the common case, kept fast).
class KernelParams {
 public:
  KernelParams(PyObject* args, const char* kernel) {
    PyObject** items = sequence_items(args, &n_, "args", "ints and bytes");
    if (n_ > kStackArgs) {
      heap_vals_.resize(n_);
      heap_params_.resize(n_);
      vals_ = heap_vals_.data();
      params_ = heap_params_.data();
    }
    size_t by_value_chunks = 0;
    for (Py_ssize_t i = 0; i < n_; ++i) {
      PyObject* item = items[i];
      if (PyLong_Check(item)) {
        if (!as_uint(item, UINT64_MAX, &vals_[i]))
          refuse_uint(item, UINT64_MAX, "argument " + std::to_string(i) + " of kernel '" + kernel + "'");
        params_[i] = &vals_[i];
      } else if (PyBytes_Check(item) && PyBytes_GET_SIZE(item) > 0) {
        by_value_.push_back(i);  // copied below, once the total size is known
        by_value_chunks += chunks_for(PyBytes_GET_SIZE(item));
      } else {
        throw py::type_error("tile_ops: launch: argument " + std::to_string(i) + " of kernel '" + kernel +
                             "' must be an int (a pointer or 64-bit value) or non-empty bytes (passed by "
                             "value, e.g. a CUtensorMap), got " + Py_TYPE(item)->tp_name);
      }
    }
    if (!by_value_.empty()) copy_by_value(items, by_value_chunks);
  }
  KernelParams(const KernelParams&) = delete;
  KernelParams& operator=(const KernelParams&) = delete;

  void** get() { return n_ ? params_ : nullptr; }

 private:
  static constexpr Py_ssize_t kStackArgs = 16;
  struct alignas(kTensorMapAlign) Chunk { unsigned char bytes[kTensorMapAlign]; };

  static size_t chunks_for(Py_ssize_t size) { return (size + sizeof(Chunk) - 1) / sizeof(Chunk); }

  void copy_by_value(PyObject** items, size_t total_chunks) {
    by_value_copies_.reset(new Chunk[total_chunks]);
    Chunk* next = by_value_copies_.get();
    for (Py_ssize_t i : by_value_) {
      const Py_ssize_t size = PyBytes_GET_SIZE(items[i]);
      std::memcpy(next, PyBytes_AS_STRING(items[i]), size);
      params_[i] = next;
      next += chunks_for(size);
    }
  }

  Py_ssize_t n_ = 0;
  uint64_t stack_vals_[kStackArgs];
  void* stack_params_[kStackArgs];
  std::vector<uint64_t> heap_vals_;
  std::vector<void*> heap_params_;
  uint64_t* vals_ = stack_vals_;
  void** params_ = stack_params_;
  std::vector<Py_ssize_t> by_value_;  // positions of the bytes args; allocates only when there are some
  std::unique_ptr<Chunk[]> by_value_copies_;
};

void launch(uint64_t function_handle, py::handle grid, py::handle block, unsigned smem,
            uint64_t stream, py::handle args, py::handle kernel_name) {
  unsigned g[3], b[3];
  read_dim3(grid.ptr(), "grid", g);
  read_dim3(block.ptr(), "block", b);

  // A str's UTF-8 form is cached inside the object: no allocation, no Python code.
  const char* kname = PyUnicode_Check(kernel_name.ptr()) ? PyUnicode_AsUTF8(kernel_name.ptr()) : nullptr;
  if (kname == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::type_error("tile_ops: launch: kernel_name must be a str");
  }
  KernelParams params(args.ptr(), kname);

  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_ok) require_driver_locked();
  CUfunction fn = reinterpret_cast<CUfunction>(function_handle);
  if (function_generation_locked(fn) == 0)
    throw py::value_error(std::string("tile_ops: launch: unknown function handle for kernel '") +
                          kname + "' (not from get_function, or its module was unloaded)");
  launch_locked(fn, g, b, smem, reinterpret_cast<CUstream>(stream), params.get(), kname);
}

// ---- TMA descriptors (cuTensorMapEncodeTiled) ---------------------------------

constexpr TensorMapDtype kTensorMapDtypes[] = {
    {"float16", CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, true},
    {"bfloat16", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, true},
    {"float32", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, true},
    {"float64", CU_TENSOR_MAP_DATA_TYPE_FLOAT64, 8, true},
    {"int8", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, false},  // TMA only moves bytes; there is no INT8 type
    {"uint8", CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, false},
    {"int32", CU_TENSOR_MAP_DATA_TYPE_INT32, 4, false},
};

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  out << "]";
  return out.str();
}

std::string describe(const TensorMapArgs& a) {
  std::ostringstream out;
  out << "dtype=" << a.dtype->name << " global_address=0x" << std::hex << a.address << std::dec
      << " dims=" << join(a.dims) << " strides_bytes=" << join(a.strides) << " box=" << join(a.box)
      << " element_strides=" << join(a.element_strides) << " interleave=" << a.interleave
      << " swizzle=" << a.swizzle << " l2_promotion=" << a.l2_promotion << " oob_fill=" << a.oob_fill;
  return out.str();
}

[[noreturn]] void invalid_tensor_map(const std::string& what) {
  throw py::value_error("tile_ops: encode_tensor_map: " + what);
}

}  // namespace

const TensorMapDtype* tensor_map_dtype(const std::string& name) {
  std::string accepted;
  for (const TensorMapDtype& d : kTensorMapDtypes) {
    if (name == d.name) return &d;
    accepted += accepted.empty() ? d.name : std::string(", ") + d.name;
  }
  invalid_tensor_map("dtype '" + name + "' is not supported (accepted: " + accepted + ")");
}

namespace {

void check_count(const char* what, const std::vector<int64_t>& v, size_t want, const char* meaning) {
  if (v.size() != want)
    invalid_tensor_map(std::string(what) + " has length " + std::to_string(v.size()) + ", want " +
                       std::to_string(want) + " (" + meaning + ")");
}

void check_each_in(const char* what, const std::vector<int64_t>& v, int64_t lo, int64_t hi) {
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] < lo || v[i] > hi)
      invalid_tensor_map(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(v[i]) +
                         " is out of range: each must be in " + std::to_string(lo) + ".." + std::to_string(hi));
}

void check_enum(const char* what, int v, int max, const char* accepted) {
  if (v < 0 || v > max)
    invalid_tensor_map(std::string(what) + " = " + std::to_string(v) + " is not accepted: use " + accepted);
}

}  // namespace

// The requirements documented for cuTensorMapEncodeTiled, checked here so that a bad spec is a
// ValueError naming the rule instead of a bare CUDA_ERROR_INVALID_VALUE (and needs no driver).
void validate(const TensorMapArgs& a) {
  const size_t rank = a.dims.size();
  if (rank < 1 || rank > 5)
    invalid_tensor_map("dims has length " + std::to_string(rank) + "; the rank must be 1..5 (dims innermost first)");
  check_count("strides_bytes", a.strides, rank - 1, "the byte strides of dims 1..rank-1; dim 0 is contiguous");
  check_count("box", a.box, rank, "one per dim");
  check_count("element_strides", a.element_strides, rank, "one per dim");
  check_enum("swizzle", a.swizzle, 3, "0 (none), 1 (32B), 2 (64B) or 3 (128B)");
  check_enum("interleave", a.interleave, 2, "0 (none), 1 (16B) or 2 (32B)");
  check_enum("l2_promotion", a.l2_promotion, 3, "0 (none), 1 (64B), 2 (128B) or 3 (256B)");
  check_enum("oob_fill", a.oob_fill, 1, "0 (zeros) or 1 (NaN, floating-point dtypes only)");
  if (a.oob_fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !a.dtype->is_float)
    invalid_tensor_map(std::string("oob_fill = 1 (NaN) needs a floating-point dtype, got ") + a.dtype->name);
  const bool interleaved = a.interleave != CU_TENSOR_MAP_INTERLEAVE_NONE;
  if (interleaved && rank < 3) invalid_tensor_map("interleave != 0 needs rank >= 3");
  const bool interleave32 = a.interleave == CU_TENSOR_MAP_INTERLEAVE_32B;
  if (interleave32 && a.swizzle != CU_TENSOR_MAP_SWIZZLE_32B)
    invalid_tensor_map("interleave = 2 (32B) needs swizzle = 1 (32B)");
  const uint64_t align = interleave32 ? 32 : 16;
  if (a.address % align != 0) {
    std::ostringstream msg;
    msg << "global_address 0x" << std::hex << a.address << std::dec << " must be " << align
        << "-byte aligned" << (interleave32 ? " with interleave = 2 (32B)" : "");
    invalid_tensor_map(msg.str());
  }
  check_each_in("dims", a.dims, 1, int64_t{1} << 32);
  for (size_t i = 0; i < a.strides.size(); ++i)
    if (a.strides[i] <= 0 || a.strides[i] % align != 0 || a.strides[i] >= (int64_t{1} << 40))
      invalid_tensor_map("strides_bytes[" + std::to_string(i) + "] = " + std::to_string(a.strides[i]) +
                         " must be a positive multiple of " + std::to_string(align) +
                         " bytes below 2^40 (strides are in bytes, for dims 1..rank-1)");
  check_each_in("box", a.box, 1, 256);
  check_each_in("element_strides", a.element_strides, 1, 8);
  const int64_t inner_bytes = a.box[0] * a.dtype->bytes;
  const std::string inner = "the inner box row, box[0] * " + std::to_string(a.dtype->bytes) + " = " +
                            std::to_string(inner_bytes) + " bytes,";
  if (!interleaved && inner_bytes % 16 != 0)
    invalid_tensor_map(inner + " must be a multiple of 16 bytes");
  const int64_t swizzle_span = int64_t{16} << a.swizzle;  // 32, 64, 128 bytes
  if (!interleaved && a.swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && inner_bytes > swizzle_span)
    invalid_tensor_map(inner + " must be <= the swizzle span of " + std::to_string(swizzle_span) +
                       " bytes (swizzle = " + std::to_string(a.swizzle) + ")");
}

namespace {

template <typename Out>
std::vector<Out> narrow(const std::vector<int64_t>& v) {  // validated ranges fit in Out
  return std::vector<Out>(v.begin(), v.end());
}

}  // namespace

CUtensorMap encode_tensor_map_locked(const TensorMapArgs& a, std::optional<int> device) {
  require_driver_locked();
  if (g_drv.cuTensorMapEncodeTiled == nullptr)
    throw std::runtime_error("tile_ops: encode_tensor_map: the CUDA driver has no cuTensorMapEncodeTiled; "
                             "TMA descriptors need a CUDA 12.0 or newer driver");
  const auto dims64 = narrow<uint64_t>(a.dims), strides64 = narrow<uint64_t>(a.strides);
  const auto box32 = narrow<uint32_t>(a.box), element_strides32 = narrow<uint32_t>(a.element_strides);
  std::optional<ContextScope> scope;  // the driver may want a context; a device picks its primary one
  if (device) scope.emplace(primary_context_locked(*device), nullptr);
  CUtensorMap map{};
  CUresult rc = g_drv.cuTensorMapEncodeTiled(
      &map, a.dtype->cu, static_cast<uint32_t>(a.dims.size()), reinterpret_cast<void*>(a.address),
      dims64.data(), strides64.data(), box32.data(), element_strides32.data(), a.interleave, a.swizzle,
      a.l2_promotion, a.oob_fill);
  if (rc != CUDA_SUCCESS)
    throw std::runtime_error(error_text(rc, "cuTensorMapEncodeTiled", nullptr) + " for " + describe(a));
  return map;
}

std::mutex& driver_mutex() { return g_mutex; }

void require_driver_locked() {
  try_load_driver_locked();
  if (!g_ok) throw std::runtime_error(g_load_error);
}

uint64_t function_generation_locked(CUfunction fn) {
  auto it = g_functions.find(fn);
  return it == g_functions.end() ? 0 : it->second.generation;
}

void launch_locked(CUfunction fn, const unsigned g[3], const unsigned b[3], unsigned smem, CUstream stream,
                   void** params, const char* kernel) {
  const FunctionInfo& info = g_functions.at(fn);
  CUcontext cur = nullptr;
  TILE_OPS_CHECK(g_drv.cuCtxGetCurrent(&cur), "cuCtxGetCurrent", kernel);
  if (cur != info.ctx) TILE_OPS_CHECK(g_drv.cuCtxSetCurrent(info.ctx), "cuCtxSetCurrent", kernel);
  CUresult rc;
  const bool ex = info.programmatic && g_drv.cuLaunchKernelEx != nullptr;
  if (ex) {
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    const CUlaunchConfig config{g[0], g[1], g[2], b[0], b[1], b[2], smem, stream, &attr, 1};
    rc = g_drv.cuLaunchKernelEx(&config, fn, params, nullptr);
  } else {
    rc = g_drv.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], smem, stream, params, nullptr);
  }
  if (cur != nullptr && cur != info.ctx) g_drv.cuCtxSetCurrent(cur);  // leave the caller's context alone
  if (rc != CUDA_SUCCESS) throw_cuda(rc, ex ? "cuLaunchKernelEx" : "cuLaunchKernel", kernel);
}

namespace {

py::bytes encode_tensor_map(const std::string& dtype, uint64_t global_address, std::vector<int64_t> dims,
                            std::vector<int64_t> strides_bytes, std::vector<int64_t> box,
                            std::vector<int64_t> element_strides, int swizzle, int interleave,
                            int l2_promotion, int oob_fill, std::optional<int> device) {
  const TensorMapArgs a{tensor_map_dtype(dtype), global_address, std::move(dims), std::move(strides_bytes),
                        std::move(box), std::move(element_strides), swizzle, interleave, l2_promotion,
                        oob_fill};
  validate(a);
  if (device && *device < 0) invalid_tensor_map("device must be >= 0 (or None for the current context)");
  std::lock_guard<std::mutex> lock(g_mutex);
  const CUtensorMap map = encode_tensor_map_locked(a, device);
  return py::bytes(reinterpret_cast<const char*>(&map), sizeof(map));
}

bool driver_available() {
  std::lock_guard<std::mutex> lock(g_mutex);
  try_load_driver_locked();
  return g_ok;
}

}  // namespace
}  // namespace tile_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tile_ops;
  m.doc() = "tile_ops CUDA driver launcher (libcuda is dlopen'ed on first use)";
  m.attr("API_VERSION") = kApiVersion;
  m.def("load_module", &load_module, py::arg("cubin"), py::arg("device"),
        "Load a cubin into the device's primary context; returns a module handle.");
  m.def("get_function", &get_function, py::arg("module"), py::arg("name"),
        py::arg("dynamic_smem_bytes") = 0, py::arg("programmatic") = false,
        "Look up a kernel; opts in to >48 KiB dynamic shared memory when asked.  programmatic: launch it\n"
        "with programmatic stream serialization (sm_90+; the kernel must griddepcontrol.wait first).");
  m.def("launch", &launch, py::arg("function"), py::arg("grid"), py::arg("block"),
        py::arg("smem"), py::arg("stream"), py::arg("args"), py::arg("kernel_name"),
        "Launch a kernel; each arg is an int (a 64-bit value, e.g. a device pointer) or bytes\n"
        "passed by value from an aligned copy (e.g. a CUtensorMap from encode_tensor_map).");
  m.def("unload_module", &unload_module, py::arg("module"));
  m.def("max_active_clusters", &max_active_clusters, py::arg("function"), py::arg("cluster"), py::arg("block_threads"),
        py::arg("smem"), "Clusters of a __cluster_dims__ kernel that fit at once; -1 if the driver cannot say.");
  m.def("driver_available", &driver_available,
        "True if libcuda.so.1 loads and cuInit succeeds.");
  m.def("encode_tensor_map", &encode_tensor_map, py::arg("dtype"), py::arg("global_address"),
        py::arg("dims"), py::arg("strides_bytes"), py::arg("box"), py::arg("element_strides"),
        py::arg("swizzle"), py::arg("interleave") = 0, py::arg("l2_promotion") = 2,
        py::arg("oob_fill") = 0, py::arg("device") = py::none(),
        "Encode a tiled TMA descriptor (cuTensorMapEncodeTiled); returns its 128 bytes, to pass\n"
        "to launch() by value.  dims are innermost first; strides_bytes are the byte strides of\n"
        "dims 1..rank-1.  device (optional) makes that device's primary context current for the call.");
  register_plans(m);
}
