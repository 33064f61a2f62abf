// The neuron device allocator and the memory API over the per-core accounting (hbm.cpp):
// stats, peak and high-water resets, the cache, the timeline, and the peak's breakdown.
#include "dry.h"
#include "hbm.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <cstring>

namespace neuron {

using namespace hbm;

namespace {

using c10::CachingDeviceAllocator::DeviceStats;

void copy_stat(const Stat* from, c10::CachingAllocator::StatArray& to) {
  for (int k = 0; k < 3; ++k) {
    to[k].current = from[k].current;
    to[k].peak = from[k].peak;
    to[k].allocated = from[k].allocated;
    to[k].freed = from[k].freed;
  }
}

// A DeviceAllocator, so torch.accelerator's memory API (memory_stats, max_memory_allocated,
// reset_peak_memory_stats, empty_cache, ...) reads and resets the same counters as
// torch.neuron's.
struct NeuronAllocator final : public c10::DeviceAllocator {
  bool initialized() override { return started() && !g_unavailable.load(); }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    settle();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) empty_cache(i);
  }
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    settle();
    check_available();
    DeviceStats out;
    std::lock_guard<std::mutex> lock(mu());
    Core& c = core(device);
    copy_stat(c.allocation, out.allocation);
    copy_stat(c.segment, out.segment);
    copy_stat(c.allocation, out.active);
    copy_stat(c.allocated_bytes, out.allocated_bytes);
    copy_stat(c.reserved_bytes, out.reserved_bytes);
    copy_stat(c.active_bytes, out.active_bytes);
    copy_stat(c.requested_bytes, out.requested_bytes);
    out.num_alloc_retries = c.num_alloc_retries;
    out.num_ooms = c.num_ooms;
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override { reset_accumulated(device); }
  void resetPeakStats(c10::DeviceIndex device) override {
    settle();
    reset_peak(device);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    settle();
    check_available();
    std::lock_guard<std::mutex> lock(mu());
    Core& c = core(device);
    return {static_cast<size_t>(c.budget - c.reserved_bytes[0].current),
            static_cast<size_t>(c.budget)};
  }

  c10::DataPtr allocate(size_t n) override {
    if (g_unavailable.load(std::memory_order_relaxed)) check_available();
    auto index = current_device();
    c10::Device dev(kNeuron, index);
    if (n == 0) return c10::DataPtr(nullptr, dev);
    Block* b = account(index, static_cast<int64_t>(n));
    if (dry_run()) return dry_ptr(b, dev);
    try {
      b->host = host_buffer(b->size);
    } catch (...) {
      free_block(b);
      throw;
    }
    return c10::DataPtr(b->host.get(), b, &free_block, dev);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

c10::Allocator* allocator() {
  static auto* a = new NeuronAllocator();  // leaked: frees can run during interpreter shutdown
  return a;
}

c10::DataPtr adopt_data(c10::Storage owner, c10::DeviceIndex index) {
  // Bytes a compiled graph allocated for this core are counted already (HostAllocator).
  const bool counted = host_counted(owner.data_ptr());
  Block* b = counted ? new Block{index, 0, 0, 1, {}, {}}
                     : account(index, static_cast<int64_t>(owner.nbytes()));
  void* data = const_cast<void*>(owner.data());
  b->owner = std::move(owner);
  return c10::DataPtr(data, b, &free_block, c10::Device(kNeuron, index));
}

c10::Storage adopt_storage(const c10::Storage& cpu, c10::DeviceIndex index) {
  auto nbytes = cpu.nbytes();
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, adopt_data(cpu, index), allocator(), true));
}

std::map<std::string, int64_t> memory_stats(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  std::map<std::string, int64_t> out;
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  auto put = [&](const std::string& name, Stat* s) {
    for (int k = 0; k < 3; ++k) {
      std::string base = name + "." + pools[k] + ".";
      out[base + "current"] = s[k].current;
      out[base + "peak"] = s[k].peak;
      out[base + "allocated"] = s[k].allocated;
      out[base + "freed"] = s[k].freed;
    }
  };
  put("allocated_bytes", c.allocated_bytes);
  put("reserved_bytes", c.reserved_bytes);
  put("active_bytes", c.active_bytes);
  put("requested_bytes", c.requested_bytes);
  put("allocation", c.allocation);
  put("active", c.allocation);
  put("segment", c.segment);
  out["num_ooms"] = c.num_ooms;
  out["dry_ooms"] = c.dry_ooms;
  out["num_alloc_retries"] = c.num_alloc_retries;
  out["num_tensor_frees"] = c.num_tensor_frees;
  out["allocation_requests"] = c.allocation_requests;
  out["hbm_bytes"] = c.budget;
  return out;
}

void reset_peak(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  for (Stat* s : {c.allocated_bytes, c.reserved_bytes, c.active_bytes, c.requested_bytes,
                  c.allocation, c.segment})
    for (int k = 0; k < 3; ++k) s[k].peak = s[k].current;
}

std::pair<int64_t, int64_t> high_water_marks(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  return {c.allocated_bytes[0].high_water, c.reserved_bytes[0].high_water};
}

void reset_high_water(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  for (Stat* s : {c.allocated_bytes, c.reserved_bytes, c.active_bytes, c.requested_bytes,
                  c.allocation, c.segment})
    for (int k = 0; k < 3; ++k) s[k].peak = s[k].high_water = s[k].current;
}

void reset_accumulated(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  for (Stat* s : {c.allocated_bytes, c.reserved_bytes, c.active_bytes, c.requested_bytes,
                  c.allocation, c.segment})
    for (int k = 0; k < 3; ++k) s[k].allocated = s[k].freed = 0;
  c.num_ooms = c.num_alloc_retries = c.num_tensor_frees = c.allocation_requests = 0;
}

void empty_cache(c10::DeviceIndex index) {
  HostCache drop;  // its buffers are freed after the lock is released
  check_available();
  {
    std::lock_guard<std::mutex> lock(mu());
    release_cache(core(index));
    drop = take_host_cache();
  }
}

std::vector<std::pair<double, int64_t>> memory_timeline(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  return core(index).timeline;
}

bool tag_storage(const at::Tensor& t, int tag) {
  if (!t.defined() || t.device().type() != kNeuron || !t.has_storage()) return false;
  const c10::DataPtr& dp = t.storage().data_ptr();
  Block* b = dry_block(dp);
  if (b == nullptr && dp.get_deleter() == &free_block) b = static_cast<Block*>(dp.get_context());
  if (b == nullptr || b->size == 0) return false;
  std::lock_guard<std::mutex> lock(mu());
  b->tag = better_tag(b->tag, tag);
  auto& cs = cores();
  if (static_cast<size_t>(b->index) < cs.size()) {
    auto it = cs[b->index].snap.find(b->id);
    if (it != cs[b->index].snap.end()) it->second.second = better_tag(it->second.second, tag);
  }
  return true;
}

PeakSnapshot peak_snapshot(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  if (c.rising) take_snapshot(c);
  PeakSnapshot out{c.snap_bytes, c.snap_op, c.snap_line, {}};
  for (const auto& [id, e] : c.snap) out.by_tag[e.second] += e.first;
  return out;
}

void reset_peak_snapshot(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  Core& c = core(index);
  c.hwm = c.allocated_bytes[0].current;
  c.hwm_seq++;
  c.hwm_call = -1;
  c.hwm_op = "(allocated before the run began)";
  c.hwm_line.clear();
  c.rising = true;
}

}  // namespace neuron
