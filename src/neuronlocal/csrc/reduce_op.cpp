// Reduce ops of the `neuron` c10d backend. TorchNeuron's collectives take every op NCCL
// does; gloo, which runs them here, lacks PREMUL_SUM (what FSDP2 uses for a gradient divide
// factor, and what torchtitan sets), so that one is a premultiply then SUM, as NCCL's
// PreMulSum computes it: each rank's input times the factor (cast to the input's dtype
// first, as NCCL does), then summed. Unsupported ops are refused up front with their name,
// so no rank enters a collective that another rank left, and nothing blames a dead peer.
#include "reduce_op.h"

#include "neuron.h"

#include <string>

namespace neuron {
namespace {

using Op = c10d::ReduceOp;

const char* op_name(Op::RedOpType t) {
  switch (t) {
    case Op::SUM: return "SUM";
    case Op::AVG: return "AVG";
    case Op::PRODUCT: return "PRODUCT";
    case Op::MIN: return "MIN";
    case Op::MAX: return "MAX";
    case Op::BAND: return "BAND";
    case Op::BOR: return "BOR";
    case Op::BXOR: return "BXOR";
    case Op::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

bool integral(c10::ScalarType s) { return c10::isIntegralType(s, /*includeBool=*/true); }

// The factor as a 0-dim CPU tensor: a tensor factor may live on neuron (its CPU alias is
// read) or on CPU (compiled graphs, or a CPU scalar tensor).
at::Tensor factor_of(const Op& op) {
  auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(sup != nullptr, "neuron backend: ReduceOp.PREMUL_SUM has no factor. Make it "
                    "with torch.distributed._make_nccl_premul_sum(factor).");
  if (!sup->tensor_factor.defined()) return at::scalar_tensor(sup->double_factor, at::kDouble);
  const auto& f = sup->tensor_factor;
  auto h = f.device().type() == kNeuron ? cpu_alias(f) : f;
  TORCH_CHECK_VALUE(h.device().is_cpu(), "neuron backend: ReduceOp.PREMUL_SUM's factor tensor "
                    "is on ", f.device(), "; pass a float, or a one-element tensor on neuron.");
  return h.reshape({}).clone();
}

}  // namespace

ReducePlan plan_reduce(const Op& op, const std::vector<at::Tensor>& ts, const char* what) {
  auto type = op.op_;
  for (const auto& t : ts) {
    auto s = t.scalar_type();
    switch (type) {
      case Op::SUM: case Op::PRODUCT: case Op::MIN: case Op::MAX: case Op::AVG:
        break;
      case Op::BAND: case Op::BOR: case Op::BXOR:
        TORCH_CHECK_VALUE(integral(s), "neuron backend: ", what, " with ReduceOp.", op_name(type),
                          " needs an integer or bool tensor, got torch.", c10::getDtypeNames(s).first,
                          ". Use a bitwise op on integer tensors only.");
        break;
      case Op::PREMUL_SUM:
        TORCH_CHECK_VALUE(c10::isFloatingType(s), "neuron backend: ", what, " with "
                          "ReduceOp.PREMUL_SUM needs a floating-point tensor (as NCCL), got "
                          "torch.", c10::getDtypeNames(s).first, ". Multiply first and use ReduceOp.SUM.");
        break;
      default:
        TORCH_CHECK_VALUE(false, "neuron backend: ", what, " does not support ReduceOp.",
                          op_name(type), ". Use SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM, or "
                          "BAND/BOR/BXOR on integer tensors.");
    }
  }
  if (type != Op::PREMUL_SUM) return {op, at::Tensor()};
  return {Op(Op::SUM), factor_of(op)};
}

void premultiply_(const at::Tensor& t, const ReducePlan& plan) {
  if (plan.premul.defined()) t.mul_(plan.premul.to(t.scalar_type()));
}

at::Tensor premultiplied(const at::Tensor& t, const ReducePlan& plan) {
  return plan.premul.defined() ? t.mul(plan.premul.to(t.scalar_type())) : t;
}

}  // namespace neuron
