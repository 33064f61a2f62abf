// HBM accounting: an emulated caching segment allocator per logical NeuronCore.
//
// Bytes live in host memory, but every neuron allocation is counted against its core's
// HBM budget the way TorchNeuron's allocator would count it: requests are
// rounded to size classes, carved from cached segments (2 MiB small pool, 20 MiB or exact
// large pool), freed blocks stay reserved until empty_cache(), and a request that does not
// fit after flushing the cache raises torch.OutOfMemoryError. So a model that would not
// fit on a Trainium core does not fit here either, at the same size.
#include "dry.h"

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <sys/mman.h>

namespace neuron {
namespace {

constexpr int64_t kKiB = 1024, kMiB = 1024 * 1024;
constexpr int64_t kSmallLimit = 1 * kMiB;   // small pool below 1 MiB
constexpr int64_t kRoundLimit = 16 * kMiB;  // no rounding at 16 MiB and above

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

struct Block;

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

// Leaked on purpose: blocks may be freed during interpreter shutdown.
std::mutex& mu() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<Core>& cores() {
  static auto* c = new std::vector<Core>();
  return *c;
}
std::string& oom_hint() {
  static auto* s = new std::string();
  return *s;
}
std::string& unavailable_reason() {
  static auto* s = new std::string();
  return *s;
}
std::atomic<bool> g_unavailable{false};
std::atomic<bool> g_dry{false};
bool g_timeline = false;
const auto g_start = std::chrono::steady_clock::now();

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
int64_t g_block_id = 0;  // under mu()
std::function<std::string()>& peak_hook() {
  static auto* h = new std::function<std::string()>();
  return *h;
}
thread_local const std::string* t_op = nullptr;  // the op being dispatched on this thread
thread_local int64_t t_call = 0;                 // op calls dispatched on this thread

// A lower tag wins: a parameter saved for backward is a parameter.
int better_tag(int old, int tag) { return old == 0 || tag < old ? tag : old; }

// Under mu(): the live set is the peak's (called at the first free after a new peak).
void take_snapshot(Core& c) {
  c.snap.clear();
  for (Block* x : c.live) c.snap[x->id] = {x->size, x->tag};
  c.snap_bytes = c.hwm;
  c.snap_seq = c.hwm_seq;
  c.snap_op = c.hwm_op;
  c.snap_line = c.hwm_line;
  c.rising = false;
}

int64_t round_size(int64_t n) {
  if (n < kSmallLimit) return std::max<int64_t>(256, (n + 255) / 256 * 256);
  if (n >= kRoundLimit) return (n + 511) / 512 * 512;
  int64_t p = 1;
  while (p < n) p <<= 1;
  int64_t step = p / 4;
  return (n + step - 1) / step * step;
}

int64_t segment_size(int64_t size, int pool) {
  if (pool == 1) return 2 * kMiB;
  if (size < 10 * kMiB) return 20 * kMiB;
  return (size + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
}

std::string fmt_bytes(int64_t n) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  if (n >= 1024 * kMiB) os << static_cast<double>(n) / (1024.0 * kMiB) << " GiB";
  else if (n >= kMiB) os << static_cast<double>(n) / kMiB << " MiB";
  else if (n >= kKiB) os << static_cast<double>(n) / kKiB << " KiB";
  else os << n << " bytes";
  return os.str();
}

// Callers run check_available() first, before taking mu(): starting the runtime takes it.
Core& core(c10::DeviceIndex index) {
  auto& cs = cores();
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < cs.size(), "Invalid device: neuron:",
              static_cast<int>(index), " has no HBM budget (", cs.size(), " cores configured)");
  return cs[index];
}

void sample(Core& c) {
  if (!g_timeline || c.timeline.size() >= 200000) return;
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
  c.timeline.emplace_back(t, c.allocated_bytes[0].current);
}

void release_cache(Core& c) {
  for (int p = 1; p <= 2; ++p) {
    c.reserved_bytes[p].dec(c.cached_free[p]);
    c.reserved_bytes[0].dec(c.cached_free[p]);
    c.cached_free[p] = 0;
  }
  c.cached_free[0] = 0;
}

// Counts a request against the core; throws torch.OutOfMemoryError when it cannot fit.
Block* account(c10::DeviceIndex index, int64_t nbytes) {
  if (nbytes != 0) check_available();
  auto* b = new Block{index, 0, nbytes, 1, {}, {}};
  if (nbytes == 0) return b;
  int64_t size = round_size(nbytes);
  int pool = size < kSmallLimit ? 1 : 2;
  std::string dry_oom;
  std::unique_lock<std::mutex> lock(mu());
  Core& c = core(index);
  c.allocation_requests++;
  if (c.cached_free[pool] >= size) {
    c.cached_free[pool] -= size;
  } else {
    int64_t seg = segment_size(size, pool);
    if (c.reserved_bytes[0].current + seg > c.budget && c.reserved_bytes[0].current > 0) {
      c.num_alloc_retries++;
      release_cache(c);
    }
    if (c.reserved_bytes[0].current + seg > c.budget && g_dry.load()) {
      if (c.dry_ooms++ == 0) {
        std::ostringstream os;
        os << "out of memory on neuron:" << static_cast<int>(index) << ": allocating "
           << fmt_bytes(nbytes) << " needs " << fmt_bytes(c.reserved_bytes[0].current + seg)
           << " reserved of " << fmt_bytes(c.budget) << " HBM";
        dry_oom = os.str();
      }
    } else if (c.reserved_bytes[0].current + seg > c.budget) {
      c.num_ooms++;
      std::ostringstream os;
      os << "neuron:" << static_cast<int>(index) << " out of memory: tried to allocate "
         << fmt_bytes(nbytes) << " on logical NeuronCore " << static_cast<int>(index) << " ("
         << oom_hint() << "), which has " << fmt_bytes(c.budget) << " of HBM; "
         << fmt_bytes(c.allocated_bytes[0].current) << " is already allocated by tensors and "
         << fmt_bytes(c.reserved_bytes[0].current) << " reserved.";
      if (seg > nbytes) {
        os << " The request needs a new " << fmt_bytes(seg) << " segment: as in TorchNeuron's "
           << "caching allocator, it is rounded up to a " << fmt_bytes(size) << " block and "
           << "carved from a segment of 2 MiB (requests under 1 MiB), 20 MiB (under 10 MiB) "
           << "or its size rounded up to 2 MiB.";
      }
      if (size <= c.budget && seg > c.budget) {
        os << " One segment is larger than this core's HBM: set NEURONLOCAL_HBM_PER_CORE to "
           << "at least " << fmt_bytes(seg) << ".";
      } else {
        os << " Free tensors you no longer need (then torch.neuron.empty_cache()), lower the "
           << "batch size or sequence length, or shard the model over more cores (FSDP / "
           << "tensor parallel).";
      }
      lock.unlock();
      delete b;
      TORCH_CHECK_WITH(OutOfMemoryError, false, os.str());
    }
    c.reserved_bytes[0].inc(seg);
    c.reserved_bytes[pool].inc(seg);
    c.segment[0].inc(1);
    c.segment[pool].inc(1);
    c.cached_free[pool] += seg - size;
  }
  for (int k : {0, pool}) {
    c.allocated_bytes[k].inc(size);
    c.active_bytes[k].inc(size);
    c.requested_bytes[k].inc(nbytes);
    c.allocation[k].inc(1);
  }
  sample(c);
  b->size = size;
  b->pool = pool;
  b->id = ++g_block_id;
  c.live.insert(b);
  int64_t ask_seq = 0;  // a new high-water mark set by a new op call: ask for its line
  const int64_t call = t_op ? t_call : -1;
  const std::string at_op = t_op ? *t_op : std::string();
  if (c.allocated_bytes[0].current > c.hwm) {
    const bool same = call >= 0 && call == c.hwm_call && at_op == c.hwm_op;
    c.hwm = c.allocated_bytes[0].current;
    c.hwm_seq++;
    c.hwm_call = call;
    c.hwm_op = at_op;
    if (!same) {
      ask_seq = c.hwm_seq;
      c.hwm_line.clear();
    }
    c.rising = true;
  }
  lock.unlock();
  if (ask_seq && peak_hook()) {  // outside the lock: the hook takes the GIL
    std::string line = peak_hook()();
    std::lock_guard<std::mutex> relock(mu());
    Core& c2 = core(index);
    if (c2.hwm_line.empty() && c2.hwm_call == call && c2.hwm_seq >= ask_seq) c2.hwm_line = line;
    if (c2.snap_line.empty() && c2.snap_seq >= ask_seq && c2.snap_op == at_op) c2.snap_line = line;
  }
  if (!dry_oom.empty()) dry_read(at_op.empty() ? dry_oom : dry_oom + " in " + at_op);
  return b;
}

c10::Allocator* host_inner();

// Host buffers of freed blocks, by size class, for the next allocation of that class: the
// host side of the cache the accounting models. Without it every optimizer step would map
// its temporaries afresh (page faults, zeroed pages), which plain CPU avoids through
// malloc's own reuse. Capped; empty_cache() releases them.
constexpr int64_t kHostCacheCap = 256 * kMiB;
std::unordered_map<int64_t, std::vector<c10::DataPtr>>& host_cache() {
  static auto* m = new std::unordered_map<int64_t, std::vector<c10::DataPtr>>();
  return *m;
}
int64_t g_host_cached = 0;

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

// Called with mu() held.
void recycle(Block* b) {
  if (!b->host || g_host_cached + b->size > kHostCacheCap) return;
  g_host_cached += b->size;
  host_cache()[b->size].push_back(std::move(b->host));
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  if (b->size) {
    std::lock_guard<std::mutex> lock(mu());
    recycle(b);
    auto& cs = cores();
    if (static_cast<size_t>(b->index) < cs.size()) {
      Core& c = cs[b->index];
      if (c.rising) take_snapshot(c);
      c.live.erase(b);
      for (int k : {0, b->pool}) {
        c.allocated_bytes[k].dec(b->size);
        c.active_bytes[k].dec(b->size);
        c.requested_bytes[k].dec(b->requested);
        c.allocation[k].dec(1);
      }
      c.cached_free[b->pool] += b->size;
      c.num_tensor_frees++;
      sample(c);
    }
  }
  delete b;
}


// ---- dry run ----------------------------------------------------------------------------
// In a dry run neuron storages hold no bytes: each gets a distinct address in one reserved,
// never-committed mapping (MAP_NORESERVE), so pointers stay unique (tied-weight and aliasing
// checks keep working), a stray read sees zeros and costs no memory, and a stray write
// commits only the pages it touches (released again when the block is freed). Addresses of
// freed blocks are reused by size class; the accounting is the real allocator's, except that
// a request past the core's HBM is counted (dry_ooms, the first one reported with its line)
// instead of raised, so the run goes on to its true peak.
constexpr int64_t kDryRegion = int64_t{1} << 44;  // 16 TiB of address space, no memory
char* g_dry_base = nullptr;
int64_t g_dry_top = 0;
std::unordered_map<int64_t, std::vector<char*>>& dry_free() {
  static auto* m = new std::unordered_map<int64_t, std::vector<char*>>();
  return *m;
}

char* dry_address(int64_t size) {  // under mu()
  auto& fl = dry_free()[size];
  if (!fl.empty()) {
    char* p = fl.back();
    fl.pop_back();
    return p;
  }
  if (g_dry_base == nullptr) {
    void* p = mmap(nullptr, kDryRegion, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "neuronlocal dry run: cannot reserve address space for "
                "data-less neuron tensors (mmap failed). Run without --dry-run.");
    g_dry_base = static_cast<char*>(p);
  }
  const int64_t step = (size + 4095) / 4096 * 4096;
  TORCH_CHECK(g_dry_top + step <= kDryRegion, "neuronlocal dry run: address space for "
              "data-less tensors exhausted (16 TiB live on one process).");
  char* p = g_dry_base + g_dry_top;
  g_dry_top += step;
  return p;
}

struct DryBlock {
  Block* block;
  char* addr;
};

void free_dry(void* ctx) {
  auto* d = static_cast<DryBlock*>(ctx);
  const int64_t size = d->block->size;
  dry_forget(d->addr);  // before the address can be reused: a new storage holds no values
  // Every block has whole pages of its own (dry_address): dropping them makes the next
  // storage at this address read as zeros, whatever was written here.
  madvise(d->addr, static_cast<size_t>((size + 4095) / 4096 * 4096), MADV_DONTNEED);
  {
    std::lock_guard<std::mutex> lock(mu());
    dry_free()[size].push_back(d->addr);
  }
  free_block(d->block);
  delete d;
}

c10::DataPtr dry_ptr(Block* b, c10::Device dev) {
  char* addr = nullptr;
  try {
    std::lock_guard<std::mutex> lock(mu());
    addr = dry_address(b->size);
  } catch (...) {
    free_block(b);
    throw;
  }
  return c10::DataPtr(addr, new DryBlock{b, addr}, &free_dry, dev);
}

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
    if (g_dry.load(std::memory_order_relaxed)) return dry_ptr(b, dev);
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

bool host_counted(const c10::DataPtr& dp) {
  if (dp.get_deleter() != &host_free) return false;
  std::lock_guard<std::mutex> lock(mu());
  return host_blocks().count(dp.get()) > 0;
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

c10::Allocator* allocator() {
  static auto* a = new NeuronAllocator();  // leaked: frees can run during interpreter shutdown
  return a;
}

void set_budgets(const std::vector<int64_t>& bytes_per_core) {
  std::lock_guard<std::mutex> lock(mu());
  auto& cs = cores();
  if (cs.size() < bytes_per_core.size()) cs.resize(bytes_per_core.size());
  for (size_t i = 0; i < bytes_per_core.size(); ++i) cs[i].budget = bytes_per_core[i];
}

void set_dry_run(bool on) { g_dry.store(on); }
bool dry_run() { return g_dry.load(std::memory_order_relaxed); }

c10::Storage dry_storage(int64_t nbytes, c10::DeviceIndex index) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, dry_data(nbytes, index), allocator(), true));
}

c10::DataPtr dry_data(int64_t nbytes, c10::DeviceIndex index) {
  c10::Device dev(kNeuron, index);
  if (nbytes == 0) return c10::DataPtr(nullptr, dev);
  return dry_ptr(account(index, nbytes), dev);
}

void set_oom_hint(const std::string& hint) { oom_hint() = hint; }

void set_unavailable(const std::string& reason) {
  unavailable_reason() = reason;
  g_unavailable = !reason.empty();
}

void check_available() {
  ensure_started();
  TORCH_CHECK(!g_unavailable.load(std::memory_order_relaxed), unavailable_reason());
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
  std::unordered_map<int64_t, std::vector<c10::DataPtr>> drop;
  check_available();
  {
    std::lock_guard<std::mutex> lock(mu());
    release_cache(core(index));
    drop.swap(host_cache());
    g_host_cached = 0;
  }
}

std::vector<std::pair<double, int64_t>> memory_timeline(c10::DeviceIndex index) {
  check_available();
  std::lock_guard<std::mutex> lock(mu());
  return core(index).timeline;
}

void set_timeline(bool on) { g_timeline = on; }

OpScope::OpScope(const std::string* op) : prev_(t_op) {
  t_op = op;
  ++t_call;
}
OpScope::~OpScope() { t_op = prev_; }

void set_peak_hook(std::function<std::string()> hook) { peak_hook() = std::move(hook); }

bool tag_storage(const at::Tensor& t, int tag) {
  if (!t.defined() || t.device().type() != kNeuron || !t.has_storage()) return false;
  const c10::DataPtr& dp = t.storage().data_ptr();
  Block* b = nullptr;
  if (dp.get_deleter() == &free_dry) b = static_cast<DryBlock*>(dp.get_context())->block;
  else if (dp.get_deleter() == &free_block) b = static_cast<Block*>(dp.get_context());
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
