// The ops' eager fast path: a repeated call of an op launched from one C++ call.
//
// For a given input signature (the op, the shapes, strides, dtypes and devices of its tensor
// operands, and its scalar flags) every check and layout decision of an op comes out the same, so
// once the checked Python path has launched a signature's kernels on the caller's own tensors it
// records a plan here: the outputs to allocate and the launches.  plans_call then does, per call,
// what the Python path took ~12 µs for: the dispatcher checks, the signature lookup, the pointer
// alignment check, the output (and scratch) allocation and the driver launches.  A call it cannot
// serve returns None and the op takes its checked path, which reports every error.
//
// Python API (tile_ops/ops/fastpath.py is the only caller; INTERFACES.md):
//   plans_configure(plain_types: tuple[type, ...], stream_getter: callable | None)
//   plans_record(op, tensors, flags, outputs, program) -> bool
//   plans_call(op, tensors, flags, check_dispatch) -> Tensor | tuple[Tensor, ...] | None
//   plans_record_family(op, tensors, flags, var, sizes, strides, ranges, outputs, program) -> bool
//   plans_clear(); plans_size() -> int
// where `tensors` is a tuple of the op's tensor operands (None for an omitted optional one), `flags`
// a tuple of its scalar arguments (None, bool, int, float or torch.dtype), `outputs` a list of
// (shape, dtype), and `program` either (scratch, steps) -- scratch [(shape, dtype)], steps [(function,
// grid, block, smem, kernel_name, args)], args [(buffer, tensormap spec dict | None)] over the plan's
// buffers: the tensor operands, then the outputs, then the scratch buffers -- or a callable
// launch(*pointers), the pointers of those buffers in that order, for a launch that runs host code.  An
// argument (-1, int) is a 32-bit integer kernel parameter (a T.dynamic size) instead of a buffer.
//
// A family is one plan for every value m of a runtime size (a token count) in `ranges` [(lo, hi)]: m is read
// from tensor var = (index, dim) of a call; its tensors must have the `sizes` and `strides` given (per tensor,
// per dim); and every integer of its outputs, scratch, grids, value arguments and tensor-map dims and strides
// may be an expression of m: an int, or a tuple of (opcode, operand) pairs in postfix order (Expr below;
// tile_ops/compiler/meta.py's PlanExpr writes them).  A host launch of a family is called launch(*pointers, m).  A call
// with no plan of its own takes the first family that matches it: an unseen m stays on this path.

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <unordered_map>

#include "driver.h"

namespace py = pybind11;

namespace tile_ops {
namespace {

constexpr int kMaxTensors = 8;       // tensor operands of an op
constexpr int kMaxFlags = 8;         // scalar arguments of an op
constexpr int kMaxRank = 4;          // dims of a tensor operand
constexpr size_t kMaxPlans = 4096;   // cleared when full: varying shapes cannot grow it forever
constexpr int kDescriptorsPerMap = 4;  // TMA descriptors kept per tensor map (per pointer seen)
constexpr uint64_t kPointerAlignment = 16;
constexpr size_t kMaxArgs = 64;      // kernel arguments per step

// An integer of a plan: a constant, or an expression of a family's m in postfix order.
enum Opcode : int64_t { kConst, kVar, kAdd, kSub, kMul, kFloorDiv, kMod, kMin, kMax };
constexpr int kMaxExprDepth = 64;

struct Expr {
  std::vector<int64_t> code{kConst, 0};  // (opcode, operand) pairs

  // The value at m; false where it has none (a division by zero).
  bool eval(int64_t m, int64_t& out) const {
    int64_t stack[kMaxExprDepth];
    int n = 0;
    for (size_t i = 0; i < code.size(); i += 2) {
      const int64_t op = code[i];
      if (op == kConst || op == kVar) {
        stack[n++] = op == kConst ? code[i + 1] : m;
        continue;
      }
      const int64_t b = stack[--n], a = stack[n - 1];
      if (op == kFloorDiv || op == kMod) {
        if (b == 0) return false;
        const int64_t q = a / b - ((a % b != 0) && ((a < 0) != (b < 0)));  // Python's floor division
        stack[n - 1] = op == kFloorDiv ? q : a - q * b;
      } else {
        stack[n - 1] = op == kAdd ? a + b : op == kSub ? a - b : op == kMul ? a * b : op == kMin ? std::min(a, b)
                                                                                               : std::max(a, b);
      }
    }
    out = stack[0];
    return true;
  }

  int64_t value(int64_t m) const {  // of a checked plan's expression at a matched m
    int64_t v = 0;
    if (!eval(m, v)) throw std::runtime_error("tile_ops: plans: an expression of a family divides by zero");
    return v;
  }
};

// An int, or a tuple of (opcode, operand) pairs that evaluates with a stack of at most kMaxExprDepth.
Expr expr_of(py::handle h) {
  Expr e;
  if (!PyTuple_Check(h.ptr())) {
    e.code = {kConst, h.cast<int64_t>()};
    return e;
  }
  e.code = h.cast<std::vector<int64_t>>();
  int depth = 0;
  bool ok = !e.code.empty() && e.code.size() % 2 == 0;
  for (size_t i = 0; ok && i < e.code.size(); i += 2) {
    const int64_t op = e.code[i];
    ok = op >= kConst && op <= kMax;
    depth += op == kConst || op == kVar ? 1 : -1;
    ok = ok && depth >= 1 && depth <= kMaxExprDepth;
  }
  if (!ok || depth != 1) throw py::value_error("tile_ops: plans: a malformed expression of m");
  return e;
}

std::vector<Expr> exprs_of(py::handle seq) {
  std::vector<Expr> out;
  for (py::handle h : seq) out.push_back(expr_of(h));
  return out;
}

// The signature of a call: every field of it that the op's checks and layout decisions read.
struct Key {
  std::array<int64_t, 3 + kMaxTensors * (3 + 2 * kMaxRank) + 2 * kMaxFlags> words{};
  int n = 0;
  void add(int64_t w) { words[n++] = w; }
  bool operator==(const Key& o) const { return n == o.n && std::memcmp(words.data(), o.words.data(), n * 8) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < k.n; ++i) h = (h ^ static_cast<uint64_t>(k.words[i])) * 1099511628211ull;
    return h;
  }
};

struct TensorMapSlot {
  TensorMapArgs spec;  // the address is per call; dims and strides per m
  std::vector<Expr> dims, strides;
  std::array<uint64_t, kDescriptorsPerMap> address{};
  std::array<int64_t, kDescriptorsPerMap> m{};
  std::array<CUtensorMap, kDescriptorsPerMap> descriptor{};
  int filled = 0, next = 0;
};

struct Arg {
  int buffer;     // or kValue: `value` itself
  int tensormap;  // index into Plan::tensormaps, or -1: the buffer's pointer
  Expr value;
};

constexpr int kValue = -1;  // an argument (kValue, int): a 32-bit integer (a kernel's T.dynamic size), no buffer

struct Step {
  CUfunction function;
  uint64_t generation;  // of `function` when recorded: a reloaded kernel may get the same address
  Expr grid[3];
  unsigned block[3], smem;
  std::string name;
  std::vector<Arg> args;
};

struct Buffer {
  std::vector<Expr> shape;
  at::ScalarType dtype;
};

struct Plan {
  int tensors = 0;  // the tensor operands: buffers 0..tensors-1; the outputs follow, then the scratch
  std::vector<Buffer> outputs;
  py::object host_launch;  // a Python launch(*pointers) instead of steps
  std::vector<Buffer> scratch;
  std::vector<Step> steps;
  std::vector<TensorMapSlot> tensormaps;
};

// Plans are shared: a call keeps its plan alive through the Python it runs (the stream getter, a host launch),
// which may clear or refill the table; and a plan leaves the table before it is destroyed, since destroying
// one runs Python (its host launch's finalizer) that may come back into the table.
using Plans = std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash>;

struct Family {
  int var_tensor, var_dim;
  std::vector<std::vector<Expr>> sizes, strides;  // per tensor operand (empty: an omitted one)
  std::vector<std::array<int64_t, 2>> ranges;     // of m, sorted, disjoint
  std::shared_ptr<Plan> plan;
};
using Families = std::unordered_map<Key, std::vector<Family>, KeyHash>;  // by the signature without sizes
constexpr size_t kMaxFamilies = 1024;

struct State {
  Plans plans;
  Families families;
  std::vector<py::object> plain_types;  // torch.Tensor, torch.nn.Parameter: not subclasses (held: compared by identity)
  py::object stream_getter;                // stream_getter(device_index) -> raw cudaStream_t
};

State& state() {
  static State* s = new State();  // never destroyed: py::objects must not outlive the interpreter's teardown
  return *s;
}

bool is_plain(PyObject* obj) {
  for (const py::object& t : state().plain_types)
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) == t.ptr()) return true;
  return false;
}

// A dense strided CPU or CUDA tensor whose memory holds exactly its values: no negative / conjugate bit,
// zero tensor, functionalization, sparse or nested layout (their keys and strides may look plain).
bool is_dense(const at::Tensor& t) {
  if (t.layout() != c10::kStrided || t.is_nested()) return false;
  const c10::DispatchKeySet keys =
      t.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView - c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CUDA) || keys == c10::DispatchKeySet(c10::DispatchKey::CPU);
}

// The same rule as running the op through the dispatcher would apply: nothing to record (no
// autograd graph, no tracing), nothing that intercepts ops (dispatch or torch-function modes,
// functorch transforms).  torch.compile is ruled out by the Python caller (dynamo folds it there).
bool dispatcher_adds_nothing(const at::Tensor* const tensors[], int n) {
  if (c10::GradMode::is_enabled())
    for (int i = 0; i < n; ++i)
      if (tensors[i] != nullptr && tensors[i]->requires_grad()) return false;
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled()) return false;
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return !(included.has(c10::DispatchKey::Tracer) || included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
           included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode));
}

// Adds a scalar flag to `key` (its type, then its value); false for a type a plan cannot key on.
bool add_flag(PyObject* flag, Key& key) {
  key.add(reinterpret_cast<int64_t>(Py_TYPE(flag)));  // 1 == 1.0 == True, but the op may treat them differently
  if (flag == Py_None) {
    key.add(0);
  } else if (PyFloat_CheckExact(flag)) {
    const double value = PyFloat_AS_DOUBLE(flag);
    int64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    key.add(bits);
  } else if (PyLong_CheckExact(flag) || PyBool_Check(flag)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(flag, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    key.add(value);
  } else if (THPDtype_Check(flag)) {
    key.add(reinterpret_cast<int64_t>(flag));  // dtypes are singletons
  } else {
    return false;
  }
  return true;
}

// Fills `key`; false when the call cannot have a plan (an odd flag, a rank or a count the plans do not take).
// Without `sizes`: a family's key, whose sizes and strides the family itself checks.
bool make_key(int64_t op, const at::Tensor* const tensors[], int n, PyObject* flags, Key& key, bool sizes = true) {
  const Py_ssize_t n_flags = PyTuple_GET_SIZE(flags);
  if (n_flags > kMaxFlags) return false;
  key.add(op);
  key.add(n);
  for (int i = 0; i < n; ++i) {
    const at::Tensor* t = tensors[i];
    if (t == nullptr) {
      key.add(-1);
      continue;
    }
    const int64_t rank = t->dim();
    if (rank > kMaxRank) return false;
    key.add(rank);
    key.add(static_cast<int64_t>(t->scalar_type()));
    key.add((static_cast<int64_t>(t->device().type()) << 16) | static_cast<uint16_t>(t->device().index()));
    for (int64_t d = 0; sizes && d < rank; ++d) key.add(t->size(d));
    for (int64_t d = 0; sizes && d < rank; ++d) key.add(t->stride(d));
  }
  key.add(n_flags);
  for (Py_ssize_t i = 0; i < n_flags; ++i)
    if (!add_flag(PyTuple_GET_ITEM(flags, i), key)) return false;
  return true;
}

// The tensor operands (None: an omitted one); false when one is not a plain, dense tensor, there are
// more than a plan takes, or none at all.
bool unpack(PyObject* objs, const at::Tensor* tensors[kMaxTensors], int& n) {
  const Py_ssize_t count = PyTuple_GET_SIZE(objs);
  if (count > kMaxTensors) return false;
  n = static_cast<int>(count);
  bool any = false;
  for (int i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(objs, i);
    tensors[i] = nullptr;
    if (obj == Py_None) continue;
    if (!is_plain(obj)) return false;
    tensors[i] = &THPVariable_Unpack(obj);
    if (!is_dense(*tensors[i])) return false;
    any = true;
  }
  return any;
}

at::ScalarType scalar_type_of(py::handle dtype) {
  if (!THPDtype_Check(dtype.ptr())) throw py::type_error("tile_ops: plans: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

Buffer buffer_of(py::handle shape, py::handle dtype) {
  return Buffer{exprs_of(shape), scalar_type_of(dtype)};
}

// A spec's dims and strides at m.
TensorMapArgs at_m(const TensorMapSlot& slot, int64_t m) {
  TensorMapArgs a = slot.spec;
  for (size_t i = 0; i < slot.dims.size(); ++i) a.dims[i] = slot.dims[i].value(m);
  for (size_t i = 0; i < slot.strides.size(); ++i) a.strides[i] = slot.strides[i].value(m);
  return a;
}

// The slot of a spec whose dims and strides may be expressions of m (validated at `m0`, the recording call's).
TensorMapSlot tensormap_of(py::dict spec, int64_t m0) {
  TensorMapSlot slot;
  slot.dims = exprs_of(spec["dims"]);
  slot.strides = exprs_of(spec["strides"]);
  slot.spec = TensorMapArgs{tensor_map_dtype(spec["dtype"].cast<std::string>()),
                  0,
                  std::vector<int64_t>(slot.dims.size()),
                  std::vector<int64_t>(slot.strides.size()),
                  spec["box"].cast<std::vector<int64_t>>(),
                  spec["element_strides"].cast<std::vector<int64_t>>(),
                  spec["swizzle"].cast<int>(),
                  0,
                  spec["l2_promotion"].cast<int>(),
                  spec["oob_fill"].cast<int>()};
  validate(at_m(slot, m0));
  return slot;
}

void read_program(py::handle program, Plan& plan, int64_t m0 = 0) {
  if (PyCallable_Check(program.ptr())) {
    plan.host_launch = py::reinterpret_borrow<py::object>(program);
    return;
  }
  auto [scratch, steps] = program.cast<std::pair<py::list, py::list>>();
  for (py::handle s : scratch) {
    auto [shape, dtype] = s.cast<std::pair<py::object, py::object>>();
    plan.scratch.push_back(buffer_of(shape, dtype));
  }
  const int buffers = plan.tensors + static_cast<int>(plan.outputs.size() + plan.scratch.size());
  for (py::handle s : steps) {
    py::tuple t = s.cast<py::tuple>();
    if (t.size() != 6) throw py::value_error("tile_ops: plans: a step is (function, grid, block, smem, name, args)");
    Step step{reinterpret_cast<CUfunction>(t[0].cast<uint64_t>()), 0, {}, {}, t[3].cast<unsigned>(),
              t[4].cast<std::string>(), {}};
    std::vector<Expr> grid = exprs_of(t[1]);
    if (grid.size() != 3) throw py::value_error("tile_ops: plans: a step's grid has 3 extents");
    std::copy(grid.begin(), grid.end(), step.grid);
    auto block = t[2].cast<std::array<unsigned, 3>>();
    std::copy(block.begin(), block.end(), step.block);
    for (py::handle arg : t[5].cast<py::list>()) {
      auto [buffer, spec] = arg.cast<std::pair<int, py::object>>();
      if (buffer == kValue) {
        Expr value = expr_of(spec);
        const int64_t v = value.value(m0);
        if (v < INT32_MIN || v > INT32_MAX)
          throw py::value_error("tile_ops: plans: a value argument of kernel '" + step.name + "' is not a 32-bit int");
        step.args.push_back(Arg{kValue, -1, std::move(value)});
        continue;
      }
      if (buffer < 0 || buffer >= buffers)
        throw py::value_error("tile_ops: plans: argument buffer " + std::to_string(buffer) + " of kernel '" +
                              step.name + "' is not one of the plan's " + std::to_string(buffers) + " buffers");
      int tensormap = -1;
      if (!spec.is_none()) {
        tensormap = static_cast<int>(plan.tensormaps.size());
        plan.tensormaps.push_back(tensormap_of(spec.cast<py::dict>(), m0));
      }
      step.args.push_back(Arg{buffer, tensormap, {}});
    }
    if (step.args.size() > kMaxArgs)
      throw py::value_error("tile_ops: plans: kernel '" + step.name + "' has more than " +
                            std::to_string(kMaxArgs) + " arguments");
    {
      std::lock_guard<std::mutex> lock(driver_mutex());
      step.generation = function_generation_locked(step.function);
    }
    if (step.generation == 0)
      throw py::value_error("tile_ops: plans: kernel '" + step.name +
                            "' is not a loaded function (not from get_function, or unloaded)");
    plan.steps.push_back(std::move(step));
  }
}

const CUtensorMap* descriptor_locked(TensorMapSlot& slot, uint64_t address, int64_t m, std::optional<int> device) {
  for (int i = 0; i < slot.filled; ++i)
    if (slot.address[i] == address && slot.m[i] == m) return &slot.descriptor[i];
  const int i = slot.next;
  TensorMapArgs spec = at_m(slot, m);
  spec.address = address;
  slot.descriptor[i] = encode_tensor_map_locked(spec, device);
  slot.address[i] = address;
  slot.m[i] = m;
  slot.next = (i + 1) % kDescriptorsPerMap;
  slot.filled = std::max(slot.filled, i + 1);
  return &slot.descriptor[i];
}

uint64_t current_stream(int device) {
  State& s = state();
  if (!s.stream_getter) throw std::runtime_error("tile_ops: plans: no CUDA stream getter (a CPU-only torch?)");
  return s.stream_getter(device).cast<uint64_t>();
}

// The plan's launches on `pointers` (buffer -> address) at m; false when a kernel's module was unloaded.
bool run_steps(Plan& plan, const std::vector<uint64_t>& pointers, int device, int64_t m) {
  const uint64_t stream = current_stream(device);
  std::lock_guard<std::mutex> lock(driver_mutex());
  require_driver_locked();
  for (const Step& step : plan.steps)
    if (function_generation_locked(step.function) != step.generation) return false;
  const std::optional<int> context = device >= 0 ? std::optional<int>(device) : std::nullopt;  // else current
  for (const Step& step : plan.steps) {
    void* params[kMaxArgs];
    uint64_t values[kMaxArgs];  // at most kMaxArgs: checked when the plan was recorded
    for (size_t i = 0; i < step.args.size(); ++i) {
      const Arg& arg = step.args[i];
      values[i] = arg.buffer == kValue ? static_cast<uint64_t>(static_cast<uint32_t>(arg.value.value(m)))
                                       : pointers[arg.buffer];
      params[i] = arg.tensormap < 0 ? static_cast<void*>(&values[i])
                                    : const_cast<CUtensorMap*>(
                                          descriptor_locked(plan.tensormaps[arg.tensormap], values[i], m, context));
    }
    unsigned grid[3];
    for (int d = 0; d < 3; ++d) grid[d] = static_cast<unsigned>(step.grid[d].value(m));
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) continue;  // a size of 0: nothing to launch
    launch_locked(step.function, grid, step.block, step.smem, reinterpret_cast<CUstream>(stream), params,
                  step.name.c_str());
  }
  return true;
}

at::Tensor allocate(const Buffer& buffer, const at::Device& device, int64_t m) {
  std::vector<int64_t> shape(buffer.shape.size());
  for (size_t i = 0; i < shape.size(); ++i) shape[i] = buffer.shape[i].value(m);
  return at::empty(shape, at::TensorOptions().dtype(buffer.dtype).device(device));
}

// launch(*pointers), or a family's launch(*pointers, m), with no list or tuple in between.
void call_host_launch(const py::object& launch, const std::vector<uint64_t>& pointers, const int64_t* m) {
  std::vector<py::object> ints;
  std::vector<PyObject*> args;
  ints.reserve(pointers.size() + 1);
  args.reserve(pointers.size() + 1);
  for (uint64_t p : pointers) {
    ints.push_back(py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(p)));
    if (!ints.back()) throw py::error_already_set();
    args.push_back(ints.back().ptr());
  }
  if (m != nullptr) {
    ints.push_back(py::reinterpret_steal<py::object>(PyLong_FromLongLong(*m)));
    if (!ints.back()) throw py::error_already_set();
    args.push_back(ints.back().ptr());
  }
  PyObject* done = PyObject_Vectorcall(launch.ptr(), args.data(), args.size(), nullptr);
  if (done == nullptr) throw py::error_already_set();
  Py_DECREF(done);
}

// The op's result: its one output, or a tuple of them.
PyObject* result(std::vector<at::Tensor>& outputs) {
  if (outputs.size() == 1) return THPVariable_Wrap(std::move(outputs[0]));
  py::tuple all(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i)
    all[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outputs[i])));
  return all.release().ptr();
}

// Whether the call's tensors have the family's sizes and strides at m.
bool matches(const Family& f, const at::Tensor* const tensors[], int n, int64_t m) {
  for (int i = 0; i < n; ++i) {
    const at::Tensor* t = tensors[i];
    if (t == nullptr) continue;  // (the family's key has the omitted ones)
    for (int64_t d = 0; d < t->dim(); ++d) {
      int64_t size = 0, stride = 0;
      if (!f.sizes[i][d].eval(m, size) || size != t->size(d) || !f.strides[i][d].eval(m, stride) ||
          stride != t->stride(d))
        return false;
    }
  }
  return true;
}

// The plan of the first family that takes the call, and its m; null when none does.
std::shared_ptr<Plan> family_plan(int64_t op, const at::Tensor* const tensors[], int n, PyObject* flags, int64_t& m) {
  State& s = state();
  Key key;
  if (s.families.empty() || !make_key(op, tensors, n, flags, key, false)) return nullptr;
  auto it = s.families.find(key);
  if (it == s.families.end()) return nullptr;
  for (const Family& f : it->second) {
    m = tensors[f.var_tensor]->size(f.var_dim);
    auto r = std::upper_bound(f.ranges.begin(), f.ranges.end(), m,
                              [](int64_t x, const std::array<int64_t, 2>& range) { return x < range[0]; });
    if (r != f.ranges.begin() && m <= (r - 1)->at(1) && matches(f, tensors, n, m)) return f.plan;
  }
  return nullptr;
}

void forget(const std::shared_ptr<Plan>& plan) {  // a plan whose kernel was unloaded, exact or a family's
  State& s = state();
  for (auto it = s.plans.begin(); it != s.plans.end(); ++it)
    if (it->second == plan) {
      s.plans.erase(it);
      return;
    }
  for (auto& [key, families] : s.families)
    for (auto f = families.begin(); f != families.end(); ++f)
      if (f->plan == plan) {
        families.erase(f);
        return;
      }
}

// plans_call(op, tensors, flags, check_dispatch): the op's result, or None (no plan).
PyObject* plans_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "tile_ops: plans_call takes 4 arguments (op, tensors, flags, check_dispatch)");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "tile_ops: plans_call: tensors and flags must be tuples");
    return nullptr;
  }
  const int check_dispatch = PyObject_IsTrue(args[3]);
  if (check_dispatch < 0) return nullptr;
  const at::Tensor* tensors[kMaxTensors];
  int n = 0;
  if (!unpack(args[1], tensors, n)) Py_RETURN_NONE;
  if (check_dispatch && !dispatcher_adds_nothing(tensors, n)) Py_RETURN_NONE;
  Key key;
  if (!make_key(op, tensors, n, args[2], key)) Py_RETURN_NONE;
  State& s = state();
  auto it = s.plans.find(key);
  int64_t m = 0;
  // held: the table may change in the first Python call below
  const std::shared_ptr<Plan> held = it != s.plans.end() ? it->second : family_plan(op, tensors, n, args[2], m);
  if (!held) Py_RETURN_NONE;
  const bool family = it == s.plans.end();
  Plan& plan = *held;

  std::vector<uint64_t> pointers(n + plan.outputs.size() + plan.scratch.size(), 0);
  uint64_t misaligned = 0;
  const at::Tensor* first = nullptr;
  for (int i = 0; i < n; ++i) {
    if (tensors[i] == nullptr) continue;
    first = first ? first : tensors[i];
    pointers[i] = reinterpret_cast<uint64_t>(tensors[i]->data_ptr());
    misaligned |= pointers[i] % kPointerAlignment;
  }
  if (misaligned) Py_RETURN_NONE;  // the checked path says what is accepted
  const at::Device device = first->device();
  size_t next = n;
  std::vector<at::Tensor> outputs;
  outputs.reserve(plan.outputs.size());
  for (const Buffer& b : plan.outputs) {
    outputs.push_back(allocate(b, device, m));
    pointers[next++] = reinterpret_cast<uint64_t>(outputs.back().data_ptr());
  }
  std::vector<at::Tensor> scratch;  // freed on return: stream-ordered, like the checked path's workspace
  for (const Buffer& b : plan.scratch) {
    scratch.push_back(allocate(b, device, m));
    pointers[next++] = reinterpret_cast<uint64_t>(scratch.back().data_ptr());
  }
  if (plan.host_launch) {
    py::object launch = plan.host_launch;  // owned: the callback may clear the plans
    call_host_launch(launch, pointers, family ? &m : nullptr);
  } else if (!run_steps(plan, pointers, device.index(), m)) {
    forget(held);  // a kernel was unloaded: the checked path loads it again and records anew
    Py_RETURN_NONE;
  }
  return result(outputs);
  END_HANDLE_TH_ERRORS  // c10 errors keep their Python type (torch.OutOfMemoryError, ...)
}

bool plans_record(int64_t op, py::tuple tensor_args, py::tuple flags, py::list outputs, py::handle program) {
  const at::Tensor* tensors[kMaxTensors];
  int n = 0;
  Key key;
  if (!unpack(tensor_args.ptr(), tensors, n) || !make_key(op, tensors, n, flags.ptr(), key)) return false;
  auto plan = std::make_shared<Plan>();
  plan->tensors = n;
  for (py::handle o : outputs) {
    auto [shape, dtype] = o.cast<std::pair<py::object, py::object>>();
    plan->outputs.push_back(buffer_of(shape, dtype));
  }
  if (plan->outputs.empty()) throw py::value_error("tile_ops: plans: an op's plan makes at least one output");
  read_program(program, *plan);
  State& s = state();
  Plans dropped;  // destroyed on return, once the table is whole again
  if (s.plans.size() >= kMaxPlans) dropped.swap(s.plans);
  auto [slot, inserted] = s.plans.try_emplace(key, plan);
  if (!inserted) std::swap(slot->second, plan);  // the replaced plan is destroyed on return
  return true;
}

bool plans_record_family(int64_t op, py::tuple tensor_args, py::tuple flags, std::pair<int, int> var, py::list sizes,
                         py::list strides, std::vector<std::array<int64_t, 2>> ranges, py::list outputs,
                         py::handle program) {
  const at::Tensor* tensors[kMaxTensors];
  int n = 0;
  Key key;
  if (!unpack(tensor_args.ptr(), tensors, n) || !make_key(op, tensors, n, flags.ptr(), key, false)) return false;
  Family f{var.first, var.second, {}, {}, {}, std::make_shared<Plan>()};
  if (f.var_tensor < 0 || f.var_tensor >= n || tensors[f.var_tensor] == nullptr || f.var_dim < 0 ||
      f.var_dim >= tensors[f.var_tensor]->dim())
    throw py::value_error("tile_ops: plans: a family's var is (tensor, dim) of one of its tensors");
  if (static_cast<int>(sizes.size()) != n || static_cast<int>(strides.size()) != n)
    throw py::value_error("tile_ops: plans: a family gives sizes and strides for each tensor (None for an omitted one)");
  for (int i = 0; i < n; ++i) {
    f.sizes.push_back(tensors[i] ? exprs_of(sizes[i]) : std::vector<Expr>());
    f.strides.push_back(tensors[i] ? exprs_of(strides[i]) : std::vector<Expr>());
    if (tensors[i] && (f.sizes[i].size() != static_cast<size_t>(tensors[i]->dim()) || f.strides[i].size() != f.sizes[i].size()))
      throw py::value_error("tile_ops: plans: a family gives one size and one stride per dim of each tensor");
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i][0] > ranges[i][1] || (i > 0 && ranges[i][0] <= ranges[i - 1][1]))
      throw py::value_error("tile_ops: plans: a family's ranges of m are (lo, hi), lo <= hi, and disjoint");
  f.ranges = std::move(ranges);
  const int64_t m0 = tensors[f.var_tensor]->size(f.var_dim);
  auto r = std::upper_bound(f.ranges.begin(), f.ranges.end(), m0,
                            [](int64_t x, const std::array<int64_t, 2>& range) { return x < range[0]; });
  if (r == f.ranges.begin() || m0 > (r - 1)->at(1) || !matches(f, tensors, n, m0))
    throw py::value_error("tile_ops: plans: a family must take the call that records it");
  f.plan->tensors = n;
  for (py::handle o : outputs) {
    auto [shape, dtype] = o.cast<std::pair<py::object, py::object>>();
    f.plan->outputs.push_back(buffer_of(shape, dtype));
  }
  if (f.plan->outputs.empty()) throw py::value_error("tile_ops: plans: an op's plan makes at least one output");
  read_program(program, *f.plan, m0);
  State& s = state();
  Families dropped;  // destroyed on return, once the table is whole again
  size_t count = 0;
  for (const auto& [k, v] : s.families) count += v.size();
  if (count >= kMaxFamilies) dropped.swap(s.families);
  auto& families = s.families[key];
  families.insert(families.begin(), std::move(f));  // the newest first
  return true;
}

// Whether a family takes the call (its recording is then done once, not at every call of the checked path).
bool plans_in_family(int64_t op, py::tuple tensor_args, py::tuple flags) {
  const at::Tensor* tensors[kMaxTensors];
  int n = 0;
  int64_t m = 0;
  return unpack(tensor_args.ptr(), tensors, n) && family_plan(op, tensors, n, flags.ptr(), m) != nullptr;
}

void plans_configure(py::tuple plain_types, py::object stream_getter) {
  State& s = state();
  std::vector<py::object> types;
  for (py::handle t : plain_types) {
    if (!PyType_Check(t.ptr()) || PyObject_IsSubclass(t.ptr(), THPVariableClass) != 1)
      throw py::type_error("tile_ops: plans_configure: plain_types must be torch.Tensor and its subclasses");
    types.push_back(py::reinterpret_borrow<py::object>(t));
  }
  s.plain_types.swap(types);
  s.stream_getter = std::move(stream_getter);
  if (s.stream_getter.is_none()) s.stream_getter = py::object();
}

PyMethodDef kPlansCall = {"plans_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plans_call)),
                          METH_FASTCALL,
                          "plans_call(op, tensors, flags, check_dispatch): the result of the call's recorded "
                          "plan, launched, or None"};

}  // namespace

void register_plans(py::module_& m) {
  m.def("plans_configure", &plans_configure, py::arg("plain_types"), py::arg("stream_getter"),
        "The tensor types a plan may take (not subclasses) and the current-stream getter.");
  m.def("plans_record", &plans_record, py::arg("op"), py::arg("tensors"), py::arg("flags"), py::arg("outputs"),
        py::arg("program"), "Record the plan of a call's signature; False when it cannot have one.");
  m.def("plans_record_family", &plans_record_family, py::arg("op"), py::arg("tensors"), py::arg("flags"),
        py::arg("var"), py::arg("sizes"), py::arg("strides"), py::arg("ranges"), py::arg("outputs"),
        py::arg("program"), "Record one plan for the calls at every m of ranges; False when it cannot have one.");
  m.def("plans_in_family", &plans_in_family, py::arg("op"), py::arg("tensors"), py::arg("flags"),
        "Whether a recorded family takes this call.");
  m.def("plans_clear", []() {
    Plans dropped;  // destroyed on return, after the table is empty
    Families dropped_families;
    dropped.swap(state().plans);
    dropped_families.swap(state().families);
  });
  m.def("plans_size", []() { return state().plans.size(); });
  m.def("plans_families", []() {
    size_t count = 0;
    for (const auto& [key, families] : state().families) count += families.size();
    return count;
  });
  m.add_object("plans_call",  // (the module's name: what __module__ and pickle read)
               py::reinterpret_steal<py::object>(PyCFunction_NewEx(&kPlansCall, nullptr, m.attr("__name__").ptr())));
}

}  // namespace tile_ops
