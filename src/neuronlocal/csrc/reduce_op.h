// Reduce ops of the `neuron` c10d backend: every op NCCL runs, on gloo (reduce_op.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <vector>

namespace neuron {

// How one reduction runs on gloo: the op gloo is given, and the factor (a 0-dim CPU tensor,
// undefined when none) each rank's input is multiplied by first, cast to the input's dtype
// (as NCCL casts it).
struct ReducePlan {
  c10d::ReduceOp op;
  at::Tensor premul;
};

// Checks `op` for the collective `what` on tensors `ts` and plans it: PREMUL_SUM becomes a
// premultiply and SUM (gloo has no PREMUL_SUM); ops gloo runs pass unchanged. An op or
// dtype the backend cannot reduce is a ValueError naming both, raised before any rank
// communicates.
ReducePlan plan_reduce(const c10d::ReduceOp& op, const std::vector<at::Tensor>& ts,
                       const char* what);

// `t` multiplied in place by the plan's factor (when it has one).
void premultiply_(const at::Tensor& t, const ReducePlan& plan);

// `t` multiplied by the plan's factor into a new tensor, or `t` itself when there is none
// (reduce_scatter must leave its input as it was).
at::Tensor premultiplied(const at::Tensor& t, const ReducePlan& plan);

}  // namespace neuron
