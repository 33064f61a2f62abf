// TorchNeuron's argument contract for the list forms of its collectives: its process group
// validates them in Python before a collective runs (torch_neuronx/distributed/backend.py and
// its XLA collective ops), and these checks give the same reasons, as ValueErrors that name
// the fix. gloo would otherwise read past a short list or stop the process on a size check.
#include "collective_args.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace neuron {
namespace {

// "tensor[i]: [shape]" for each listed index.
std::string shapes_at(const std::vector<at::Tensor>& ts, const std::vector<size_t>& idx) {
  std::ostringstream os;
  for (size_t k = 0; k < idx.size(); ++k) {
    os << (k ? ", " : "") << "tensor[" << idx[k] << "]: " << ts[idx[k]].sizes();
  }
  return os.str();
}

// Both shapes left-padded with 1s to one rank (at least 1), as TorchNeuron compares them.
std::pair<std::vector<int64_t>, std::vector<int64_t>> padded(c10::IntArrayRef a,
                                                             c10::IntArrayRef b) {
  std::vector<int64_t> x(a.begin(), a.end()), y(b.begin(), b.end());
  if (x.size() < y.size()) x.insert(x.begin(), y.size() - x.size(), 1);
  if (y.size() < x.size()) y.insert(y.begin(), x.size() - y.size(), 1);
  if (x.empty()) x = y = {1};
  return {x, y};
}

void same_shapes(const char* what, const char* role, const std::vector<at::Tensor>& ts) {
  std::vector<size_t> off;
  for (size_t i = 1; i < ts.size(); ++i) {
    if (ts[i].sizes() != ts[0].sizes()) off.push_back(i);
  }
  TORCH_CHECK_VALUE(off.empty(), "neuron backend: ", what, ": all ", role, " tensors must have "
                    "same shape, expected ", ts[0].sizes(), " but found: ", shapes_at(ts, off),
                    ". Pad them to one shape.");
}

void same_dtypes(const char* what, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    TORCH_CHECK_TYPE(t.scalar_type() == ts[0].scalar_type(), "neuron backend: ", what,
                     ": all tensors must have same dtype, expected ", ts[0].scalar_type(),
                     " but found ", t.scalar_type(), ". Cast them to one dtype.");
  }
}

}  // namespace

void no_empty_rows(const char* what, const std::vector<at::Tensor>& ts) {
  std::vector<size_t> empty;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].dim() > 0 && ts[i].size(0) == 0) empty.push_back(i);
  }
  TORCH_CHECK_VALUE(empty.empty(), "neuron backend: ", what, ": tensors cannot have zero size in "
                    "dimension 0, found: ", shapes_at(ts, empty), " (TorchNeuron's collectives "
                    "refuse them). Skip the collective for empty tensors.");
}

Scatter reduce_scatter_plan(const at::Tensor& out, const std::vector<at::Tensor>& ins,
                            int size) {
  TORCH_CHECK_VALUE(!ins.empty(), "neuron backend: reduce_scatter: no input tensors provided. "
                    "Pass one tensor to scatter, or world_size (", size, ") tensors shaped like "
                    "the output.");
  std::vector<size_t> empty;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i].numel() == 0) empty.push_back(i);
  }
  TORCH_CHECK_VALUE(empty.empty(), "neuron backend: reduce_scatter: tensors cannot be empty, "
                    "found empty tensors at indices: ", shapes_at(ins, empty), ".");
  TORCH_CHECK_VALUE(out.numel() > 0, "neuron backend: reduce_scatter: output tensor cannot be "
                    "empty, got shape ", out.sizes(), ".");
  same_dtypes("reduce_scatter", ins);
  TORCH_CHECK_TYPE(out.scalar_type() == ins[0].scalar_type(), "neuron backend: reduce_scatter: "
                   "output tensor dtype (", out.scalar_type(), ") must match input tensor dtype (",
                   ins[0].scalar_type(), "). Cast one of them.");
  same_shapes("reduce_scatter", "input", ins);
  if (ins.size() > 1) {
    TORCH_CHECK_VALUE(ins.size() == static_cast<size_t>(size), "neuron backend: reduce_scatter: "
                      "multi-tensor scatter: replica group size (", size, ") must equal number "
                      "of input tensors (", ins.size(), "). Pass world_size tensors, or one "
                      "tensor to scatter.");
    TORCH_CHECK_VALUE(ins[0].sizes() == out.sizes(), "neuron backend: reduce_scatter: each of "
                      "the world_size input tensors must be shaped like the output ",
                      out.sizes(), ", got ", ins[0].sizes(), ".");
    return {};
  }
  auto [in_shape, out_shape] = padded(ins[0].sizes(), out.sizes());
  std::vector<size_t> diff;
  for (size_t d = 0; d < in_shape.size(); ++d) {
    if (in_shape[d] != out_shape[d]) diff.push_back(d);
  }
  std::ostringstream dims;
  for (size_t k = 0; k < diff.size(); ++k) {
    dims << (k ? ", " : "") << "dim[" << diff[k] << "]: " << in_shape[diff[k]] << " -> "
         << out_shape[diff[k]];
  }
  TORCH_CHECK_VALUE(diff.size() <= 1, "neuron backend: reduce_scatter: single tensor scatter can "
                    "only differ in one dimension, found differences in: ", dims.str(),
                    ". Shape the output as the input with one dimension divided by world size.");
  if (diff.empty()) {
    TORCH_CHECK_VALUE(size == 1, "neuron backend: reduce_scatter: when input and output shapes "
                      "are identical, replica group must have size 1, got ", size, ". Shape the "
                      "output as the input with one dimension divided by world size.");
    return {0, in_shape, out_shape};
  }
  const auto d = static_cast<int64_t>(diff[0]);
  TORCH_CHECK_VALUE(in_shape[d] == out_shape[d] * size, "neuron backend: reduce_scatter: scatter "
                    "dimension ", d, ": input size (", in_shape[d], ") must be evenly divisible "
                    "by replica group size (", size, ") into the output's size: expected output "
                    "size ", in_shape[d] / size, ", actual output size ", out_shape[d], ".");
  return {d, in_shape, out_shape};
}

void all_to_all_lists(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins,
                      int size) {
  TORCH_CHECK_VALUE(ins.size() == static_cast<size_t>(size), "neuron backend: all_to_all: number "
                    "of input tensors (", ins.size(), ") must equal world size (", size, "). "
                    "Pass one tensor per rank.");
  TORCH_CHECK_VALUE(outs.size() == static_cast<size_t>(size), "neuron backend: all_to_all: number "
                    "of output tensors (", outs.size(), ") must equal world size (", size, "). "
                    "Pass one tensor per rank.");
  same_dtypes("all_to_all", ins);
  same_shapes("all_to_all", "input", ins);
  same_shapes("all_to_all", "output", outs);
  TORCH_CHECK_VALUE(outs[0].sizes() == ins[0].sizes(), "neuron backend: all_to_all supports only "
                    "even splits (as TorchNeuron): outputs shaped ", outs[0].sizes(), " for inputs "
                    "shaped ", ins[0].sizes(), ". Shape every output like the inputs.");
}

void all_gather_coalesced_lists(const std::vector<std::vector<at::Tensor>>& outs,
                                const std::vector<at::Tensor>& ins, int size) {
  TORCH_CHECK_VALUE(!ins.empty(), "neuron backend: all_gather_coalesced: no input tensors "
                    "provided.");
  TORCH_CHECK_VALUE(outs.size() == ins.size(), "neuron backend: all_gather_coalesced: ",
                    ins.size(), " input tensor(s) need as many output lists (TorchNeuron's "
                    "layout: output_lists[i][r] is input i of rank r), got ", outs.size(), ".");
  same_dtypes("all_gather_coalesced", ins);
  for (size_t i = 0; i < ins.size(); ++i) {
    TORCH_CHECK_VALUE(outs[i].size() == static_cast<size_t>(size), "neuron backend: "
                      "all_gather_coalesced: output list ", i, " has ", outs[i].size(),
                      " tensor(s), it needs world_size (", size, "): one per rank.");
    for (size_t r = 0; r < outs[i].size(); ++r) {
      TORCH_CHECK_VALUE(outs[i][r].sizes() == ins[i].sizes(), "neuron backend: "
                        "all_gather_coalesced: output_lists[", i, "][", r, "] has shape ",
                        outs[i][r].sizes(), ", input ", i, " has ", ins[i].sizes(), ". Shape "
                        "output list i like input i.");
      TORCH_CHECK_TYPE(outs[i][r].scalar_type() == ins[i].scalar_type(), "neuron backend: "
                       "all_gather_coalesced: output_lists[", i, "][", r, "] is ",
                       outs[i][r].scalar_type(), ", input ", i, " is ", ins[i].scalar_type(),
                       ". Cast one of them.");
    }
  }
  no_empty_rows("all_gather_coalesced", ins);
}

}  // namespace neuron
