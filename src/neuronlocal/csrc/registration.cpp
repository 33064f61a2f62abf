// Every registration of the neuron device with PyTorch's dispatcher, in one place: the
// explicit kernels (kernels.cpp, attention.cpp), the boxed fallback (fallback.cpp) for every
// other op and directly for the ops Python lists, and one clear error for sparse and
// quantized tensors.
// Which ops get what is data from Python (neuronlocal/eager/ops.py); this file only wires.
#include "neuron.h"

#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <memory>

namespace neuron {
namespace {

// Libraries live as long as the process: dropping one would unregister its kernels.
std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static auto* v = new std::vector<std::unique_ptr<torch::Library>>();
  return *v;
}

torch::Library& library(const char* ns, c10::DispatchKey key) {
  libraries().push_back(
      std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__));
  return *libraries().back();
}

torch::CppFunction boxed_fallback() {
  return torch::CppFunction::makeFromBoxedFunction<&fallback>();
}

}  // namespace

void register_kernels() {
  static bool done = false;
  if (done) return;
  done = true;
  c10::SetAllocator(kNeuron, allocator());
  auto& lib = library("aten", c10::DispatchKey::PrivateUse1);
  lib.impl("empty.memory_format", TORCH_FN(kernels::empty_memory_format));
  lib.impl("empty_strided", TORCH_FN(kernels::empty_strided));
  lib.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  lib.impl("view", TORCH_FN(at::native::view));
  lib.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  lib.impl("set_.source_Storage_storage_offset", TORCH_FN(kernels::set_storage));
  lib.impl("set_.source_Storage", TORCH_FN(kernels::set_source_storage));
  lib.impl("set_.source_Tensor", TORCH_FN(kernels::set_tensor));
  lib.impl("set_", TORCH_FN(kernels::set_empty));
  lib.impl("resize_", TORCH_FN(kernels::resize));
  lib.impl("_copy_from", TORCH_FN(kernels::copy_from));
  lib.impl("_to_copy", TORCH_FN(kernels::to_copy));
  lib.impl("_copy_from_and_resize", TORCH_FN(kernels::copy_from_and_resize));
  lib.impl("native_dropout", TORCH_FN(kernels::native_dropout));
  lib.impl("convolution_overrideable", TORCH_FN(kernels::convolution_overrideable));
  lib.impl("convolution_backward_overrideable",
           TORCH_FN(kernels::convolution_backward_overrideable));
  lib.impl("record_stream", TORCH_FN(kernels::record_stream));
  lib.impl("_scaled_dot_product_fused_attention_overrideable",
           TORCH_FN(kernels::sdpa_overrideable));
  lib.impl("_scaled_dot_product_fused_attention_overrideable_backward",
           TORCH_FN(kernels::sdpa_overrideable_backward));
  lib.impl("_native_multi_head_attention", TORCH_FN(kernels::native_multi_head_attention));
  lib.impl("_has_compatible_shallow_copy_type",
           TORCH_FN(kernels::has_compatible_shallow_copy_type));
  // Foreach ops have a composite kernel that loops over the list, one neuron op per tensor
  // (an optimizer step would be hundreds of dispatches); direct, each is one host call of
  // CPU's foreach kernel on aliases, and the elementwise ones can be queued (foreach.cpp).
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
    auto full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    lib.impl(full.c_str() + 6, boxed_fallback());
  }
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&kernels::fused_sdp_choice);
  library("_", c10::DispatchKey::PrivateUse1).fallback(boxed_fallback());
  // Sparse and quantized neuron tensors: one clear error instead of "no kernel for backend".
  library("_", c10::DispatchKey::SparsePrivateUse1)
      .fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_fallback>());
  library("_", c10::DispatchKey::SparseCsrPrivateUse1)
      .fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_fallback>());
  library("_", c10::DispatchKey::QuantizedPrivateUse1)
      .fallback(torch::CppFunction::makeFromBoxedFunction<&quantized_fallback>());
  // Break clone -> copy_ -> _copy_from recursion on conjugate/negative views: _copy_from
  // falls through those keys to the PrivateUse1 kernel.
  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    library("aten", key).impl("_copy_from", torch::CppFunction::makeFallthrough());
  }
}

void register_direct(const std::vector<std::string>& names) {
  auto& lib = library("aten", c10::DispatchKey::PrivateUse1);
  for (const auto& name : names) lib.impl(name.c_str(), boxed_fallback());
}

void register_tracked(const std::vector<std::string>& names) {
  auto& lib = library("aten", c10::DispatchKey::PrivateUse1);
  for (const auto& name : names) {
    lib.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&tracked_composite>());
  }
}

void register_unsupported(const std::vector<std::string>& names) {
  for (auto key : {c10::DispatchKey::PrivateUse1, c10::DispatchKey::SparseCsrPrivateUse1}) {
    auto& lib = library("aten", key);
    for (const auto& name : names) {
      lib.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&unsupported_fallback>());
    }
  }
}

}  // namespace neuron
