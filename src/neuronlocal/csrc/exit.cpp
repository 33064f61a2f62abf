// What has to happen before the interpreter finalizes: no autograd thread of a core may
// still hold work that needs the GIL.
//
// Backward on neuron tensors runs on the autograd engine's thread for the core (CUDA works
// the same way). That thread often drops the last reference to a finished graph task after
// the caller has moved on, and the task holds Python objects (torch's backward stashes a
// contextvars.Context in the thread-local state every task captures), so dropping it takes
// the GIL. If the interpreter is finalizing by then, CPython ends the thread inside a
// noexcept destructor and a script that succeeded aborts at exit ("terminate called without
// an active exception"). An atexit hook therefore runs one tiny backward per used core with
// the GIL released: a core's thread finishes its previous task, cleanup included, before it
// takes the new one, and the new one holds no Python objects.
#include "neuron.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/extension.h>

namespace neuron {

void drain_autograd_threads() {
  std::vector<c10::DeviceIndex> used;
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    if (memory_stats(i)["allocation.all.allocated"] > 0) used.push_back(i);
  }
  if (used.empty()) return;
  py::gil_scoped_release no_gil;  // a thread waiting for the GIL can finish its cleanup
  for (auto i : used) {
    try {
      c10::InferenceMode no_inference(false);
      at::AutoGradMode grad(true);
      auto x = at::ones({1}, at::TensorOptions().device(kNeuron, i)).requires_grad_(true);
      auto y = x * 2;
      torch::autograd::grad({y}, {x}, {at::ones_like(y)});
    } catch (const std::exception&) {
      // Best effort at exit: a core that cannot run it has no task to drain either.
    }
  }
}

void bind_exit(py::module_& m) {
  m.def("_drain_autograd_threads", &drain_autograd_threads,
        "wait until every used core's autograd thread is idle (run at exit)");
  py::module_::import("atexit").attr("register")(m.attr("_drain_autograd_threads"));
}

}  // namespace neuron
