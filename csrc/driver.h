// The CUDA driver layer of tile_ops._C, shared by the launcher (launcher.cpp: modules, launches,
// TMA descriptors for Python) and the ops' plans (plans.cpp: a repeated op call launched from C++).
//
// The driver is dlopen'ed on first use and only the subset of cuda.h below is declared, so the
// extension builds without a CUDA toolkit.  Functions named *_locked expect driver_mutex() held.

#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tile_ops {

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
constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
struct CUlaunchAttribute {  // cuda.h's CUlaunchAttribute_st: an id, then a 64-byte value union
  int id;
  char pad[8 - sizeof(int)];
  union alignas(8) {  // cuda.h's union holds pointers
    char bytes[64];
    int programmaticStreamSerializationAllowed;
  } value;
};
static_assert(sizeof(CUlaunchAttribute) == 72 && offsetof(CUlaunchAttribute, value) == 8,
              "CUlaunchAttribute as in cuda.h");
struct CUlaunchConfig {  // cuda.h's CUlaunchConfig_st
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned numAttrs;
};
static_assert(offsetof(CUlaunchConfig, hStream) == 32 && offsetof(CUlaunchConfig, attrs) == 40 &&
                  offsetof(CUlaunchConfig, numAttrs) == 48 && sizeof(CUlaunchConfig) == 56,
              "CUlaunchConfig as in cuda.h");

// TMA descriptor.  The driver docs ask for 64-byte alignment; cuda.h 13 declares it alignas(128),
// so we take the stricter one (it satisfies both).
constexpr size_t kTensorMapAlign = 128;
struct alignas(kTensorMapAlign) CUtensorMap { uint64_t opaque[16]; };
static_assert(sizeof(CUtensorMap) == 128, "CUtensorMap is 128 bytes");
enum CUtensorMapDataType : int {
  CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0,
  CU_TENSOR_MAP_DATA_TYPE_INT32 = 3,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7,
  CU_TENSOR_MAP_DATA_TYPE_FLOAT64 = 8,
  CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9,
};
// CUtensorMapInterleave / Swizzle / L2promotion / FloatOOBfill are plain ints 0..N here.
constexpr int CU_TENSOR_MAP_INTERLEAVE_NONE = 0;
constexpr int CU_TENSOR_MAP_INTERLEAVE_32B = 2;
constexpr int CU_TENSOR_MAP_SWIZZLE_NONE = 0;
constexpr int CU_TENSOR_MAP_SWIZZLE_32B = 1;
constexpr int CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA = 1;

struct TensorMapDtype {
  const char* name;
  CUtensorMapDataType cu;
  int64_t bytes;
  bool is_float;
};

struct TensorMapArgs {
  const TensorMapDtype* dtype;
  uint64_t address;
  std::vector<int64_t> dims, strides, box, element_strides;  // dims innermost first
  int swizzle, interleave, l2_promotion, oob_fill;
};

// ---- shared by launcher.cpp and plans.cpp ---------------------------------------

std::mutex& driver_mutex();

// Loads libcuda and runs cuInit once; throws RuntimeError (with the reason) when it is unusable.
void require_driver_locked();

// A number unique to `fn`'s current load (get_function), or 0 when it is not loaded: a function of a
// module loaded after an unload may reuse an unloaded one's address, never its generation.
uint64_t function_generation_locked(CUfunction fn);

// cuLaunchKernel in `fn`'s context (the caller's context is left as it was); a CUDA error is a
// RuntimeError naming `kernel`.  A function loaded as `programmatic` (get_function) is launched with
// programmatic stream serialization (cuLaunchKernelEx, sm_90+): it may start while the stream's previous
// kernel runs, and waits for that kernel's completion itself (griddepcontrol.wait at its entry).
void launch_locked(CUfunction fn, const unsigned grid[3], const unsigned block[3], unsigned smem,
                   CUstream stream, void** params, const char* kernel);

// The tensor map spec checked against cuTensorMapEncodeTiled's rules: a ValueError naming the rule.
const TensorMapDtype* tensor_map_dtype(const std::string& name);
void validate(const TensorMapArgs& a);

// cuTensorMapEncodeTiled for a validated spec (with `device`'s primary context current, if given).
CUtensorMap encode_tensor_map_locked(const TensorMapArgs& a, std::optional<int> device);

// Adds the plan functions to the module (plans.cpp).
void register_plans(pybind11::module_& m);

}  // namespace tile_ops
