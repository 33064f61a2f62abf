// HBM accounting: an emulated caching segment allocator per logical NeuronCore.
//
// Bytes live in host memory, but every neuron allocation is counted against its core's
// HBM budget the way TorchNeuron's allocator would count it: requests are
// rounded to size classes, carved from cached segments (2 MiB small pool, 20 MiB or exact
// large pool), freed blocks stay reserved until empty_cache(), and a request that does not
// fit after flushing the cache raises torch.OutOfMemoryError. So a model that would not
// fit on a Trainium core does not fit here either, at the same size. The allocator that
// hands out the bytes is memory.cpp's; this file only counts them.
#include "dry.h"
#include "hbm.h"

#include <chrono>
#include <sstream>

namespace neuron::hbm {
namespace {

constexpr int64_t kSmallLimit = 1 * kMiB;   // small pool below 1 MiB
constexpr int64_t kRoundLimit = 16 * kMiB;  // no rounding at 16 MiB and above

std::string& oom_hint() {
  static auto* s = new std::string();
  return *s;
}
std::string& unavailable_reason() {
  static auto* s = new std::string();
  return *s;
}
bool g_timeline = false;
const auto g_start = std::chrono::steady_clock::now();

int64_t g_block_id = 0;  // under mu()
std::function<std::string()>& peak_hook() {
  static auto* h = new std::function<std::string()>();
  return *h;
}
thread_local const std::string* t_op = nullptr;  // the op being dispatched on this thread
thread_local int64_t t_call = 0;                 // op calls dispatched on this thread

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

void sample(Core& c) {
  if (!g_timeline || c.timeline.size() >= 200000) return;
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
  c.timeline.emplace_back(t, c.allocated_bytes[0].current);
}

}  // namespace

// Leaked on purpose: blocks may be freed during interpreter shutdown.
std::mutex& mu() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<Core>& cores() {
  static auto* c = new std::vector<Core>();
  return *c;
}
std::atomic<bool> g_unavailable{false};

Core& core(c10::DeviceIndex index) {
  auto& cs = cores();
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < cs.size(), "Invalid device: neuron:",
              static_cast<int>(index), " has no HBM budget (", cs.size(), " cores configured)");
  return cs[index];
}

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
    if (c.reserved_bytes[0].current + seg > c.budget && dry_run()) {
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

}  // namespace neuron::hbm

namespace neuron {

using namespace hbm;

void set_budgets(const std::vector<int64_t>& bytes_per_core) {
  std::lock_guard<std::mutex> lock(mu());
  auto& cs = cores();
  if (cs.size() < bytes_per_core.size()) cs.resize(bytes_per_core.size());
  for (size_t i = 0; i < bytes_per_core.size(); ++i) cs[i].budget = bytes_per_core[i];
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

void set_timeline(bool on) { g_timeline = on; }

OpScope::OpScope(const std::string* op) : prev_(t_op) {
  t_op = op;
  ++t_call;
}
OpScope::~OpScope() { t_op = prev_; }

void set_peak_hook(std::function<std::string()> hook) { peak_hook() = std::move(hook); }

}  // namespace neuron
