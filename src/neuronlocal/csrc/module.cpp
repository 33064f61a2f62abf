// Python bindings of the C++ core: module neuronlocal._C.
#include "neuron.h"

#include <torch/extension.h>

namespace neuron {
std::pair<std::vector<py::object>, int> bridge_in(const std::vector<py::object>& args);
std::vector<py::object> bridge_out(const std::vector<py::object>& outs, int index);
void bind_c10d(py::module_& m);  // c10d.cpp: the `neuron` process-group backend
void bind_exit(py::module_& m);  // exit.cpp: drain autograd threads before finalization
}  // namespace neuron

namespace {

void init(int device_count, const std::vector<int64_t>& budgets, const std::string& hint) {
  neuron::register_guard_and_hooks();
  neuron::set_device_count(static_cast<c10::DeviceIndex>(device_count));
  neuron::set_budgets(budgets);
  neuron::set_oom_hint(hint);
  neuron::register_kernels();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "neuronlocal C++ core: device guard, HBM accounting, eager CPU-alias dispatch";
  m.def("_init", &init);
  m.def("_device_count", []() { return static_cast<int>(neuron::device_count()); });
  m.def("_current_device", []() { return static_cast<int>(neuron::current_device()); });
  m.def("_set_device", [](int i) { neuron::set_current_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("_check_index", [](int i) { neuron::check_index(static_cast<c10::DeviceIndex>(i)); });
  m.def("_default_generator", [](int i) { return neuron::default_generator(static_cast<c10::DeviceIndex>(i)); });
  m.def("_memory_stats", [](int i) { return neuron::memory_stats(static_cast<c10::DeviceIndex>(i)); });
  m.def("_reset_peak", [](int i) { neuron::reset_peak(static_cast<c10::DeviceIndex>(i)); });
  m.def("_reset_accumulated", [](int i) { neuron::reset_accumulated(static_cast<c10::DeviceIndex>(i)); });
  m.def("_empty_cache", [](int i) { neuron::empty_cache(static_cast<c10::DeviceIndex>(i)); });
  m.def("_memory_timeline", [](int i) { return neuron::memory_timeline(static_cast<c10::DeviceIndex>(i)); });
  m.def("_set_timeline", &neuron::set_timeline);
  m.def("_cpu_alias", &neuron::cpu_alias, "zero-copy CPU view of a neuron tensor's bytes");
  m.def("_set_policy", &neuron::set_policy);
  m.def("_set_cpu_fallback_ops", &neuron::set_cpu_fallback_ops);
  m.def("_register_direct", &neuron::register_direct);
  m.def("_executed_ops", &neuron::executed_ops);
  m.def("_fallback_ops", &neuron::fallback_ops);
  m.def("_downcast_ops", &neuron::downcast_ops);
  m.def("_clear_op_tracking", &neuron::clear_op_tracking);
  m.def("_bridge_in", &neuron::bridge_in, "neuron tensors -> CPU aliases (and the core index)");
  m.def("_bridge_out", &neuron::bridge_out, "CPU results -> neuron tensors on a core");
  neuron::bind_c10d(m);
  neuron::bind_exit(m);
}
