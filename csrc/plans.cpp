// The ops' eager fast path: a repeated call of an op launched from one C++ call.
//
// For a given input signature (shapes, strides, dtypes and devices of the operands, and the op's
// flags) every check and layout decision of an op comes out the same, so once the checked Python
// path has launched a signature's kernels on the caller's own tensors it records a plan here: the
// output to allocate and the launches.  plans_call then does, per call, what the Python path took
// ~12 µs for: the dispatcher checks, the signature lookup, the pointer alignment check, the output
// (and scratch) allocation and the driver launches.  A call it cannot serve returns None and the op
// takes its checked path, which reports every error.
//
// Python API (tile_ops/ops/fastpath.py is the only caller; INTERFACES.md):
//   plans_configure(plain_types: tuple[type, ...], stream_getter: callable | None)
//   plans_record(op, a, b, c, out_dtype, scale, out_shape, result_dtype, program) -> bool
//   plans_call(op, a, b, c, out_dtype, scale, check_dispatch) -> Tensor | None
//   plans_clear(); plans_size() -> int
// where `program` is either (scratch, steps) -- scratch [(shape, dtype)], steps [(function, grid,
// block, smem, kernel_name, args)], args [(buffer, tensormap spec dict | None)] over the buffers
// a=0, b=1, c=2, out=3, scratch 4.. -- or a callable launch(a_ptr, b_ptr, out_ptr, c_ptr) for a
// launcher that runs host code (tests' stand-in kernels).

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

constexpr int kOperands = 3;         // a, b and the optional c (gemm's bias)
constexpr int kOut = 3;              // buffer index of the output; scratch buffers follow
constexpr int kMaxRank = 3;          // the ops take 1-D to 3-D operands
constexpr size_t kMaxPlans = 4096;   // cleared when full: varying shapes cannot grow it forever
constexpr int kDescriptorsPerMap = 4;  // TMA descriptors kept per tensor map (per pointer seen)
constexpr uint64_t kPointerAlignment = 16;
constexpr size_t kMaxArgs = 64;      // kernel arguments per step

// The signature of a call: every field of it that the op's checks and layout decisions read.
struct Key {
  std::array<int64_t, 4 + kOperands * (3 + 2 * kMaxRank)> words{};
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
  int buffer;
  int tensormap;  // index into Plan::tensormaps, or -1: the buffer's pointer
};

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
  Buffer out;
  py::object host_launch;  // a Python launch(a, b, out, c) instead of steps
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
bool dispatcher_adds_nothing(const at::Tensor* const tensors[kOperands]) {
  if (c10::GradMode::is_enabled())
    for (int i = 0; i < kOperands; ++i)
      if (tensors[i] != nullptr && tensors[i]->requires_grad()) return false;
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled()) return false;
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return !(included.has(c10::DispatchKey::Tracer) || included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
           included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode));
}

// Fills `key`; false when the call cannot have a plan (an odd scale, a rank the ops do not take).
bool make_key(int64_t op, const at::Tensor* const tensors[kOperands], PyObject* out_dtype, PyObject* scale,
              Key& key) {
  key.add(op);
  for (int i = 0; i < kOperands; ++i) {
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
  key.add(reinterpret_cast<int64_t>(out_dtype));  // None or a torch.dtype: both singletons
  // The scale's type counts: 1 == 1.0 == True, but the op may treat them differently.
  key.add(reinterpret_cast<int64_t>(Py_TYPE(scale)));
  double value = 0.0;
  if (PyFloat_CheckExact(scale)) {
    value = PyFloat_AS_DOUBLE(scale);
  } else if (PyLong_CheckExact(scale) || PyBool_Check(scale)) {
    value = PyLong_AsDouble(scale);
    if (value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else if (scale != Py_None) {
    return false;
  }
  int64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  key.add(bits);
  return true;
}

// The operands as tensors (c may be None); false when one is not a plain, dense tensor.
bool unpack(PyObject* const objs[kOperands], const at::Tensor* tensors[kOperands]) {
  for (int i = 0; i < kOperands; ++i) {
    tensors[i] = nullptr;
    if (objs[i] == Py_None && i == kOperands - 1) continue;
    if (!is_plain(objs[i])) return false;
    tensors[i] = &THPVariable_Unpack(objs[i]);
    if (!is_dense(*tensors[i])) return false;
  }
  return true;
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
  const int buffers = kOut + 1 + static_cast<int>(plan.scratch.size());
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
      values[i] = pointers[arg.buffer];
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

// plans_call(op, a, b, c, out_dtype, scale, check_dispatch): the output, or None (no plan).
PyObject* plans_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "tile_ops: plans_call takes 7 arguments");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  const int check_dispatch = PyObject_IsTrue(args[6]);
  if (check_dispatch < 0) return nullptr;
  const at::Tensor* tensors[kOperands];
  if (!unpack(args + 1, tensors)) Py_RETURN_NONE;
  if (check_dispatch && !dispatcher_adds_nothing(tensors)) Py_RETURN_NONE;
  Key key;
  if (!make_key(op, tensors, args[4], args[5], key)) Py_RETURN_NONE;
  State& s = state();
  auto it = s.plans.find(key);
  if (it == s.plans.end()) Py_RETURN_NONE;
  const std::shared_ptr<Plan> held = it->second;  // the iterator dies with the first Python call below
  Plan& plan = *held;

  std::vector<uint64_t> pointers(kOut + 1 + plan.scratch.size(), 0);
  uint64_t misaligned = 0;
  for (int i = 0; i < kOperands; ++i) {
    if (tensors[i] == nullptr) continue;
    pointers[i] = reinterpret_cast<uint64_t>(tensors[i]->data_ptr());
    misaligned |= pointers[i] % kPointerAlignment;
  }
  if (misaligned) Py_RETURN_NONE;  // the checked path says what is accepted
  const at::Device device = tensors[0]->device();
  at::Tensor out = allocate(plan.out, device);
  pointers[kOut] = reinterpret_cast<uint64_t>(out.data_ptr());
  std::vector<at::Tensor> scratch;  // freed on return: stream-ordered, like the checked path's workspace
  for (const Buffer& b : plan.scratch) {
    scratch.push_back(allocate(b, device));
    pointers[kOut + scratch.size()] = reinterpret_cast<uint64_t>(scratch.back().data_ptr());
  }
  if (plan.host_launch) {
    py::object launch = plan.host_launch;  // owned: the callback may clear the plans
    launch(pointers[0], pointers[1], pointers[kOut], pointers[2]);
  } else if (!run_steps(plan, pointers, device.index())) {
    auto again = s.plans.find(key);  // a kernel was unloaded: the checked path loads it again and records anew
    if (again != s.plans.end() && again->second == held) s.plans.erase(again);
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS  // c10 errors keep their Python type (torch.OutOfMemoryError, ...)
}

bool plans_record(int64_t op, py::handle a, py::handle b, py::handle c, py::handle out_dtype, py::handle scale,
                  py::handle out_shape, py::handle result_dtype, py::handle program) {
  PyObject* objs[kOperands] = {a.ptr(), b.ptr(), c.ptr()};
  const at::Tensor* tensors[kOperands];
  Key key;
  if (!unpack(objs, tensors) || !make_key(op, tensors, out_dtype.ptr(), scale.ptr(), key)) return false;
  auto plan = std::make_shared<Plan>();
  plan->out = buffer_of(out_shape, result_dtype);
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
                          "plans_call(op, a, b, c, out_dtype, scale, check_dispatch): the output of the "
                          "call's recorded plan, launched, or None"};

}  // namespace

void register_plans(py::module_& m) {
  m.def("plans_configure", &plans_configure, py::arg("plain_types"), py::arg("stream_getter"),
        "The tensor types a plan may take (not subclasses) and the current-stream getter.");
  m.def("plans_record", &plans_record, py::arg("op"), py::arg("a"), py::arg("b"), py::arg("c"),
        py::arg("out_dtype"), py::arg("scale"), py::arg("out_shape"), py::arg("result_dtype"),
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
