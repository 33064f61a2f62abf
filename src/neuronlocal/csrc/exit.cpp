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
// takes the new one, and the new one, started from a thread of its own, holds no Python objects.
//
// Other C++ threads call Python too (the peak and fallback-site hooks run on autograd's
// threads, collective records on gloo's). After the drain the same hook closes the door they
// all go through (PythonCall): it waits, with the GIL released, for calls under way, and
// every later call skips Python instead of waiting for a GIL that finalization never gives.
#include "neuron.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/extension.h>

#include <chrono>
#include <thread>

namespace neuron {

namespace {
std::atomic<int> g_calls_in_flight{0};
std::atomic<bool> g_door_closed{false};

bool python_running() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}
}  // namespace

// Counted before the door is read, and the closer reads the count after closing it
// (sequentially consistent): either the call sees the door closed, or the closer waits for it.
PythonCall::PythonCall() {
  g_calls_in_flight.fetch_add(1);
  ok_ = !g_door_closed.load() && python_running();
  if (!ok_) g_calls_in_flight.fetch_sub(1);
}

bool python_calls_closed() { return g_door_closed.load(); }

PythonCall::~PythonCall() {
  if (ok_) g_calls_in_flight.fetch_sub(1);
}

// Called with the GIL held, from the atexit hook. A call under way may be waiting for the GIL,
// so the wait releases it. Bounded: a call stuck for other reasons must not hang the exit.
void close_python_calls() {
  g_door_closed.store(true);
  py::gil_scoped_release no_gil;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g_calls_in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void drain_autograd_threads() {
  std::vector<c10::DeviceIndex> used;
  for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
    if (memory_stats(i)["allocation.all.allocated"] > 0) used.push_back(i);
  }
  if (used.empty()) return;
  py::gil_scoped_release no_gil;  // a thread waiting for the GIL can finish its cleanup
  // From a fresh thread: its thread-local state is empty, so the drain's own tasks capture no
  // Python object (this thread's may hold saved-tensors hooks or modes, such as the dry run's
  // breakdown hook, and a task capturing them would need the GIL to drop them).
  std::thread drainer([&used]() {
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
  });
  drainer.join();
}

void prepare_exit() {
  drain_autograd_threads();
  close_python_calls();
}

void bind_exit(py::module_& m) {
  m.def("_prepare_exit", &prepare_exit,
        "wait until every used core's autograd thread is idle, then stop C++ threads calling "
        "Python (run at exit)");
  py::module_::import("atexit").attr("register")(m.attr("_prepare_exit"));
}

}  // namespace neuron
