// Dry run: which neuron storages hold real values, and the routing policy for index outputs.
//
// A dry run's tensors hold no bytes, except where the values are cheap and the program needs
// them: index math (MoE token counts, split sizes, masks). A storage holds values when
// every neuron input of the op that wrote it held values (a fresh allocation and an integer
// copy from the host do), its bytes then are real (small: up to kDryValueBytes), and
// ops on it compute on the host for real (fallback.cpp). An index output computed from data
// the run lacks (topk, sort, argmax, max's indices) is filled with a deterministic routing
// pattern instead (balanced, or a hot expert 0), and that is an assumption, reported with the
// program's line. Storages are keyed by address; dry_memory.cpp forgets an address when its
// block is freed, before the address can be handed out again.
#include "dry.h"

#include <atomic>
#include <cmath>
#include <mutex>
#include <sstream>
#include <unordered_set>

namespace neuron {
namespace {

std::mutex g_mu;
std::unordered_set<const void*>& valued() {
  static auto* s = new std::unordered_set<const void*>();  // leaked: outlives every tensor
  return *s;
}
std::atomic<double> g_hot{-1.0};  // < 0: balanced; else the fraction of rows on index 0

const void* key(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl()->data(); }

// Routing for `rows` rows of `kk` distinct indices out of `n`; `c` runs over the rows.
at::Tensor pattern(int64_t rows, int64_t kk, int64_t n, double hot) {
  auto p = at::empty({rows, kk}, at::kLong);
  int64_t* o = p.mutable_data_ptr<int64_t>();
  int64_t c = 0;
  const bool skew = hot >= 0 && n > 1;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t* row = o + r * kk;
    if (!skew) {
      for (int64_t j = 0; j < kk; ++j) row[j] = (c + j) % n;
      c += kk < n ? kk : 1;
      continue;
    }
    // Row r is hot when floor((r+1) * hot) steps: floor(rows * hot) hot rows, spread evenly.
    const bool is_hot = std::floor((r + 1) * hot) > std::floor(r * hot);
    int64_t j = 0;
    if (is_hot) row[j++] = 0;
    int64_t t = 0;
    for (; j < kk && t < n - 1; ++j, ++t) row[j] = 1 + (c + t) % (n - 1);
    c += t;
    if (j < kk) row[j++] = 0;  // a whole permutation (sort): index 0 last on a cold row
  }
  return p;
}

}  // namespace

bool dry_has_values(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  if (t.storage().nbytes() == 0) return true;  // nothing to know
  std::lock_guard<std::mutex> lock(g_mu);
  return valued().count(key(t)) > 0;
}

void dry_mark(const at::Tensor& t, bool values) {
  if (!t.defined() || !t.has_storage() || t.storage().nbytes() == 0) return;
  const void* k = key(t);
  std::lock_guard<std::mutex> lock(g_mu);
  // Values are index math: a floating-point storage keeps them only up to kDryKeepBytes
  // (a count or a mask, not a model's weights, states or activations).
  const int64_t limit = at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())
                            ? kDryKeepBytes : kDryValueBytes;
  if (values && static_cast<int64_t>(t.storage().nbytes()) <= limit) {
    valued().insert(k);
  } else {
    valued().erase(k);
  }
}

void dry_forget(const void* addr) {
  std::lock_guard<std::mutex> lock(g_mu);
  valued().erase(addr);
}

bool covers_storage(const at::Tensor& t) {
  return t.is_contiguous() && t.storage_offset() == 0 &&
         t.numel() * static_cast<int64_t>(t.element_size()) ==
             static_cast<int64_t>(t.storage().nbytes());
}

void set_dry_routing(double hot) {
  TORCH_CHECK_VALUE(hot < 0 || hot <= 1, "dry-run routing: the hot fraction must be in [0, 1], "
                    "got ", hot, ". Use e.g. hot:0.5.");
  g_hot.store(hot);
}

double dry_routing() { return g_hot.load(); }

void dry_fill_index(const std::string& op, const at::Tensor& idx, int64_t dim, bool kept,
                    int64_t n) {
  if (!idx.defined() || idx.numel() == 0 || n <= 0) return;
  if (static_cast<int64_t>(idx.storage().nbytes()) > kDryValueBytes) {
    dry_read(op + " indices: left without values (" + std::to_string(idx.numel()) +
             " indices, over the dry run's value limit)");
    return;
  }
  auto a = alias_of(idx);
  at::Tensor rows_last = kept && a.dim() > 0 ? a.movedim(dim, -1) : a.unsqueeze(-1);
  const int64_t kk = rows_last.dim() > 0 ? rows_last.size(-1) : 1;
  const double hot = g_hot.load();
  rows_last.copy_(pattern(idx.numel() / kk, kk, n, hot).view(rows_last.sizes()));
  if (covers_storage(idx)) dry_mark(idx, true);
  std::ostringstream os;
  os << op << " indices: ";
  if (hot < 0) {
    os << "balanced routing over " << n;
  } else {
    os << "hot routing (a fraction " << hot << " of the rows on index 0) over " << n;
  }
  os << " (" << kk << " per row)";
  dry_read(os.str());
}

}  // namespace neuron
