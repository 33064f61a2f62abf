// CPU aliases of neuron tensors: CPU tensors over the same bytes, no copy. The CPU fallback
// runs kernels on them for the length of one op; the compile bridge hands them to compiled
// CPU code, whose autograd graph may keep them until backward. Those long-lived aliases are
// tracked and follow their neuron storage when it is resized, as views of one storage do on
// any device: FSDP2 frees an unsharded parameter's storage after forward (resize to 0) and
// gathers it again before backward into new memory, which the saved alias must then read.
#include "neuron.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace neuron {
namespace {

// An alias's DataPtr: the neuron storage's bytes, with the neuron StorageImpl as context (a
// reference, dropped by the deleter). Tracked aliases have a deleter of their own, which also
// forgets them.
void release_storage(void* ctx) {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
}

std::mutex g_mu;
// Neuron storage -> the tracked aliases of it still alive.
std::unordered_map<c10::StorageImpl*, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>>
    g_tracked;

void prune(c10::StorageImpl* src) {  // under g_mu
  auto it = g_tracked.find(src);
  if (it == g_tracked.end()) return;
  auto& v = it->second;
  v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }),
          v.end());
  if (v.empty()) g_tracked.erase(it);
}

void release_tracked(void* ctx) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    prune(static_cast<c10::StorageImpl*>(ctx));  // the dying alias has expired already
  }
  release_storage(ctx);
}

c10::DataPtr alias_ptr(c10::StorageImpl* src, c10::DeleterFnPtr deleter) {
  c10::raw::intrusive_ptr::incref(src);
  return {const_cast<void*>(src->data()), src, deleter, c10::Device(c10::kCPU)};
}

at::Tensor make_alias(const at::Tensor& t, c10::DeleterFnPtr deleter) {
  auto* src = t.storage().unsafeGetStorageImpl();
  auto cst = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                    src->nbytes(), alias_ptr(src, deleter),
                                                    c10::GetCPUAllocator(), true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(cst)), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

}  // namespace

at::Tensor cpu_alias(const at::Tensor& t) {
  settle();
  return alias_of(t);
}

at::Tensor alias_of(const at::Tensor& t) { return make_alias(t, &release_storage); }

at::Tensor tracked_alias(const at::Tensor& t) {
  settle();
  auto out = make_alias(t, &release_tracked);
  auto* src = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(g_mu);
  g_tracked[src].emplace_back(out.storage().getWeakStorageImpl());
  return out;
}

c10::StorageImpl* alias_source(const c10::Storage& cpu) {
  const auto& dp = cpu.data_ptr();
  const auto deleter = dp.get_deleter();
  return deleter == &release_storage || deleter == &release_tracked
             ? static_cast<c10::StorageImpl*>(dp.get_context())
             : nullptr;
}

void follow_resize(c10::StorageImpl* src) {
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> live;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_tracked.find(src);
    if (it == g_tracked.end()) return;
    for (const auto& w : it->second) {
      if (auto a = w.lock()) live.push_back(std::move(a));
    }
  }
  // Outside the lock: replacing a DataPtr runs the old one's deleter, which takes it.
  for (const auto& a : live) {
    if (a->data() == src->data() && a->nbytes() == src->nbytes()) continue;
    a->set_data_ptr_noswap(alias_ptr(src, &release_tracked));
    a->set_nbytes(src->nbytes());
  }
}

}  // namespace neuron
