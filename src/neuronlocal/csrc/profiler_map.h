// profiler_map.cpp: the framework-op mapping of TorchNeuron's profiler. While it is on,
// every op executed on neuron is one runtime execution (one sequence id, as each eager op
// is one kernel launch on Trainium), recorded with what TorchNeuron's collector records:
// the autograd sequence number, PyTorch's thread id and the current stream.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace neuron {

struct FrameworkOpExec {
  int64_t seq_nr;
  uint64_t th_id;
  int64_t stream_id;
};

struct OpMapping {
  int64_t nrta_seq_id;
  std::vector<FrameworkOpExec> ops;
};

extern std::atomic<bool> g_mapping_on;
void set_mapping_enabled(bool on);
// Records one execution of an op on neuron (the caller checks g_mapping_on first).
void record_mapping();
// The executions recorded since the last call, in order; clears them.
std::vector<OpMapping> take_mappings();

}  // namespace neuron
