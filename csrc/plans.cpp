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
//   plans_clear(); plans_size() -> int
// where `tensors` is a tuple of the op's tensor operands (None for an omitted optional one), `flags`
// a tuple of its scalar arguments (None, bool, int, float or torch.dtype), `outputs` a list of
// (shape, dtype), and `program` either (scratch, steps) -- scratch [(shape, dtype)], steps [(function,
// grid, block, smem, kernel_name, args)], args [(buffer, tensormap spec dict | None)] over the plan's
// buffers: the tensor operands, then the outputs, then the scratch buffers -- or a callable
// launch(*pointers), the pointers of those buffers in that order, for a launch that runs host code.  An
// argument (-1, int) is a 32-bit integer kernel parameter (a T.dynamic size) instead of a buffer.

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
  TensorMapArgs spec;  // the address is per call
  std::array<uint64_t, kDescriptorsPerMap> address{};
  std::array<CUtensorMap, kDescriptorsPerMap> descriptor{};
  int filled = 0, next = 0;
};

struct Arg {
  int buffer;     // or kValue: `value` itself
  int tensormap;  // index into Plan::tensormaps, or -1: the buffer's pointer
  int64_t value = 0;
};

constexpr int kValue = -1;  // an argument (kValue, int): a 32-bit integer (a kernel's T.dynamic size), no buffer

struct Step {
  CUfunction function;
  uint64_t generation;  // of `function` when recorded: a reloaded kernel may get the same address
  unsigned grid[3], block[3], smem;
  std::string name;
  std::vector<Arg> args;
};

struct Buffer {
  std::vector<int64_t> shape;
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

struct State {
  Plans plans;
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
bool make_key(int64_t op, const at::Tensor* const tensors[], int n, PyObject* flags, Key& key) {
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
    for (int64_t d = 0; d < rank; ++d) key.add(t->size(d));
    for (int64_t d = 0; d < rank; ++d) key.add(t->stride(d));
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
  return Buffer{shape.cast<std::vector<int64_t>>(), scalar_type_of(dtype)};
}

TensorMapArgs tensormap_of(py::dict spec) {
  TensorMapArgs a{tensor_map_dtype(spec["dtype"].cast<std::string>()),
                  0,
                  spec["dims"].cast<std::vector<int64_t>>(),
                  spec["strides"].cast<std::vector<int64_t>>(),
                  spec["box"].cast<std::vector<int64_t>>(),
                  spec["element_strides"].cast<std::vector<int64_t>>(),
                  spec["swizzle"].cast<int>(),
                  0,
                  spec["l2_promotion"].cast<int>(),
                  spec["oob_fill"].cast<int>()};
  validate(a);
  return a;
}

void read_program(py::handle program, Plan& plan) {
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
    auto grid = t[1].cast<std::array<unsigned, 3>>(), block = t[2].cast<std::array<unsigned, 3>>();
    std::copy(grid.begin(), grid.end(), step.grid);
    std::copy(block.begin(), block.end(), step.block);
    for (py::handle arg : t[5].cast<py::list>()) {
      auto [buffer, spec] = arg.cast<std::pair<int, py::object>>();
      if (buffer == kValue) {
        const int64_t value = spec.cast<int64_t>();
        if (value < INT32_MIN || value > INT32_MAX)
          throw py::value_error("tile_ops: plans: a value argument of kernel '" + step.name + "' is not a 32-bit int");
        step.args.push_back(Arg{kValue, -1, value});
        continue;
      }
      if (buffer < 0 || buffer >= buffers)
        throw py::value_error("tile_ops: plans: argument buffer " + std::to_string(buffer) + " of kernel '" +
                              step.name + "' is not one of the plan's " + std::to_string(buffers) + " buffers");
      int tensormap = -1;
      if (!spec.is_none()) {
        tensormap = static_cast<int>(plan.tensormaps.size());
        plan.tensormaps.push_back(TensorMapSlot{tensormap_of(spec.cast<py::dict>())});
      }
      step.args.push_back(Arg{buffer, tensormap});
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

const CUtensorMap* descriptor_locked(TensorMapSlot& slot, uint64_t address, std::optional<int> device) {
  for (int i = 0; i < slot.filled; ++i)
    if (slot.address[i] == address) return &slot.descriptor[i];
  const int i = slot.next;
  slot.spec.address = address;
  slot.descriptor[i] = encode_tensor_map_locked(slot.spec, device);
  slot.address[i] = address;
  slot.next = (i + 1) % kDescriptorsPerMap;
  slot.filled = std::max(slot.filled, i + 1);
  return &slot.descriptor[i];
}

uint64_t current_stream(int device) {
  State& s = state();
  if (!s.stream_getter) throw std::runtime_error("tile_ops: plans: no CUDA stream getter (a CPU-only torch?)");
  return s.stream_getter(device).cast<uint64_t>();
}

// The plan's launches on `pointers` (buffer -> address); false when a kernel's module was unloaded.
bool run_steps(Plan& plan, const std::vector<uint64_t>& pointers, int device) {
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
      values[i] = arg.buffer == kValue ? static_cast<uint64_t>(static_cast<uint32_t>(arg.value)) : pointers[arg.buffer];
      params[i] = arg.tensormap < 0
                      ? static_cast<void*>(&values[i])
                      : const_cast<CUtensorMap*>(descriptor_locked(plan.tensormaps[arg.tensormap], values[i], context));
    }
    launch_locked(step.function, step.grid, step.block, step.smem, reinterpret_cast<CUstream>(stream), params,
                  step.name.c_str());
  }
  return true;
}

at::Tensor allocate(const Buffer& buffer, const at::Device& device) {
  return at::empty(buffer.shape, at::TensorOptions().dtype(buffer.dtype).device(device));
}

// launch(*pointers), with no list or tuple in between.
void call_host_launch(const py::object& launch, const std::vector<uint64_t>& pointers) {
  std::vector<py::object> ints;
  std::vector<PyObject*> args;
  ints.reserve(pointers.size());
  args.reserve(pointers.size());
  for (uint64_t p : pointers) {
    ints.push_back(py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(p)));
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
  if (it == s.plans.end()) Py_RETURN_NONE;
  const std::shared_ptr<Plan> held = it->second;  // the iterator dies with the first Python call below
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
    outputs.push_back(allocate(b, device));
    pointers[next++] = reinterpret_cast<uint64_t>(outputs.back().data_ptr());
  }
  std::vector<at::Tensor> scratch;  // freed on return: stream-ordered, like the checked path's workspace
  for (const Buffer& b : plan.scratch) {
    scratch.push_back(allocate(b, device));
    pointers[next++] = reinterpret_cast<uint64_t>(scratch.back().data_ptr());
  }
  if (plan.host_launch) {
    py::object launch = plan.host_launch;  // owned: the callback may clear the plans
    call_host_launch(launch, pointers);
  } else if (!run_steps(plan, pointers, device.index())) {
    auto again = s.plans.find(key);  // a kernel was unloaded: the checked path loads it again and records anew
    if (again != s.plans.end() && again->second == held) s.plans.erase(again);
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
  m.def("plans_clear", []() {
    Plans dropped;  // destroyed on return, after the table is empty
    dropped.swap(state().plans);
  });
  m.def("plans_size", []() { return state().plans.size(); });
  m.add_object("plans_call",  // (the module's name: what __module__ and pickle read)
               py::reinterpret_steal<py::object>(PyCFunction_NewEx(&kPlansCall, nullptr, m.attr("__name__").ptr())));
}

}  // namespace tile_ops
