// Dry run: neuron storages carry no bytes (sizes, dtypes and HBM accounting only; see
// memory.cpp), eager ops run meta kernels (fallback.cpp), collectives complete without
// peers (c10d.cpp). Set once at import, before any tensor exists.
#pragma once

#include "neuron.h"

namespace neuron {

// Copies onto the device up to this size keep their bytes in a dry run (see kernels.cpp).
constexpr int64_t kDryKeepBytes = 1 << 20;

void set_dry_run(bool on);
bool dry_run();
// A data-less neuron storage (or data pointer) of `nbytes`, counted against core `index`.
c10::Storage dry_storage(int64_t nbytes, c10::DeviceIndex index);
c10::DataPtr dry_data(int64_t nbytes, c10::DeviceIndex index);
// Records that a dry run read a value it does not have (`what`: the op, or a would-be OOM);
// the hook is set from Python.
void set_dry_read_hook(std::function<void(const std::string&)> hook);
void dry_read(const std::string& what);

}  // namespace neuron
