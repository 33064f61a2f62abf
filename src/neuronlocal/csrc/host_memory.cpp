// Host memory of the allocator: the host buffers behind neuron blocks, reused by size class,
// and the host allocations of compiled graphs, counted against the core they run for.
#include "hbm.h"

#include <c10/core/CPUAllocator.h>

#include <cstring>

namespace neuron::hbm {
namespace {

// Host buffers of freed blocks, by size class, for the next allocation of that class: the
// host side of the cache the accounting models. Without it every optimizer step would map
// its temporaries afresh (page faults, zeroed pages), which plain CPU avoids through
// malloc's own reuse. Capped; empty_cache() releases them.
constexpr int64_t kHostCacheCap = 256 * kMiB;
HostCache& host_cache() {
  static auto* m = new HostCache();  // leaked, like mu()
  return *m;
}
int64_t g_host_cached = 0;

// Host allocations made while a compiled graph runs for a core (its workspace, the
// activations it saves for backward, its outputs) are counted against that core's HBM, as
// on Trainium, where a compiled graph's buffers live in device memory. Every other host
// allocation passes straight through. Counted blocks keep the CPU allocator's contract that
// a DataPtr's context is its data (raw_allocate users rely on it): the Block is found by
// address in a side table instead.
thread_local c10::DeviceIndex t_host_core = -1;

std::unordered_map<void*, Block*>& host_blocks() {
  static auto* m = new std::unordered_map<void*, Block*>();  // leaked, like mu()
  return *m;
}

// The CPU allocator as it was before install_host_allocator() wrapped it.
c10::Allocator* host_inner() {
  static c10::Allocator* inner = c10::GetCPUAllocator();
  return inner;
}

void host_free(void* p) {
  Block* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu());
    auto& m = host_blocks();
    auto it = m.find(p);
    if (it != m.end()) {
      b = it->second;
      m.erase(it);
    }
  }
  host_inner()->raw_deleter()(p);
  if (b) free_block(b);
}

struct HostAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (t_host_core < 0 || n == 0) return host_inner()->allocate(n);
    Block* b = account(t_host_core, static_cast<int64_t>(n));
    void* p = nullptr;
    try {
      p = host_inner()->raw_allocate(n);
    } catch (...) {
      free_block(b);
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mu());
      host_blocks().emplace(p, b);
    }
    return c10::DataPtr(p, p, &host_free, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

c10::DataPtr host_buffer(int64_t size) {
  {
    std::lock_guard<std::mutex> lock(mu());
    auto it = host_cache().find(size);
    if (it != host_cache().end() && !it->second.empty()) {
      auto dp = std::move(it->second.back());
      it->second.pop_back();
      g_host_cached -= size;
      return dp;
    }
  }
  return host_inner()->allocate(size);
}

void recycle(Block* b) {
  if (!b->host || g_host_cached + b->size > kHostCacheCap) return;
  g_host_cached += b->size;
  host_cache()[b->size].push_back(std::move(b->host));
}

HostCache take_host_cache() {
  HostCache out;
  out.swap(host_cache());
  g_host_cached = 0;
  return out;
}

bool host_counted(const c10::DataPtr& dp) {
  if (dp.get_deleter() != &host_free) return false;
  std::lock_guard<std::mutex> lock(mu());
  return host_blocks().count(dp.get()) > 0;
}

}  // namespace neuron::hbm

namespace neuron {

using namespace hbm;

void install_host_allocator() {
  static auto* a = [] {
    host_inner();  // remember the allocator being wrapped, before wrapping it
    auto* h = new HostAllocator();  // leaked: frees can run during interpreter shutdown
    c10::SetAllocator(c10::kCPU, h, /*priority=*/1);
    return h;
  }();
  (void)a;
}

c10::DeviceIndex set_host_core(c10::DeviceIndex index) {
  auto prev = t_host_core;
  t_host_core = index;
  return prev;
}

c10::DeviceIndex host_core() { return t_host_core; }

}  // namespace neuron
