// The C++ core of neuronlocal: what PyTorch needs in C++ for a PrivateUse1 device.
//
// Python owns policy (config, hardware profiles, op placement, torch.neuron); C++ applies
// it, and does what the Python backend API cannot express or cannot do fast enough
// (docs/architecture.md). One concern per file:
//   module.cpp       the Python bindings (neuronlocal._C)
//   guard.cpp        device guard (current device, device count, streams, events), hooks,
//                    and the runtime's start at the first device use
//   generator.cpp    the per-core random generators, in TorchNeuron's state format
//   hbm.cpp          per-core HBM accounting of the emulated caching allocator, and OOM
//   memory.cpp       the neuron allocator over host memory, and the memory API over hbm.cpp
//   host_memory.cpp  host buffers reused by size, compiled graphs' host allocations counted
//   dry_memory.cpp   the data-less storages of a dry run (addresses, no bytes)
//   alias.cpp        zero-copy CPU aliases of neuron tensors; those compiled code keeps
//                    until backward follow their storage through resizes
//   fallback.cpp     the boxed CPU fallback on zero-copy aliases, op tracking, 64-bit rule
//   kernels.cpp      the few ATen kernels neuron implements itself (allocation, copies, ...)
//   registration.cpp every registration with the dispatcher, in one place
//   foreach.cpp      runs of elementwise foreach ops (optimizer steps), fused per tensor
//   autocast.cpp     autocast for the AutocastPrivateUse1 key, with CUDA's op lists
//   bridge.cpp       CPU aliases in and neuron tensors out for compiled graphs
//   c10d.cpp         the `neuron` process-group backend, on gloo over CPU aliases
//   collective_args.cpp  its argument checks for list forms, with the fix in each error
//   reduce_op.cpp    its reduce ops: every op NCCL has (PREMUL_SUM as premultiply + SUM)
//   dry_values.cpp   which data-less tensors of a dry run hold real values (MoE routing)
//   profiler_map.cpp the framework-op mapping of TorchNeuron's profiler (executions recorded)
//   exit.cpp         at exit, lets each core's autograd thread finish and closes the door
//                    C++ threads use to call Python, before finalization
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- guard.cpp -------------------------------------------------------------
// The runtime starts at the first device use, not at import: `starter` (Python's, which
// reads the core topology from the environment then) calls start() with what it found; it
// returns false when it failed. device_count() and check_available() start it first.
void set_starter(std::function<bool()> starter);
void start(int device_count, const std::vector<int64_t>& budgets, const std::string& hint,
           const std::string& unavailable_reason);
bool started();
void ensure_started() noexcept;
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
// Raises the CUDA-style error for an index outside [0, device_count).
void check_index(c10::DeviceIndex index);
at::Generator& default_generator(c10::DeviceIndex index);
void register_guard_and_hooks();

// ---- generator.cpp ---------------------------------------------------------
// A core's generator: TorchNeuron's 16-byte (seed, offset) state over CPU's stream for that
// seed, drawn when passed to a random op; ops without one draw CPU's global generator,
// unless the core's default generator draws its own stream (its state was set since its
// last seeding: draws_own_stream).
at::Generator make_generator(c10::DeviceIndex index);
bool draws_own_stream(const at::Generator& gen);
// While alive, holds a neuron generator's lock; generator() is the CPU generator to hand a
// CPU kernel, and what it draws is added to the neuron generator's offset at the end. Any
// other generator passes through unchanged.
class Draw {
 public:
  explicit Draw(const at::Generator& gen);
  ~Draw();
  Draw(const Draw&) = delete;
  Draw& operator=(const Draw&) = delete;
  const at::Generator& generator() const { return gen_; }

 private:
  at::Generator gen_;
  c10::GeneratorImpl* impl_;
  std::unique_lock<std::mutex> lock_;
  at::mt19937_data_pod before_{};
};

// ---- memory.cpp, hbm.cpp, host_memory.cpp ---------------------------------
// Per-core accounting of an emulated caching allocator (see hbm.cpp; hbm.h is its state).
void set_budgets(const std::vector<int64_t>& bytes_per_core);
void set_oom_hint(const std::string& hint);
// Marks the device unusable (bad configuration): every later use raises `reason`.
void set_unavailable(const std::string& reason);
// Starts the runtime if it has not started, then raises its configuration error, if any.
// Call it before taking the allocator's lock (starting sets the budgets under it).
void check_available();
c10::Allocator* allocator();
// Neuron storage that keeps `cpu` alive and counts its bytes against core `index`.
c10::Storage adopt_storage(const c10::Storage& cpu, c10::DeviceIndex index);
// A data pointer for `nbytes` on core `index` owned by `owner` (an adopted CPU storage).
c10::DataPtr adopt_data(c10::Storage owner, c10::DeviceIndex index);
std::map<std::string, int64_t> memory_stats(c10::DeviceIndex index);
// Lowers the program's peak counters to the current values; the run's high-water marks stay.
void reset_peak(c10::DeviceIndex index);
// The run's peak (allocated, reserved) bytes of a core since reset_high_water, whatever
// reset_peak calls came between.
std::pair<int64_t, int64_t> high_water_marks(c10::DeviceIndex index);
// Starts a run's high-water marks (and the peak counters) afresh.
void reset_high_water(c10::DeviceIndex index);
void reset_accumulated(c10::DeviceIndex index);
void empty_cache(c10::DeviceIndex index);
// Counts host allocations of this thread against core `index` (-1: off); returns the previous
// core. install_host_allocator() puts the counting wrapper in front of the CPU allocator.
void install_host_allocator();
c10::DeviceIndex set_host_core(c10::DeviceIndex index);
// The core set by set_host_core on this thread (-1: none, i.e. no compiled code is running).
c10::DeviceIndex host_core();
// Live bytes on a core over time, for the report: (seconds since start, bytes) samples.
std::vector<std::pair<double, int64_t>> memory_timeline(c10::DeviceIndex index);
void set_timeline(bool on);
// The peak's breakdown: what the live blocks held when allocated bytes last reached their
// high-water mark, by tag (set from Python: parameters, gradients, ...), and the op and
// user line of the allocation that set it. The hook returns that line; it is asked once
// per op call that sets a new mark.
struct PeakSnapshot {
  int64_t bytes;
  std::string op, line;
  std::map<int, int64_t> by_tag;
};
// Tags of what a block holds; a lower one wins (a parameter saved for backward is one).
enum PeakTag { kTagParameters = 1, kTagGradients, kTagOptimizer, kTagCollectives,
               kTagActivations };
PeakSnapshot peak_snapshot(c10::DeviceIndex index);
void reset_peak_snapshot(c10::DeviceIndex index);
bool tag_storage(const at::Tensor& t, int tag);
void set_peak_hook(std::function<std::string()> hook);
// Names the op dispatched on this thread while it lives (for the peak's op).
class OpScope {
 public:
  explicit OpScope(const std::string* op);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  const std::string* prev_;
};

// ---- alias.cpp -------------------------------------------------------------
// A CPU tensor over the bytes of a neuron tensor (no copy, keeps them alive). Runs queued
// foreach ops first (see settle()): use it for every read of neuron bytes outside dispatch.
at::Tensor cpu_alias(const at::Tensor& t);
// The neuron storage a CPU storage made by cpu_alias() stands for, or nullptr.
c10::StorageImpl* alias_source(const c10::Storage& cpu);
// The same alias without settling: for the dispatch path, which settles once per op.
at::Tensor alias_of(const at::Tensor& t);
// An alias that may outlive the call (compiled code saves it for backward): it follows its
// neuron storage through resizes (follow_resize, which every neuron storage resize calls).
at::Tensor tracked_alias(const at::Tensor& t);
void follow_resize(c10::StorageImpl* neuron_storage);

// ---- fallback.cpp ----------------------------------------------------------
// A neuron tensor over `st` with the sizes, strides and offset of `like`.
at::Tensor make_neuron(c10::Storage st, const at::Tensor& like);
// The boxed fallback every op without its own kernel runs (see fallback.cpp).
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Boxed kernel for composites TorchNeuron registers a device kernel for: records the op as
// executed, as TorchNeuron's tracking names it, then runs torch's composite kernel.
void tracked_composite(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The executed-op counter of one op (for kernels registered directly, not boxed).
std::atomic<int64_t>& executed_counter(const char* name, const char* overload);
// Boxed kernels that raise the clear error for sparse and quantized neuron tensors.
void unsupported_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void quantized_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
[[noreturn]] void unsupported(const std::string& op, const std::string& kind);
std::string layout_kind(c10::Layout layout);
// Policy and op data from Python (neuronlocal/eager/ops.py); each may change at run time.
void set_policy(bool downcast_64bit, bool strict);
void set_op_placement(const std::map<std::string, std::pair<int, std::string>>& ops,
                      int other_namespaces);
// Op names (without overload) that keep 64 bits (data movement), integer reductions
// computed in 32 bits, and ops that accept CPU index tensors.
void set_op_classes(const std::vector<std::string>& exact,
                    const std::vector<std::string>& int_reductions,
                    const std::vector<std::string>& cpu_index);
std::map<std::string, int64_t> executed_ops();
std::map<std::string, int64_t> fallback_ops();
std::map<std::string, std::pair<int64_t, int64_t>> fallback_bytes();  // to, from the host
std::map<std::string, int64_t> downcast_ops();
// Clears the counters above, and which ops the fallback-site hook was called for.
void clear_op_tracking();
// Called with an op's host name at its first CPU fallback since clear_op_tracking (views
// and metadata ops too, which are not warned), on the thread running it: the run report
// reads the program's line from the Python stack there, and returns whether it found one
// (if not, the op's next few fallbacks call it again). Empty: no hook.
void set_fallback_site_hook(std::function<bool(const std::string&)> hook);

// ---- kernels.cpp -----------------------------------------------------------
namespace kernels {
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin, std::optional<at::MemoryFormat> mf);
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin);
at::Tensor& set_empty(at::Tensor& self);
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride);
at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source);
at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source);
const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<at::MemoryFormat> mf);
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking);
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst);
at::Tensor to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                   std::optional<at::Layout> layout, std::optional<at::Device> device,
                   std::optional<bool> pin, bool non_blocking,
                   std::optional<at::MemoryFormat> mf);
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train);
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask);
void record_stream(at::Tensor& self, c10::Stream s);
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from);
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa);
// attention.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
sdpa_overrideable(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                  bool return_debug_mask, std::optional<double> scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_overrideable_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& cum_seq_q,
    const at::Tensor& cum_seq_k, int64_t max_q, int64_t max_k, double dropout_p,
    bool is_causal, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    std::optional<double> scale);
std::tuple<at::Tensor, at::Tensor> native_multi_head_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t embed_dim,
    int64_t num_head, const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
    const at::Tensor& proj_weight, const at::Tensor& proj_bias,
    const std::optional<at::Tensor>& mask, bool need_weights, bool average_attn_weights,
    std::optional<int64_t> mask_type);
std::optional<int64_t> overrideable_choice(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v);
}  // namespace kernels

// ---- registration.cpp ------------------------------------------------------
void register_kernels();
// Registers the boxed fallback directly for ops whose PrivateUse1 entry would otherwise
// decompose (structured kernels, some composites), so they cost one dispatch and compute
// what CPU computes.
void register_direct(const std::vector<std::string>& names);
// Composites TorchNeuron registers device kernels for: tracked under their own name.
void register_tracked(const std::vector<std::string>& names);
// Composite constructors of sparse tensors: stopped at their names with the clear error.
void register_unsupported(const std::vector<std::string>& names);

// ---- foreach.cpp -----------------------------------------------------------
enum class ForeachKind { None, InPlace, OutOfPlace };
// Whether `op` is an elementwise foreach op that may be queued, and of which kind.
ForeachKind foreach_kind(const c10::OperatorHandle& op);
// Queues the call on `stack` (leaving its results there) when its arguments allow; false
// when it must run now, through the normal path.
bool queue_foreach(const c10::OperatorHandle& op, ForeachKind kind, torch::jit::Stack* stack);
void run_queued_foreach();
extern std::atomic<bool> g_foreach_queued;
// Whether `op` is add/sub/mul/div with a scalar list, whose list lengths TorchNeuron's
// kernels check with a ValueError (CPU's check raises RuntimeError with the same words).
bool checks_scalar_list(const c10::OperatorHandle& op);
// Refuses a call of such an op whose tensor and scalar lists differ in length.
void check_scalar_list(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
// Runs queued foreach ops, if any. Everything that reads or frees neuron bytes outside a
// queued op calls it first: dispatch of any other op, copies, aliases, memory queries.
inline void settle() {
  if (g_foreach_queued.load(std::memory_order_acquire)) run_queued_foreach();
}

// ---- exit.cpp --------------------------------------------------------------
// The door every C++ -> Python call goes through (hooks, the starter, collective records).
// A thread that waits for the GIL while the interpreter finalizes is ended by CPython inside
// noexcept code, and a script that succeeded aborts at exit. At exit the door closes: calls
// under way finish first, later ones see ok() false and skip Python. Declare the PythonCall
// before the py::gil_scoped_acquire, so the GIL is released before the call is counted done.
class PythonCall {
 public:
  PythonCall();
  ~PythonCall();
  PythonCall(const PythonCall&) = delete;
  PythonCall& operator=(const PythonCall&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_;
};
// Whether exit has begun (the door is closed).
bool python_calls_closed();

// ---- module.cpp ------------------------------------------------------------
// Issues a UserWarning through Python's warnings now, attributed to the innermost Python line
// outside torch and neuronlocal (the program's),
// on a thread where Python called the op (torch's Python warning handler is installed).
// torch's handler would buffer it and issue it when the outermost binding returns; a binding
// that returns a Python error without a C++ exception (autograd.Function.apply when forward
// raises) then issues it with that error set, which Python reports as SystemError. A Python
// error already set is kept; a warning filter that makes it an error throws it (as torch's
// handler does). Returns false when Python cannot be called (exit under way).
bool warn_in_python(const std::string& message);
// On an autograd engine thread, which buffers warnings and replays them in the thread that
// called backward: issues a c10 warning attributed to that thread's program line (outside
// torch and neuronlocal) that ran the backward, with no C++ source. Returns false, issuing
// nothing, where no such Python thread is found (a backward driven from C++) or Python
// cannot be called.
bool warn_from_backward(const std::string& message);

}  // namespace neuron
