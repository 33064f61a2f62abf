// Python bindings of the C++ core: module neuronlocal._C.
#include "dry.h"
#include "profiler_map.h"

#include <cstring>
#include <mutex>
#include <set>

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

namespace neuron {
std::pair<std::vector<py::object>, int> bridge_in(const std::vector<py::object>& args,
                                                  bool reuse, const std::vector<bool>& leaves);
std::vector<py::object> bridge_out(const std::vector<py::object>& outs, int index,
                                   const std::vector<bool>& to_neuron, bool detach_kept,
                                   bool keep_grad);
void bind_c10d(py::module_& m);  // c10d.cpp: the `neuron` process-group backend
void bind_exit(py::module_& m);  // exit.cpp: drain autograd threads before finalization
}  // namespace neuron

namespace {
// The folders of torch's and neuronlocal's Python code (with the trailing separator).
std::vector<std::string> library_dirs() {
  std::vector<std::string> dirs;
  for (const char* name : {"torch", "neuronlocal"}) {
    auto path = py::str(py::module_::import(name).attr("__file__")).cast<std::string>();
    dirs.push_back(path.substr(0, path.find_last_of("/\\") + 1));
  }
  return dirs;
}

// Whether `frame` runs torch's or neuronlocal's Python code. Needs the GIL; leaves no error set.
bool library_frame(PyFrameObject* frame) {
  static const std::vector<std::string> dirs = library_dirs();
  PyCodeObject* code = PyFrame_GetCode(frame);
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  Py_DECREF(code);
  if (file == nullptr) {
    PyErr_Clear();
    return false;
  }
  for (const auto& dir : dirs) {
    if (std::strncmp(file, dir.c_str(), dir.size()) == 0) return true;
  }
  return false;
}

// From `frame` (borrowed) outward, the first frame outside torch and neuronlocal (a new
// reference, nullptr if none); `level` counts the frames walked, 1 for `frame` itself.
PyFrameObject* first_program_frame(PyFrameObject* frame, int& level) {
  level = 1;
  Py_XINCREF(frame);
  while (frame != nullptr && library_frame(frame)) {
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
    ++level;
  }
  return frame;
}

// The warnings stack level of the innermost Python frame outside torch and neuronlocal:
// torch's wrappers (torch._compile's disable-Dynamo `inner` around nn.init, for one) and the
// compiler's graph runner are not where the program called the op. 1 when every frame is
// theirs. Needs the GIL; leaves no Python error set.
int user_stacklevel() {
  int level = 1;
  PyFrameObject* frame = first_program_frame(PyEval_GetFrame(), level);
  if (frame == nullptr) return 1;
  Py_DECREF(frame);
  return level;
}

// A SourceLocation's strings must outlive the warning, which the engine replays later.
const char* intern(const std::string& s) {
  static std::mutex mu;
  static auto* strings = new std::set<std::string>();  // leaked: a replay may come at exit
  std::lock_guard<std::mutex> lock(mu);
  return strings->insert(s).first->c_str();
}

// The program frame (new reference) that called into torch's `_engine_run_backward` on
// `frame`'s thread, or nullptr.
PyFrameObject* backward_caller(PyFrameObject* frame) {
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* name = PyUnicode_AsUTF8(code->co_name);
    Py_DECREF(code);
    if (name == nullptr) PyErr_Clear();
    PyFrameObject* back = PyFrame_GetBack(frame);
    const bool entry = name != nullptr && std::strcmp(name, "_engine_run_backward") == 0 &&
                       library_frame(frame);
    Py_DECREF(frame);
    if (entry) {
      int level = 0;
      PyFrameObject* found = first_program_frame(back, level);
      Py_XDECREF(back);
      return found;
    }
    frame = back;
  }
  return nullptr;
}

// Where the Python thread running the current backward called it: this thread's own (a
// reentrant backward) first, else the only other thread inside a backward. Several others:
// which one waits for this graph task cannot be told, so none. Needs the GIL.
bool backward_site(c10::SourceLocation& where) {
  py::dict threads = py::module_::import("sys").attr("_current_frames")();
  const auto self = static_cast<unsigned long>(PyThread_get_thread_ident());
  PyFrameObject* chosen = nullptr;
  int others = 0;
  for (auto item : threads) {
    const bool mine = item.first.cast<unsigned long>() == self;
    PyFrameObject* found =
        backward_caller(reinterpret_cast<PyFrameObject*>(item.second.ptr()));
    if (found == nullptr) continue;
    if (mine) {
      Py_XDECREF(chosen);
      chosen = found;
      others = 0;
      break;
    }
    ++others;
    Py_XDECREF(chosen);
    chosen = found;
  }
  if (chosen == nullptr || others > 1) {
    Py_XDECREF(chosen);
    return false;
  }
  PyCodeObject* code = PyFrame_GetCode(chosen);
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  const char* func = file != nullptr ? PyUnicode_AsUTF8(code->co_name) : nullptr;
  if (file != nullptr && func != nullptr) {
    where = c10::SourceLocation{intern(func), intern(file),
                                static_cast<uint32_t>(PyFrame_GetLineNumber(chosen))};
  }
  Py_DECREF(code);
  Py_DECREF(chosen);
  if (func == nullptr) PyErr_Clear();
  return func != nullptr;
}
}  // namespace

namespace neuron {
bool warn_in_python(const std::string& message) {
  PythonCall call;
  if (!call.ok()) return false;
  py::gil_scoped_acquire gil;
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  const int rc = PyErr_WarnEx(PyExc_UserWarning, message.c_str(), user_stacklevel());
  if (type != nullptr) {  // an error was pending: it stays the error, the warning's is dropped
    if (rc < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return true;
  }
  if (rc < 0) throw python_error();  // a filter turned the warning into an error
  return true;
}

bool warn_from_backward(const std::string& message) {
  c10::SourceLocation where{};
  {
    PythonCall call;
    if (!call.ok()) return false;
    // The thread that runs backward waits with the GIL released (torch's run_backward
    // releases it), as Python autograd Functions on this thread need too.
    py::gil_scoped_acquire gil;
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    PyErr_Fetch(&type, &value, &traceback);
    bool found = false;
    try {
      found = backward_site(where);
    } catch (const std::exception&) {  // best effort: c10's plain warning instead
    }
    PyErr_Restore(type, value, traceback);  // also clears any error the search left
    if (!found) return false;
  }
  // Verbatim: torch's Python handler issues it at `where`, with no C++ source appended.
  c10::warn(c10::Warning(c10::UserWarning(), where, message, /*verbatim=*/true));
  return true;
}
}  // namespace neuron

namespace {

// `starter` starts the runtime (core/state.py `start`), at the first device use; it may be
// called from any thread, so it takes the GIL. An error it raises is printed, and the device
// stays unavailable.
void init(py::function starter) {
  auto* fn = new py::object(std::move(starter));  // leaked: used until the process is gone
  neuron::set_starter([fn]() {
    neuron::PythonCall call;
    if (!call.ok()) return false;
    py::gil_scoped_acquire gil;
    try {
      (*fn)();
      return true;
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("starting the neuron device runtime");
      return false;
    }
  });
  neuron::register_guard_and_hooks();
  neuron::register_kernels();
  neuron::install_host_allocator();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "neuronlocal C++ core: device guard, HBM accounting, eager CPU-alias dispatch";
  m.def("_init", &init);
  m.def("_start", &neuron::start, "start the runtime with this many cores (called by the starter)");
  m.def("_started", &neuron::started);
  m.def("_device_count", []() { return static_cast<int>(neuron::device_count()); });
  m.def("_current_device", []() {
    neuron::check_available();
    return static_cast<int>(neuron::current_device());
  });
  m.def("_set_device", [](int i) { neuron::set_current_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("_check_index", [](int i) { neuron::check_index(static_cast<c10::DeviceIndex>(i)); });
  m.def("_default_generator", [](int i) { return neuron::default_generator(static_cast<c10::DeviceIndex>(i)); });
  // Memory queries first run queued foreach ops, whose arguments may be the last references
  // to tensors the caller already dropped: the numbers are those of ops run one by one.
  m.def("_memory_stats", [](int i) {
    neuron::settle();
    return neuron::memory_stats(static_cast<c10::DeviceIndex>(i));
  });
  m.def("_reset_peak", [](int i) {
    neuron::settle();
    neuron::reset_peak(static_cast<c10::DeviceIndex>(i));
  });
  m.def("_high_water_marks", [](int i) {
    neuron::settle();
    return neuron::high_water_marks(static_cast<c10::DeviceIndex>(i));
  }, "the run's peak (allocated, reserved) bytes of core i, across peak resets");
  m.def("_reset_high_water", [](int i) {
    neuron::settle();
    neuron::reset_high_water(static_cast<c10::DeviceIndex>(i));
  });
  m.def("_reset_accumulated", [](int i) { neuron::reset_accumulated(static_cast<c10::DeviceIndex>(i)); });
  m.def("_empty_cache", [](int i) {
    neuron::settle();
    neuron::empty_cache(static_cast<c10::DeviceIndex>(i));
  });
  m.def("_synchronize", &neuron::settle, "run queued work (foreach runs)");
  m.def("_memory_timeline", [](int i) { return neuron::memory_timeline(static_cast<c10::DeviceIndex>(i)); });
  m.def("_set_timeline", &neuron::set_timeline);
  m.def("_set_host_core", [](int i) {
    return static_cast<int>(neuron::set_host_core(static_cast<c10::DeviceIndex>(i)));
  }, "count this thread's host allocations against core i (-1: off); returns the previous");
  m.def("_cpu_alias", &neuron::cpu_alias, "zero-copy CPU view of a neuron tensor's bytes");
  m.def("_set_dry_run", &neuron::set_dry_run, "data-less neuron tensors and meta kernels");
  m.def("_dry_run", &neuron::dry_run);
  m.def("_set_dry_routing", &neuron::set_dry_routing,
        "dry-run routing of index outputs: < 0 balanced, else the fraction of rows on index 0");
  m.def("_dry_has_values", &neuron::dry_has_values,
        "whether a dry-run neuron tensor's storage holds real values");
  m.def("_dry_mark", &neuron::dry_mark,
        "marks a dry-run neuron tensor's storage as holding real values or not");
  m.def("_set_dry_read_hook", [](py::function hook) {
    auto* fn = new py::object(std::move(hook));  // leaked: called until the process is gone
    neuron::set_dry_read_hook([fn](const std::string& what) {
      neuron::PythonCall call;
      if (!call.ok()) return;
      py::gil_scoped_acquire gil;
      try {
        (*fn)(what);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("neuronlocal dry-run read hook");
      }
    });
  }, "called with the op each time a dry run reads a value it does not have");
  m.def("_peak_snapshot", [](int i) {
    neuron::settle();
    auto s = neuron::peak_snapshot(static_cast<c10::DeviceIndex>(i));
    return py::make_tuple(s.bytes, s.op, s.line, s.by_tag);
  }, "(bytes, op, user line, {tag: bytes}) of the live blocks at the high-water mark");
  m.def("_reset_peak_snapshot", [](int i) {
    neuron::reset_peak_snapshot(static_cast<c10::DeviceIndex>(i));
  });
  m.def("_tag_storage", &neuron::tag_storage, "marks what a tensor's storage holds");
  m.def("_set_peak_hook", [](py::function hook) {
    auto* fn = new py::object(std::move(hook));  // leaked: called until the process is gone
    neuron::set_peak_hook([fn]() -> std::string {
      neuron::PythonCall call;
      if (!call.ok()) return "";
      py::gil_scoped_acquire gil;
      try {
        return (*fn)().cast<std::string>();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("neuronlocal peak hook");
        return "";
      }
    });
  }, "called for the user's line when an op call sets a new high-water mark");
  m.def("_set_policy", &neuron::set_policy);
  m.def("_set_op_placement", &neuron::set_op_placement);
  m.def("_set_op_classes", &neuron::set_op_classes);
  m.def("_register_direct", &neuron::register_direct);
  m.def("_register_unsupported", &neuron::register_unsupported);
  m.def("_register_tracked", &neuron::register_tracked);
  m.def("_executed_ops", &neuron::executed_ops);
  m.def("_record_executed", [](const std::string& name, const std::string& overload) {
    neuron::executed_counter(name.c_str(), overload.c_str())++;
  }, "count one call of a device kernel implemented in Python");
  m.def("_fallback_ops", &neuron::fallback_ops);
  m.def("_fallback_bytes", &neuron::fallback_bytes);
  m.def("_downcast_ops", &neuron::downcast_ops);
  m.def("_clear_op_tracking", &neuron::clear_op_tracking);
  m.def("_set_profiler_mapping_enabled", &neuron::set_mapping_enabled,
        "record each op executed on neuron for the profiler's framework mapping");
  m.def("_get_profiler_mappings", []() {
    py::list data;
    for (const auto& m : neuron::take_mappings()) {
      py::list ops;
      for (const auto& op : m.ops) {
        py::dict d;
        d["seq_nr"] = op.seq_nr;
        d["th_id"] = op.th_id;
        d["stream_id"] = op.stream_id;
        ops.append(d);
      }
      py::dict entry;
      entry["nrta_seq_id"] = m.nrta_seq_id;
      entry["framework_op_exec_ids"] = ops;
      data.append(entry);
    }
    py::dict out;
    out["version"] = 1;
    out["data"] = data;
    return out;
  }, "the executions recorded since the last call ({version, data}); clears them");
  m.def("_set_fallback_site_hook", [](py::object hook) {
    if (hook.is_none()) return neuron::set_fallback_site_hook({});
    // Shared, released with the GIL held: the hook may be dropped on a thread without it.
    auto fn = std::shared_ptr<py::object>(new py::object(std::move(hook)), [](py::object* o) {
      neuron::PythonCall call;
      if (!call.ok()) return;  // leaked at shutdown
      py::gil_scoped_acquire gil;
      delete o;
    });
    neuron::set_fallback_site_hook([fn](const std::string& op) {
      neuron::PythonCall call;
      if (!call.ok()) return true;
      py::gil_scoped_acquire gil;
      try {
        return py::bool_((*fn)(op)).cast<bool>();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("neuronlocal fallback-site hook");
        return true;
      }
    });
  }, "called with an op's name at its first CPU fallbacks since _clear_op_tracking until it "
     "returns True (None: off)");
  m.def("_bridge_in", &neuron::bridge_in, "neuron tensors -> CPU aliases (and the core index)",
        py::arg("args"), py::arg("reuse") = false, py::arg("leaves") = std::vector<bool>{});
  m.def("_bridge_out", &neuron::bridge_out, "CPU results -> neuron tensors on a core",
        py::arg("outs"), py::arg("index"), py::arg("to_neuron") = std::vector<bool>{},
        py::arg("detach_kept") = false, py::arg("keep_grad") = false);
  neuron::bind_c10d(m);
  neuron::bind_exit(m);
}
