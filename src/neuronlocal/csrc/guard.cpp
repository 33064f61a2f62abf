// Device guard and PrivateUse1 hooks: the C++ contracts PyTorch asks of a device.
//
// Python's stock guard (torch._C._acc) always reports device 0 and a count of 1, so a
// tensor on neuron:1 and a backward pass on it cannot work through it. This one keeps a
// thread-local current device, a per-device current stream, and host-timed events.
//
// The runtime starts at the first device use, as TorchNeuron's does: the device count,
// budgets and generators are set then, from the environment as it is at that moment, so a
// program may set NEURON_RT_VISIBLE_CORES after `import torch`. After the start they are
// fixed for the life of the process.
#include "dry.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

namespace neuron {
namespace {

std::atomic<c10::DeviceIndex> g_count{0};
std::atomic<bool> g_started{false};
std::function<bool()>* g_starter = nullptr;  // leaked: may run until the process is gone
thread_local c10::DeviceIndex t_device = 0;
// Stream ids per device for this thread; 0 is the default stream.
thread_local std::vector<c10::StreamId> t_stream;
std::atomic<c10::StreamId> g_next_stream{1};
std::mutex g_gen_mu;
std::vector<at::Generator> g_gens;

struct Event {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
};

c10::StreamId& stream_slot(c10::DeviceIndex index) {
  if (t_stream.size() <= static_cast<size_t>(index)) {
    t_stream.resize(index + 1, 0);
  }
  return t_stream[index];
}

struct NeuronGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kNeuron, t_device}; }
  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) {
      check_index(d.index());
      t_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    auto index = d.index() < 0 ? t_device : d.index();
    return c10::Stream(c10::Stream::UNSAFE, {kNeuron, index}, stream_slot(index));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, {kNeuron, d.index() < 0 ? t_device : d.index()});
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    auto index = d.index() < 0 ? t_device : d.index();
    return c10::Stream(c10::Stream::UNSAFE, {kNeuron, index}, g_next_stream++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return getNewStream(d, high_priority ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    stream_slot(s.device_index()) = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  // Execution is synchronous on the host (queued foreach runs are run first), so an event
  // completes when it is recorded and synchronizing has nothing to wait for.
  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*index*/,
              const c10::EventFlag /*flag*/) const override {
    settle();
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    e->when = std::chrono::steady_clock::now();
    e->recorded = true;
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void synchronizeEvent(void* /*event*/) const override {}
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override { settle(); }
  void synchronizeDevice(const c10::DeviceIndex /*index*/) const override { settle(); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* a, void* b, const c10::DeviceIndex /*index*/) const override {
    TORCH_CHECK(a && b, "Both events must be recorded before calculating elapsed time.");
    auto* e1 = static_cast<Event*>(a);
    auto* e2 = static_cast<Event*>(b);
    return std::chrono::duration<double, std::milli>(e2->when - e1->when).count();
  }
};

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex /*index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_current_device(index); }
  c10::DeviceIndex getCurrentDevice() const override { return t_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = t_device;
    set_current_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index < 0 ? t_device : index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return make_generator(index < 0 ? t_device : index);
  }
  at::Device getDeviceFromPtr(void* /*data*/) const override { return {kNeuron, t_device}; }
  bool isPinnedPtr(const void* /*data*/) const override { return true; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    // The allocator counts against the current core: make that the storage's own core,
    // so resizing a neuron:1 storage from neuron:0 keeps it (and its bytes) on neuron:1.
    const auto index = storage.device().index();
    const auto prev = t_device;
    if (index >= 0) t_device = index;
    at::DataPtr fresh;
    try {
      fresh = newsize ? allocator()->allocate(newsize) : at::DataPtr(nullptr, storage.device());
    } catch (...) {
      t_device = prev;
      throw;
    }
    t_device = prev;
    auto keep = std::min(newsize, impl->nbytes());
    if (keep && !dry_run()) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
    follow_resize(impl);
  }
};


}  // namespace

void set_starter(std::function<bool()> starter) {
  g_starter = new std::function<bool()>(std::move(starter));
}

bool started() { return g_started.load(std::memory_order_acquire); }

// Never throws: the guard's deviceCount() is noexcept. The starter serialises concurrent
// starts itself; a call made while this thread is starting returns without starting.
void ensure_started() noexcept {
  if (started() || g_starter == nullptr) return;
  bool ok = false;
  try {
    ok = (*g_starter)();
  } catch (...) {
  }
  if (!ok && !started()) {
    start(0, {}, "", "neuron device unavailable: the device runtime failed to start (see the "
                     "error printed above)");
  }
}

void start(int n, const std::vector<int64_t>& budgets, const std::string& hint,
           const std::string& unavailable_reason) {
  set_unavailable(unavailable_reason);
  set_budgets(budgets);
  set_oom_hint(hint);
  {
    std::lock_guard<std::mutex> lock(g_gen_mu);
    // Same default seed as the CPU generator, so unseeded streams match CPU too.
    while (g_gens.size() < static_cast<size_t>(n)) {
      g_gens.push_back(make_generator(static_cast<c10::DeviceIndex>(g_gens.size())));
    }
  }
  g_count = static_cast<c10::DeviceIndex>(n);
  g_started.store(true, std::memory_order_release);
}

c10::DeviceIndex device_count() {
  ensure_started();
  return g_count.load();
}

c10::DeviceIndex current_device() { return t_device; }

void set_current_device(c10::DeviceIndex index) {
  check_index(index);
  t_device = index;
}

void check_index(c10::DeviceIndex index) {
  check_available();  // starts the runtime
  auto n = g_count.load();
  TORCH_CHECK(index >= 0 && index < n, "Device index ", static_cast<int>(index),
              " is out of range. Valid range is 0 to ", static_cast<int>(n) - 1,
              " for this process (neuron:", static_cast<int>(index), " does not exist; "
              "this emulated instance has ", static_cast<int>(n), " logical NeuronCore(s). "
              "Use an index below ", static_cast<int>(n), ", or change NEURONLOCAL_INSTANCE / "
              "NEURON_LOGICAL_NC_CONFIG / NEURON_RT_VISIBLE_CORES).");
}

at::Generator& default_generator(c10::DeviceIndex index) {
  check_index(index);
  std::lock_guard<std::mutex> lock(g_gen_mu);
  return g_gens.at(index);
}

void register_guard_and_hooks() {
  static bool done = false;
  if (done) return;
  done = true;
  // Leaked on purpose: autograd's device threads and PyTorch's registries use them until
  // the process is gone, after static destructors have run ("pure virtual method called").
  c10::impl::registerDeviceGuard(kNeuron, new NeuronGuard());
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  // Backward passes run on the thread that calls backward(), as they do for CPU tensors.
  // Autograd would otherwise hand neuron nodes to a worker thread per device; its host
  // kernels then start a second OpenMP pool next to the caller's, and with more pool
  // threads than cores OpenMP stops spinning between parallel regions: every region of
  // the backward pass pays a futex sleep and wake (about 1400 per step of a small Llama).
  // The setting is the importing thread's (autograd keeps it per thread);
  // torch.autograd.set_multithreading_enabled(True) restores the worker threads.
  c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
}

}  // namespace neuron
