// The data-less storages of a dry run.
//
// In a dry run neuron storages hold no bytes: each gets a distinct address in one reserved,
// never-committed mapping (MAP_NORESERVE), so pointers stay unique (tied-weight and aliasing
// checks keep working), a stray read sees zeros and costs no memory, and a stray write
// commits only the pages it touches (released again when the block is freed). Addresses of
// freed blocks are reused by size class; the accounting is the real allocator's, except that
// a request past the core's HBM is counted (dry_ooms, the first one reported with its line)
// instead of raised, so the run goes on to its true peak.
#include "dry.h"
#include "hbm.h"

#include <sys/mman.h>

namespace neuron::hbm {
namespace {

std::atomic<bool> g_dry{false};  // set once at import, before any tensor exists

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

}  // namespace

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

Block* dry_block(const c10::DataPtr& dp) {
  if (dp.get_deleter() != &free_dry) return nullptr;
  return static_cast<DryBlock*>(dp.get_context())->block;
}

}  // namespace neuron::hbm

namespace neuron {

using namespace hbm;

void set_dry_run(bool on) { g_dry.store(on); }
bool dry_run() { return g_dry.load(std::memory_order_relaxed); }

c10::Storage dry_storage(int64_t nbytes, c10::DeviceIndex index) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, dry_data(nbytes, index), allocator(), true));
}

void dry_release(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  const auto& st = t.storage();
  if (dry_block(st.data_ptr()) == nullptr) return;  // not a dry block (a kept host copy)
  // The block's pages are its own (dry_address): drop the whole pages inside the storage.
  const auto begin = reinterpret_cast<uintptr_t>(st.data());
  const uintptr_t first = (begin + 4095) / 4096 * 4096;
  const uintptr_t last = (begin + st.nbytes()) / 4096 * 4096;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

c10::DataPtr dry_data(int64_t nbytes, c10::DeviceIndex index) {
  c10::Device dev(kNeuron, index);
  if (nbytes == 0) return c10::DataPtr(nullptr, dev);
  return dry_ptr(account(index, nbytes), dev);
}

}  // namespace neuron
