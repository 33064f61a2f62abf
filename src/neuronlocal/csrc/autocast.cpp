// torch.autocast(device_type="neuron"): the same op lists and cast policies as CUDA,
// registered for the AutocastPrivateUse1 key (TorchNeuron does the same).
#include "neuron.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe "
              "to autocast on neuron, as on CUDA. Use binary_cross_entropy_with_logits or "
              "BCEWithLogitsLoss, which combine a sigmoid and the loss and are safe to autocast.");
}

}  // namespace

// Inside at::autocast so the op-list macros resolve Tensor, Scalar and friends.
namespace at::autocast {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NEURON_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define NEURON_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(NEURON_LOW)
  AT_FORALL_FP32(NEURON_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(NEURON_FP32_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(NEURON_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace at::autocast
