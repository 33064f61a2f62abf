// TorchNeuron's argument contract for the list forms of its collectives (c10d.cpp applies
// it before gloo sees the tensors): what each accepts, and a clear ValueError for the rest.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace neuron {

// The all-gather family refuses tensors with no rows: ValueError naming them.
void no_empty_rows(const char* what, const std::vector<at::Tensor>& ts);

// How reduce_scatter scatters its input list. One tensor: along the one dimension `dim`
// where its shape differs from the output's (input size = world size x output size there),
// with both shapes left-padded with 1s to one rank. World-size tensors shaped like the
// output (NCCL's form): dim is -1.
struct Scatter {
  int64_t dim = -1;
  std::vector<int64_t> in_shape, out_shape;
};
Scatter reduce_scatter_plan(const at::Tensor& out, const std::vector<at::Tensor>& ins, int size);

// all_to_all's lists: world-size inputs and outputs, all of one shape and dtype.
void all_to_all_lists(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins,
                      int size);

// all_gather_coalesced's lists, TorchNeuron's layout: one output list per input tensor, each
// with world-size tensors shaped like that input.
void all_gather_coalesced_lists(const std::vector<std::vector<at::Tensor>>& outs,
                                const std::vector<at::Tensor>& ins, int size);

}  // namespace neuron
