// The allocator's shared state, internal to the files that implement it: hbm.cpp (the
// per-core accounting), memory.cpp (the device allocator and the memory API),
// host_memory.cpp (host buffers, and host allocations of compiled graphs counted against a
// core) and dry_memory.cpp (the data-less storages of a dry run).
#pragma once

#include "neuron.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron::hbm {

constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;

// `peak` is the program's (reset_peak_memory_stats lowers it to `current`); `high_water` is
// the run's, which only a run report's start resets: whatever entry point the program resets
// the peak through, the report still sees the run's high-water mark.
struct Stat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0, high_water = 0;
  void inc(int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
    high_water = std::max(high_water, current);
  }
  void dec(int64_t n) {
    current -= n;
    freed += n;
  }
};

struct Block {
  c10::DeviceIndex index;
  int64_t size;       // rounded bytes counted against the core; 0 = not counted
  int64_t requested;  // bytes asked for
  int pool;           // 1 small, 2 large
  c10::DataPtr host;  // memory we allocated, or
  c10::Storage owner; // a CPU storage we adopted
  int64_t id = 0;     // unique per counted block, for the peak snapshot
  int tag = 0;        // what the block holds (PeakTag; 0: not known, a temporary)
};

// Index 0 is "all", 1 the small pool, 2 the large pool.
struct Core {
  int64_t budget = std::numeric_limits<int64_t>::max();
  Stat allocated_bytes[3], reserved_bytes[3], active_bytes[3], requested_bytes[3];
  Stat allocation[3], segment[3];
  int64_t cached_free[3] = {0, 0, 0};
  int64_t dry_ooms = 0;  // dry run: requests that would have raised (they go on)
  int64_t num_ooms = 0, num_alloc_retries = 0, num_tensor_frees = 0, allocation_requests = 0;
  std::vector<std::pair<double, int64_t>> timeline;
  // The live blocks at the run's high-water mark of allocated bytes, for the breakdown of
  // the peak: taken at the first free after a new mark (until then the live set is it).
  std::unordered_set<Block*> live;
  int64_t hwm = 0, hwm_seq = 0, hwm_call = -1;
  bool rising = false;
  std::string hwm_op, hwm_line;
  int64_t snap_seq = 0, snap_bytes = 0;
  std::string snap_op, snap_line;
  std::unordered_map<int64_t, std::pair<int64_t, int>> snap;  // block id -> (bytes, tag)
};

// ---- hbm.cpp ---------------------------------------------------------------
// The lock over every core's state, the host cache and the dry run's free lists.
std::mutex& mu();
std::vector<Core>& cores();
// Under mu(). Callers run check_available() first, before taking mu(): starting the runtime
// takes it.
Core& core(c10::DeviceIndex index);
extern std::atomic<bool> g_unavailable;
// Counts a request against the core; throws torch.OutOfMemoryError when it cannot fit.
Block* account(c10::DeviceIndex index, int64_t nbytes);
// The deleter of every counted block: returns its bytes to the core's cache.
void free_block(void* ctx);
// Under mu(): returns a core's cached free segments (empty_cache).
void release_cache(Core& c);
// Under mu(): the live set is the peak's (called at the first free after a new peak).
void take_snapshot(Core& c);
// A lower tag wins: a parameter saved for backward is a parameter.
int better_tag(int old, int tag);

// ---- host_memory.cpp -------------------------------------------------------
using HostCache = std::unordered_map<int64_t, std::vector<c10::DataPtr>>;
// A host buffer of `size` bytes, from the cache of freed blocks when one of that size waits.
c10::DataPtr host_buffer(int64_t size);
// Under mu(): keeps a freed block's host buffer for reuse (up to the cache's cap).
void recycle(Block* b);
// Under mu(): empties the host cache; the caller drops what it returns outside the lock.
HostCache take_host_cache();
// Whether `dp` is a host allocation a compiled graph made, counted against a core already.
bool host_counted(const c10::DataPtr& dp);

// ---- dry_memory.cpp --------------------------------------------------------
// A data-less data pointer for counted block `b` (freed, and rethrown, when none is left).
c10::DataPtr dry_ptr(Block* b, c10::Device dev);
// The block of a data pointer dry_ptr made, or nullptr.
Block* dry_block(const c10::DataPtr& dp);

}  // namespace neuron::hbm
