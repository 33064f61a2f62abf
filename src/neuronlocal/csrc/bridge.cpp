// The compile bridge: compiled (Inductor CPU) code runs on CPU aliases of neuron inputs,
// and its CPU outputs are adopted back as neuron tensors, in one call each way.
#include "neuron.h"

#include <torch/extension.h>

#include <unordered_map>

namespace neuron {

// Neuron tensors become CPU aliases; everything else passes through. The device index of
// the first neuron tensor is returned (current device when there is none).
std::pair<std::vector<py::object>, int> bridge_in(const std::vector<py::object>& args) {
  std::vector<py::object> out;
  out.reserve(args.size());
  int index = -1;
  for (const auto& a : args) {
    if (THPVariable_Check(a.ptr())) {
      const auto& t = THPVariable_Unpack(a.ptr());
      if (t.defined() && t.device().type() == kNeuron) {
        if (index < 0) index = t.device().index();
        out.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(cpu_alias(t))));
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
// history: the caller connects them to the graph (compile/bridge.py).
std::vector<py::object> bridge_out(const std::vector<py::object>& outs, int index,
                                   const std::vector<bool>& to_neuron) {
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
          it = adopted.emplace(key, adopt_storage(t.storage(), static_cast<c10::DeviceIndex>(index))).first;
        }
        auto n = at::detail::make_tensor<c10::TensorImpl>(
            c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), t.dtype());
        n.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
        res.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(n)));
        continue;
      }
    }
    res.push_back(o);
  }
  return res;
}

}  // namespace neuron
