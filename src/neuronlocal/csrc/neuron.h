// The C++ core of neuronlocal: what PyTorch needs in C++ for a PrivateUse1 device.
//
// Python owns policy (config, hardware profiles, op placement, torch.neuron); C++ applies
// it, and does what the Python backend API cannot express or cannot do fast enough
// (docs/architecture.md). One concern per file:
//   module.cpp   the Python bindings (neuronlocal._C)
//   guard.cpp    device guard (current device, device count, streams, events) and hooks
//   memory.cpp   allocator over host memory with per-core HBM accounting and OOM
//   dispatch.cpp the boxed CPU fallback on zero-copy aliases, and the few explicit kernels
//   foreach.cpp  runs of elementwise foreach ops (optimizer steps), fused per tensor
//   autocast.cpp autocast for the AutocastPrivateUse1 key, with CUDA's op lists
//   bridge.cpp   CPU aliases in and neuron tensors out for compiled graphs
//   c10d.cpp     the `neuron` process-group backend, on gloo over CPU aliases
//   exit.cpp     at exit, lets each core's autograd thread finish before finalization
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <map>
#include <string>
#include <vector>

namespace neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- guard.cpp -------------------------------------------------------------
c10::DeviceIndex device_count();
void set_device_count(c10::DeviceIndex n);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
// Raises the CUDA-style error for an index outside [0, device_count).
void check_index(c10::DeviceIndex index);
at::Generator& default_generator(c10::DeviceIndex index);
void register_guard_and_hooks();

// ---- memory.cpp ------------------------------------------------------------
// Per-core accounting of an emulated caching allocator (see memory.cpp).
void set_budgets(const std::vector<int64_t>& bytes_per_core);
void set_oom_hint(const std::string& hint);
// Marks the device unusable (bad configuration): every later use raises `reason`.
void set_unavailable(const std::string& reason);
// Raises the configuration error set by set_unavailable, if any.
void check_available();
c10::Allocator* allocator();
// Neuron storage that keeps `cpu` alive and counts its bytes against core `index`.
c10::Storage adopt_storage(const c10::Storage& cpu, c10::DeviceIndex index);
// A data pointer for `nbytes` on core `index` owned by `owner` (an adopted CPU storage).
c10::DataPtr adopt_data(c10::Storage owner, c10::DeviceIndex index);
std::map<std::string, int64_t> memory_stats(c10::DeviceIndex index);
void reset_peak(c10::DeviceIndex index);
void reset_accumulated(c10::DeviceIndex index);
void empty_cache(c10::DeviceIndex index);
// Counts host allocations of this thread against core `index` (-1: off); returns the previous
// core. install_host_allocator() puts the counting wrapper in front of the CPU allocator.
void install_host_allocator();
c10::DeviceIndex set_host_core(c10::DeviceIndex index);
// Live bytes on a core over time, for the report: (seconds since start, bytes) samples.
std::vector<std::pair<double, int64_t>> memory_timeline(c10::DeviceIndex index);
void set_timeline(bool on);

// ---- dispatch.cpp ----------------------------------------------------------
// A CPU tensor over the bytes of a neuron tensor (no copy, keeps them alive). Runs queued
// foreach ops first (see settle()): use it for every read of neuron bytes outside dispatch.
at::Tensor cpu_alias(const at::Tensor& t);
// The neuron storage a CPU storage made by cpu_alias() stands for, or nullptr.
c10::StorageImpl* alias_source(const c10::Storage& cpu);
// The same alias without settling: for the dispatch path, which settles once per op.
at::Tensor alias_of(const at::Tensor& t);
void register_kernels();
void set_policy(bool downcast_64bit, bool strict);
void set_op_placement(const std::map<std::string, std::pair<int, std::string>>& ops,
                      int other_namespaces);
std::map<std::string, int64_t> executed_ops();
std::map<std::string, int64_t> fallback_ops();
std::map<std::string, std::pair<int64_t, int64_t>> fallback_bytes();  // to, from the host
std::map<std::string, int64_t> downcast_ops();
void clear_op_tracking();
// Registers the boxed fallback directly for ops whose PrivateUse1 entry would otherwise
// decompose into empty + out= (structured kernels), so they cost one dispatch, not two.
void register_direct(const std::vector<std::string>& names);

// ---- foreach.cpp -----------------------------------------------------------
enum class ForeachKind { None, InPlace, OutOfPlace };
// Whether `op` is an elementwise foreach op that may be queued, and of which kind.
ForeachKind foreach_kind(const c10::OperatorHandle& op);
// Queues the call on `stack` (leaving its results there) when its arguments allow; false
// when it must run now, through the normal path.
bool queue_foreach(const c10::OperatorHandle& op, ForeachKind kind, torch::jit::Stack* stack);
void run_queued_foreach();
extern std::atomic<bool> g_foreach_queued;
// Runs queued foreach ops, if any. Everything that reads or frees neuron bytes outside a
// queued op calls it first: dispatch of any other op, copies, aliases, memory queries.
inline void settle() {
  if (g_foreach_queued.load(std::memory_order_acquire)) run_queued_foreach();
}

}  // namespace neuron
