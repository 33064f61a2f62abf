#include "profiler_map.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <mutex>

#include "neuron.h"

namespace neuron {

std::atomic<bool> g_mapping_on{false};

namespace {
std::mutex g_map_mu;
std::vector<OpMapping> g_mappings;
int64_t g_next_seq = 1;
}  // namespace

void set_mapping_enabled(bool on) { g_mapping_on.store(on, std::memory_order_release); }

void record_mapping() {
  const auto* impl = c10::impl::getDeviceGuardImpl(kNeuron);
  const int64_t stream = impl->getStream(c10::Device(kNeuron, current_device())).id();
  FrameworkOpExec op{static_cast<int64_t>(at::sequence_number::peek()),
                     at::RecordFunction::currentThreadId(), stream};
  std::lock_guard<std::mutex> lock(g_map_mu);
  g_mappings.push_back({g_next_seq++, {op}});
}

std::vector<OpMapping> take_mappings() {
  std::lock_guard<std::mutex> lock(g_map_mu);
  std::vector<OpMapping> out;
  out.swap(g_mappings);
  return out;
}

}  // namespace neuron
