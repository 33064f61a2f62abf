// The compile bridge: compiled (Inductor CPU) code runs on CPU aliases of neuron inputs,
// and its CPU outputs are adopted back as neuron tensors, in one call each way.
#include "neuron.h"

#include <torch/extension.h>

#include <unordered_map>

namespace neuron {
namespace {

// The CPU alias of a neuron tensor, kept on the tensor itself (PyTorch's per-tensor backend
// metadata) so that parameters and caches passed to every call of a compiled graph are not
// re-aliased each time. It lives and dies with the tensor; `clone` (detach, .data, shallow
// copies) starts empty, so copies never share it.
struct AliasMeta final : c10::BackendMeta {
  at::Tensor alias;
  c10::intrusive_ptr<c10::BackendMeta> clone(
      const c10::intrusive_ptr<c10::BackendMeta>& /*ptr*/) const override {
    return c10::make_intrusive<AliasMeta>();
  }
};

// Still an alias of `t` exactly? set_(), resize_(), `.data = ...` and in-place metadata
// changes all show up here, and the alias is then made again.
bool same_view(const c10::TensorImpl* n, const c10::TensorImpl* a) {
  return a->storage().data() == n->storage().data() &&
         a->storage().nbytes() == n->storage().nbytes() && a->dtype() == n->dtype() &&
         a->storage_offset() == n->storage_offset() && a->sizes().equals(n->sizes()) &&
         a->strides().equals(n->strides()) && a->is_conj() == n->is_conj() &&
         a->is_neg() == n->is_neg();
}

const at::Tensor& cached_alias(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  auto* meta = dynamic_cast<AliasMeta*>(impl->get_backend_meta());
  if (meta == nullptr) {
    auto fresh = c10::make_intrusive<AliasMeta>();
    meta = fresh.get();
    impl->set_backend_meta(std::move(fresh));
  }
  if (!meta->alias.defined() || !same_view(impl, meta->alias.unsafeGetTensorImpl())) {
    meta->alias = cpu_alias(t);
  }
  return meta->alias;
}

}  // namespace

// Neuron tensors become CPU aliases; everything else passes through. The device index of
// the first neuron tensor is returned (current device when there is none). `reuse`: hand
// out the alias kept on each tensor (calls without autograd), else fresh tracked aliases (a
// differentiable call marks its aliases as graph leaves, and its CPU graph may save them
// for a backward that runs after their storage was freed and gathered again). `leaves[i]`:
// input i becomes a leaf of the CPU graph that requires grad (an alias, or a detached CPU
// input), so a differentiable call needs no per-input work in Python.
std::pair<std::vector<py::object>, int> bridge_in(const std::vector<py::object>& args,
                                                  bool reuse, const std::vector<bool>& leaves) {
  settle();  // queued foreach ops (an optimizer step) write bytes the graph may read
  std::vector<py::object> out;
  out.reserve(args.size());
  int index = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (THPVariable_Check(a.ptr())) {
      const auto& t = THPVariable_Unpack(a.ptr());
      const bool leaf = i < leaves.size() && leaves[i];
      if (t.defined() && t.device().type() == kNeuron) {
        if (index < 0) index = t.device().index();
        at::Tensor alias = reuse && !leaf ? cached_alias(t) : tracked_alias(t);
        if (leaf) alias.set_requires_grad(true);
        out.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(alias))));
        continue;
      }
      if (leaf && t.defined()) {
        auto d = t.detach();
        d.set_requires_grad(true);
        out.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(d))));
        continue;
      }
    }
    out.push_back(a);
  }
  return {out, index < 0 ? current_device() : index};
}

// CPU tensors become neuron tensors owning the same bytes; outputs sharing a storage share
// one neuron storage, so views among outputs stay views. `to_neuron[i]` false keeps output
// i as it is (an empty mask adopts every CPU tensor). Adopted tensors carry no autograd
// history: the caller connects them to the graph (compile/bridge.py). `detach_kept`: outputs
// kept as they are lose their history too (they leave the CPU graph through an autograd
// Function). `keep_grad`: an adopted output of a CPU tensor that requires grad (a fresh leaf
// made inside the graph) requires grad too.
std::vector<py::object> bridge_out(const std::vector<py::object>& outs, int index,
                                   const std::vector<bool>& to_neuron, bool detach_kept,
                                   bool keep_grad) {
  std::vector<py::object> res;
  res.reserve(outs.size());
  std::unordered_map<c10::StorageImpl*, c10::Storage> adopted;
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& o = outs[i];
    const bool wanted = to_neuron.empty() || (i < to_neuron.size() && to_neuron[i]);
    if (wanted && THPVariable_Check(o.ptr())) {
      const auto& t = THPVariable_Unpack(o.ptr());
      if (t.defined() && t.device().is_cpu() && t.layout() == at::kStrided) {
        auto* key = t.storage().unsafeGetStorageImpl();
        auto it = adopted.find(key);
        if (it == adopted.end()) {
          // An output over an input's bytes (a view, an in-place result) is a view of that
          // neuron storage again, not a second copy counted against the core.
          if (auto* src = alias_source(t.storage())) {
            it = adopted.emplace(key, c10::Storage(
                c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(src))).first;
          } else {
            it = adopted.emplace(key, adopt_storage(t.storage(),
                                                    static_cast<c10::DeviceIndex>(index))).first;
          }
        }
        auto n = at::detail::make_tensor<c10::TensorImpl>(
            c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), t.dtype());
        n.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
        if (keep_grad && t.requires_grad()) n.set_requires_grad(true);
        res.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(n)));
        continue;
      }
    }
    if (detach_kept && THPVariable_Check(o.ptr())) {
      const auto& t = THPVariable_Unpack(o.ptr());
      if (t.defined() && t.requires_grad()) {
        res.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(t.detach())));
        continue;
      }
    }
    res.push_back(o);
  }
  return res;
}

}  // namespace neuron
