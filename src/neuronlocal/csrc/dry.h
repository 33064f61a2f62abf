// Dry run: neuron storages carry no bytes (sizes, dtypes and HBM accounting only; see
// dry_memory.cpp), eager ops run meta kernels (fallback.cpp), collectives complete without
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

// Values a dry run keeps (dry_values.cpp): a storage holds them when every neuron input of
// the op that wrote it did (fresh allocations and integer copies from the host do); ops
// on such inputs compute on the host for real, results up to this size keep their bytes.
constexpr int64_t kDryValueBytes = 16 << 20;
bool dry_has_values(const at::Tensor& t);
// Marks the whole storage of `t` as holding values or not (over kDryValueBytes, or over
// kDryKeepBytes for a floating-point `t`: not).
void dry_mark(const at::Tensor& t, bool values);
// dry_memory.cpp: drops the host pages a write committed under the storage of `t` (it no
// longer holds values: reads see zeros again, and it costs no host memory).
void dry_release(const at::Tensor& t);
// dry_memory.cpp: the block at `addr` is freed (its address may hold another storage next).
void dry_forget(const void* addr);
// Whether `t` is its whole storage, contiguous (a write to it defines every byte).
bool covers_storage(const at::Tensor& t);
// Routing of index outputs computed from data the run lacks: hot < 0 balanced, else that
// fraction of the rows takes index 0 (the rest balanced over the others).
void set_dry_routing(double hot);
double dry_routing();
// Fills index result `idx` of `op` (indices into `n` along `dim` of the input; `kept`:
// the result keeps that dim) with the routing pattern, marks it valued, reports the site.
void dry_fill_index(const std::string& op, const at::Tensor& idx, int64_t dim, bool kept,
                    int64_t n);

}  // namespace neuron
