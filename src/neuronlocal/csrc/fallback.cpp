// The eager path: every ATen op on neuron tensors runs ATen's CPU kernel on zero-copy
// CPU aliases of their bytes, and the results are adopted back as neuron tensors.
//
// One boxed fallback covers all ops. Per op it: checks that tensors share one core
// (CUDA's error otherwise), swaps neuron tensors for CPU aliases, hands random ops CPU's
// global generator (TorchNeuron's CPU fallback does: its random ops have no device kernel,
// so seed, draw on CPU, draw on neuron gives CPU's stream) or the neuron generator passed
// in, applies Trainium's 64-bit policy (compute in 32 bits, cast
// back), redispatches to the CPU kernel, then maps each result back: the caller's own
// tensor for in-place/out= results, a view on the input's storage for views, otherwise a
// new neuron storage that owns the CPU result's bytes and counts them against the core.
// Per-op analysis of the schema is done once and cached; which ops run on the host and
// which keep 64 bits is data that Python sets (neuronlocal/eager/ops.py).
//
// In a dry run (dry_memory.cpp) the same path runs each op's Meta kernel on data-less meta
// aliases instead, so placement, the 64-bit rule, tracking and HBM accounting are those of
// a real run while no bytes exist. An op without a meta kernel (data-dependent output:
// nonzero, unique, bincount) runs its CPU kernel on the memory of its inputs, and a value
// read from the device (item, copies to the host) is read from that memory: zeros wherever
// an op computed it (no kernel writes), the bytes of small copies from the host (see
// kernels.cpp). Each such read is reported (dry_read).
#include "dry.h"
#include "profiler_map.h"

#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

namespace neuron {
namespace {

// Runtime policy, changed from Python while other threads may dispatch.
std::atomic<bool> g_downcast{true};
std::atomic<bool> g_strict{false};

// Op classes and placement (data in neuronlocal/eager/ops.py), by op name.
constexpr uint8_t kHost = 1, kQuiet = 2, kKeep64 = 4;
std::unordered_map<std::string, std::pair<uint8_t, std::string>> g_placement;
uint8_t g_other_namespaces = 0;  // flags of non-aten ops that reach the fallback
std::unordered_set<std::string> g_exact, g_int_reductions, g_cpu_index;

// What the op-level data decides for one op. Immutable once published: a policy change
// publishes a new one, and the old stays alive (calls in flight may read it; changes are
// rare, a few per process).
struct Decision {
  bool exact = false;         // no 64-bit downcast (views, data movement, host ops)
  bool pointwise = false;     // int64 inputs are computed as int32
  bool cpu_fallback = false;  // TorchNeuron runs this op on CPU
  bool quiet = false;         // view/metadata op: its fallback is not warned
  bool allow_cpu = false;     // CPU index tensors are accepted (as CUDA does)
  std::string host_name;      // the op TorchNeuron runs on CPU (this one, or a piece)
};
std::deque<Decision> g_decisions;

struct OpInfo {
  std::string name;           // aten::add.Tensor
  std::string base;           // aten::add
  bool is_view = false;       // returns aliases of inputs without writing them
  bool pointwise_tag = false; // tagged pointwise
  int generator_arg = -1;
  // Device kernels compute a half input as float32 (`half_to_float`), and its backward takes
  // a float32 gradient for a half input (`input_dtype`); CPU kernels reject both.
  int half_to_float_arg = -1;
  int input_dtype_arg = -1;
  ForeachKind foreach = ForeachKind::None;  // queued and fused per tensor (foreach.cpp)
  bool scalar_list = false;   // list lengths checked as TorchNeuron does (foreach.cpp)
  std::vector<bool> write;    // per argument: mutated by the op
  std::atomic<const Decision*> decision{nullptr};
  std::atomic<int64_t> executed{0}, fallback{0}, downcast{0}, to_host{0}, from_host{0};
  std::atomic<bool> warned{false};
  std::atomic<bool> wrap_warned{false};  // an int64 value outside int32 was seen
  std::atomic<int> site_tries{0};  // fallback-site hook calls; kSited once it found one
};

// The fallback-site hook: replaced under its mutex, copied out to be called (so a call never
// races a replacement); the flag keeps the fallback path to one relaxed load without a hook.
// A call that finds no program frame (a backward op on autograd's device thread) leaves the
// next fallbacks of the op to try again, a few times at most.
std::mutex g_site_mu;
std::shared_ptr<std::function<bool(const std::string&)>> g_site_hook;
std::atomic<bool> g_site_on{false};
constexpr int kSiteTries = 16, kSited = 1 << 20;

void report_site(OpInfo& info, const std::string& host_name) {
  if (!g_site_on.load(std::memory_order_relaxed) || info.site_tries.fetch_add(1) >= kSiteTries)
    return;
  std::shared_ptr<std::function<bool(const std::string&)>> hook;
  {
    std::lock_guard<std::mutex> lock(g_site_mu);
    hook = g_site_hook;
  }
  if (hook && (*hook)(host_name)) info.site_tries = kSited;
}

std::function<void(const std::string&)>& dry_read_hook() {
  static auto* h = new std::function<void(const std::string&)>();  // leaked, like the hooks
  return *h;
}

// A meta tensor with the sizes, strides, offset and dtype of neuron tensor `t`, over a
// storage of the same byte size: what a meta kernel sees in place of the CPU alias.
at::Tensor meta_alias(const at::Tensor& t) {
  auto* src = t.storage().unsafeGetStorageImpl();
  c10::Storage st(c10::Storage::use_byte_size_t(), src->nbytes(),
                  c10::DataPtr(nullptr, c10::Device(c10::kMeta)),
                  c10::GetAllocator(c10::DeviceType::Meta), true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(st), c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

std::mutex g_info_mu;  // guards g_infos, g_decisions and the op data above
std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpInfo>> g_infos;

// Publishes the decision of the current op data for `info` (under g_info_mu).
void decide(OpInfo& info) {
  Decision d;
  auto it = g_placement.find(info.name);
  uint8_t flags = it != g_placement.end() ? it->second.first
                  : info.base.rfind("aten::", 0) == 0 ? 0 : g_other_namespaces;
  d.cpu_fallback = flags & kHost;
  d.quiet = flags & kQuiet;
  d.host_name = it != g_placement.end() ? it->second.second : info.name;
  // Host ops compute in 64 bits (TorchNeuron's CPU fallback runs them on CPU as they are).
  d.exact = info.is_view || g_exact.count(info.base) > 0 || (flags & kKeep64);
  d.pointwise = info.pointwise_tag || g_int_reductions.count(info.base) > 0;
  d.allow_cpu = g_cpu_index.count(info.base) > 0;
  g_decisions.push_back(std::move(d));
  info.decision.store(&g_decisions.back(), std::memory_order_release);
}

OpInfo& info_for(const c10::OperatorHandle& op) {
  const auto* key = &op.schema();
  std::lock_guard<std::mutex> lock(g_info_mu);
  auto it = g_infos.find(key);
  if (it != g_infos.end()) return *it->second;
  auto info = std::make_unique<OpInfo>();
  const auto& schema = op.schema();
  info->base = schema.name();
  info->name = schema.overload_name().empty() ? info->base
                                              : info->base + "." + schema.overload_name();
  bool writes = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& arg = schema.arguments()[i];
    bool w = arg.alias_info() && arg.alias_info()->isWrite();
    info->write.push_back(w);
    writes |= w;
    auto t = arg.real_type();
    if (auto opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType();
    if (t->kind() == c10::TypeKind::GeneratorType) info->generator_arg = static_cast<int>(i);
    if (arg.name() == "half_to_float" && t->kind() == c10::TypeKind::BoolType) {
      info->half_to_float_arg = static_cast<int>(i);
    }
    if (arg.name() == "input_dtype" && t->kind() == c10::TypeKind::ScalarTypeType) {
      info->input_dtype_arg = static_cast<int>(i);
    }
  }
  for (const auto& ret : schema.returns()) {
    if (ret.alias_info() && !ret.alias_info()->isWrite() && !writes) info->is_view = true;
  }
  if (writes) info->input_dtype_arg = -1;  // an out= result keeps the dtype it was given
  info->pointwise_tag = op.hasTag(at::Tag::pointwise);
  info->foreach = foreach_kind(op);
  info->scalar_list = checks_scalar_list(op);
  decide(*info);
  auto& ref = *info;
  g_infos.emplace(key, std::move(info));
  return ref;
}

std::string where(const c10::Device& d) {
  return d.type() == kNeuron ? "neuron:" + std::to_string(d.index()) : d.str();
}

// Under Trainium's 64-bit rule int64 is computed as int32; a value outside int32 changes.
// Warns once per op (then stops checking): one branch-free pass over contiguous data.
bool fits_int32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

// Whether the current warning handler is torch's Python one (an op called from Python).
// Other handlers (C++ callers, torch.ops' boxed path) log the source location and need one.
bool handler_is(const char* name) {
  c10::WarningHandler* h = c10::WarningUtils::get_warning_handler();
  return h != nullptr && std::strstr(typeid(*h).name(), name) != nullptr;
}
bool python_handles_warnings() { return handler_is("PyWarningHandler"); }

// A UserWarning attributed to the Python line that called the op, issued through Python's
// warnings at once (warn_in_python: never buffered until a binding returns, when an error
// may be set), without TORCH_WARN's "Triggered internally at <file>.cpp:<line>", a path
// that means nothing to the user. On autograd's engine threads (their handler is the graph
// task's DelayWarningHandler) it is attributed to the program's line that ran backward.
// Other callers (C++) get c10's warning with its source location, which their handler logs.
template <typename... Args>
void warn_user(const Args&... args) {
  const std::string message = c10::str(args...);
  if (python_handles_warnings() && warn_in_python(message)) return;
  if (handler_is("DelayWarningHandler") && warn_from_backward(message)) return;
  c10::warn(c10::Warning(c10::UserWarning(),
                         c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         message, false));
}

void warn_wrap(OpInfo& info, int64_t value) {
  if (info.wrap_warned.exchange(true)) return;
  warn_user(info.name, ": the int64 value ", value, " does not fit in int32, and Trainium "
            "computes int64 as int32 (the 64-bit rule), so this result differs from CPU. Keep "
            "int64 values within +-2**31, or set NEURONLOCAL_DOWNCAST_64BIT=0 to compute in "
            "64 bits. Warned once per op.");
}

void check_int32_range(OpInfo& info, const at::Tensor& t) {
  const int64_t n = t.numel();
  if (n == 0) return;
  if (t.is_contiguous()) {
    const int64_t* p = t.const_data_ptr<int64_t>();
    uint64_t acc = 0;  // v fits iff v + 2**31 < 2**32 (unsigned)
    for (int64_t i = 0; i < n; ++i) acc |= static_cast<uint64_t>(p[i]) + 0x80000000ULL;
    if ((acc >> 32) == 0) return;
    for (int64_t i = 0; i < n; ++i) {
      if (!fits_int32(p[i])) return warn_wrap(info, p[i]);
    }
    return;
  }
  auto [lo, hi] = at::aminmax(t);
  const int64_t l = lo.item<int64_t>(), h = hi.item<int64_t>();
  if (!fits_int32(l) || !fits_int32(h)) warn_wrap(info, fits_int32(l) ? h : l);
}

// A non-scalar CPU tensor (argument `position`) starts with TorchNeuron's words for it.
[[noreturn]] void mixed_devices(const OpInfo& info, const c10::Device& a, const c10::Device& b,
                                const std::string& arg, size_t position = SIZE_MAX) {
  std::string torchneuron;
  if (b.is_cpu() && position != SIZE_MAX) {
    torchneuron = "Non-scalar tensor arg" + std::to_string(position) +
                  " is on cpu device, expected neuron. ";
  }
  TORCH_CHECK(false, torchneuron, "Expected all tensors to be on the same device, but found at "
              "least two devices, ", where(a), " and ", where(b), "! (argument '", arg, "' of ",
              info.name, "). Move them to one device first, e.g. tensor.to('", where(a), "').");
}

// One neuron input of the current call.
struct Input {
  at::Tensor neuron;   // the caller's tensor
  at::Tensor alias;    // its CPU alias
  at::Tensor compute;  // what the CPU kernel got (alias, or a 32-bit copy)
  bool write;
};

struct Call {
  OpInfo& info;
  const Decision& d;
  c10::DeviceIndex index = -1;
  c10::Device cpu_seen{c10::kCPU};
  size_t cpu_arg = SIZE_MAX;  // first non-scalar tensor argument on another device
  const bool downcast = g_downcast.load(std::memory_order_relaxed);
  const bool dry = dry_run();
  bool real = false;  // dry run, every input holds values: the CPU kernel on their bytes
  bool downcast_f = false, downcast_i = false;
  // The call names its result dtype (`cumsum(..., dtype=torch.int32)`): a 32-bit result is
  // what CPU gives too, not a 64-bit one computed in 32 bits, so it is not cast back.
  bool dtype_given = false;
  c10::SmallVector<Input, 8> inputs;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted;

  const c10::FunctionSchema& schema;
  Call(OpInfo& i, const Decision& dec, const c10::FunctionSchema& s)
      : info(i), d(dec), schema(s) {}
  std::string op_arg_name(size_t arg) const { return schema.arguments()[arg].name(); }

  at::Tensor in(const at::Tensor& t, size_t arg, bool write) {
    if (!t.defined()) return t;
    const auto dev = t.device();
    if (dev.type() != kNeuron) {
      if (dev.is_cpu() && (t.dim() == 0 || d.allow_cpu)) return t;
      if (cpu_arg == SIZE_MAX) {
        cpu_seen = dev;
        cpu_arg = arg;
      }
      return t;
    }
    if (index < 0) index = dev.index();
    else if (dev.index() != index) {
      mixed_devices(info, {kNeuron, index}, dev, op_arg_name(arg));
    }
    Input x{t, dry && !real ? meta_alias(t) : alias_of(t), {}, write};
    x.compute = x.alias;
    if (downcast && !d.exact) {
      auto st = t.scalar_type();
      if (st == at::kDouble || st == at::kComplexDouble) {
        x.compute = x.alias.to(st == at::kDouble ? at::kFloat : at::kComplexFloat);
        downcast_f = true;
      } else if (st == at::kLong && d.pointwise) {
        if (!dry && !info.wrap_warned.load(std::memory_order_relaxed)) {
          check_int32_range(info, x.alias);
        }
        x.compute = x.alias.to(at::kInt);
        downcast_i = true;
      }
    }
    inputs.push_back(x);
    return x.compute;
  }

  // Copies a 32-bit result back into a 64-bit written argument, and mirrors any resize
  // or restride the CPU kernel did to the alias onto the caller's neuron tensor.
  void sync_written(Input& x) {
    if (!x.compute.is_same(x.alias)) {
      if (!x.alias.sizes().equals(x.compute.sizes())) x.alias.resize_(x.compute.sizes());
      x.alias.copy_(x.compute);
    }
    auto* n = x.neuron.unsafeGetTensorImpl();
    auto* a = x.alias.unsafeGetTensorImpl();
    const auto& ast = a->storage();
    auto* nst = n->storage().unsafeGetStorageImpl();
    if (dry && real) {  // the bytes were written in place, or into a storage the kernel grew
      if (ast.data() != nst->data() || ast.nbytes() != nst->nbytes()) {
        auto fresh = dry_data(static_cast<int64_t>(ast.nbytes()), x.neuron.device().index());
        if (static_cast<int64_t>(ast.nbytes()) <= kDryValueBytes && ast.nbytes() > 0) {
          std::memcpy(fresh.get(), ast.data(), ast.nbytes());
        }
        nst->set_data_ptr_noswap(std::move(fresh));
        nst->set_nbytes(ast.nbytes());
      }
    } else if (dry) {
      if (ast.nbytes() != nst->nbytes()) {
        nst->set_data_ptr_noswap(dry_data(static_cast<int64_t>(ast.nbytes()),
                                          x.neuron.device().index()));
        nst->set_nbytes(ast.nbytes());
      }
    } else if (ast.data() != nst->data() || ast.nbytes() != nst->nbytes()) {
      nst->set_data_ptr_noswap(adopt_data(ast, x.neuron.device().index()));
      nst->set_nbytes(ast.nbytes());
    }
    if (!n->sizes().equals(a->sizes()) || !n->strides().equals(a->strides()) ||
        n->storage_offset() != a->storage_offset()) {
      n->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
    }
    // Written from inputs with values: the storage holds them if it did, or if this write
    // defined all of it. Written from data the run lacks: it holds none, and the bytes an
    // earlier write with values committed are dropped (an optimizer's zero-initialised
    // state, scaled for real at its first step, then updated from gradients).
    if (dry) {
      const bool held = dry_has_values(x.neuron);
      const bool holds = real && (held || covers_storage(x.neuron));
      dry_mark(x.neuron, holds);
      if (held && !dry_has_values(x.neuron)) dry_release(x.neuron);
    }
  }

  at::Tensor out(at::Tensor r) {
    if (!r.defined() || !(r.device().is_cpu() || (dry && r.device().is_meta()))) return r;
    auto* impl = r.unsafeGetTensorImpl();
    for (auto& x : inputs) {
      if (impl == x.compute.unsafeGetTensorImpl()) {
        if (x.write) {
          sync_written(x);
          return x.neuron;
        }
        break;
      }
    }
    // Before any storage access: sparse and other layouts have no storage.
    if (r.layout() != at::kStrided) unsupported(info.name, layout_kind(r.layout()));
    if (r.is_quantized()) unsupported(info.name, "quantized");
    auto* sti = r.storage().unsafeGetStorageImpl();
    for (auto& x : inputs) {
      if (x.alias.storage().unsafeGetStorageImpl() == sti) return make_neuron(x.neuron.storage(), r);
    }
    for (auto& [cpu, st] : adopted) {
      if (cpu == sti) return make_neuron(st, r);
    }
    if (r._is_zerotensor() && (!dry || real)) r = at::zeros(r.sizes(), r.options());
    auto st = r.scalar_type();
    if (!dtype_given && ((downcast_f && (st == at::kFloat || st == at::kComplexFloat)) ||
                         (downcast_i && st == at::kInt))) {
      r = r.to(st == at::kFloat ? at::kDouble : st == at::kInt ? at::kLong : at::kComplexDouble);
    }
    auto idx = index < 0 ? current_device() : index;
    auto nst = dry ? dry_storage(static_cast<int64_t>(r.storage().nbytes()), idx)
                   : adopt_storage(r.storage(), idx);
    // A small host result (an op without a meta kernel) keeps its bytes, as small copies do;
    // computed from inputs with values, it holds values (up to kDryValueBytes).
    const auto bytes = static_cast<int64_t>(r.storage().nbytes());
    if (dry && !r.is_meta() && bytes > 0 && bytes <= (real ? kDryValueBytes : kDryKeepBytes)) {
      std::memcpy(nst.mutable_data(), r.storage().data(), r.storage().nbytes());
    }
    adopted.emplace_back(r.storage().unsafeGetStorageImpl(), nst);
    auto t = make_neuron(nst, r);
    if (dry && real) dry_mark(t, true);
    return t;
  }
};

// Once per op name that falls back, as TorchNeuron warns (atan2 and atan2_ both reach
// atan2.out: one warning).
bool first_warning(const std::string& name) {
  static std::mutex mu;
  static std::unordered_set<std::string> warned;
  std::lock_guard<std::mutex> lock(mu);
  return warned.insert(name).second;
}

void on_cpu_fallback(OpInfo& info, const Decision& d) {
  info.fallback++;
  report_site(info, d.host_name);
  const std::string via = d.host_name == info.name ? "" : " (reached from " + info.name + ")";
  TORCH_CHECK(!g_strict.load(std::memory_order_relaxed), d.host_name, via, " has no Trainium kernel: TorchNeuron runs it on "
              "CPU. NEURONLOCAL_STRICT=1 makes CPU fallbacks errors; unset it to allow them, or "
              "avoid this op.");
  if (!d.quiet && !info.warned.exchange(true) && first_warning(d.host_name)) {
    warn_user(d.host_name, " executed via CPU fallback", via, " (TorchNeuron has no device "
              "kernel for it; on Trainium it runs on the host). See "
              "torch_neuronx.get_fallback_ops() and `neuronlocal ops`.");
  }
}

int64_t nbytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * t.element_size() : 0;
}

// What the fallback copies on Trainium: every neuron input to the host, and back every
// written input and every new result.
void count_host_traffic(OpInfo& info, const Call& call, const torch::jit::Stack& stack,
                        size_t rbase) {
  int64_t to = 0, from = 0;
  for (const auto& x : call.inputs) {
    to += nbytes(x.alias);
    if (x.write) from += nbytes(x.alias);
  }
  auto add_result = [&](const at::Tensor& r) {
    for (const auto& x : call.inputs) {
      if (x.write && r.unsafeGetTensorImpl() == x.neuron.unsafeGetTensorImpl()) return;
    }
    from += nbytes(r);
  };
  for (size_t j = rbase; j < stack.size(); ++j) {
    const auto& r = stack[j];
    if (r.isTensor()) add_result(r.toTensor());
    else if (r.isTensorList()) for (const at::Tensor& t : r.toTensorList().vec()) add_result(t);
  }
  info.to_host += to;
  info.from_host += from;
}

void on_downcast(OpInfo& info, bool is_float) {
  info.downcast++;
  TORCH_CHECK(!(g_strict.load(std::memory_order_relaxed) && is_float), info.name, " got a 64-bit floating point tensor: "
              "Trainium computes float64 as float32. Cast to float32 (tensor.float(), "
              "model.float()) or unset NEURONLOCAL_STRICT.");
}

// A half input computed as float32 (softmax's `half_to_float`, as TorchNeuron's and CUDA's
// kernels do): the CPU kernel gets the input in float32. The backward's float32 gradient of
// a half input (`input_dtype`): computed in float32, the result cast to the input's dtype,
// which it returns.
std::optional<at::ScalarType> float_for_half(const OpInfo& info, torch::jit::Stack& stack,
                                             size_t base) {
  if (info.half_to_float_arg >= 0 && stack[base + info.half_to_float_arg].toBool()) {
    stack[base] = stack[base].toTensor().to(at::kFloat);
    stack[base + info.half_to_float_arg] = false;
  }
  if (info.input_dtype_arg < 0) return std::nullopt;
  auto& dtype = stack[base + info.input_dtype_arg];
  const auto grad = stack[base].toTensor().scalar_type();
  const auto wanted = dtype.toScalarType();
  if (wanted == grad) return std::nullopt;
  dtype = c10::IValue(grad);
  return wanted;
}

// `.item()` in a dry run: read from the tensor's memory (zero unless copied from the host).
void dry_item(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto& v = stack->back();
  if (!dry_has_values(v.toTensor())) dry_read("aten::_local_scalar_dense (.item())");
  v = alias_of(v.toTensor());
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// The memory behind meta input `t` as a CPU tensor (in the dtype the kernel was given).
at::Tensor host_for(const at::Tensor& t, const c10::SmallVector<Input, 8>& inputs) {
  for (const auto& x : inputs) {
    if (x.compute.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
      auto a = alias_of(x.neuron);
      return a.scalar_type() == t.scalar_type() ? a : a.to(t.scalar_type());
    }
  }
  return at::zeros(t.sizes(), t.options().device(c10::kCPU));
}

// The op's Meta kernel on the meta aliases. Without one (ops whose output shape depends on
// the data), an op that writes no argument runs its CPU kernel on its inputs' memory, and
// the read is reported; its results become data-less neuron tensors like any other.
void redispatch_dry(const c10::OperatorHandle& op, const OpInfo& info, torch::jit::Stack* stack,
                    size_t base, const c10::SmallVector<Input, 8>& inputs) {
  std::vector<c10::IValue> args(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
    return;
  } catch (const std::exception&) {
    for (bool w : info.write) if (w) throw;
  }
  stack->resize(base);
  for (auto& v : args) {
    if (v.isTensor() && v.toTensor().is_meta()) {
      v = host_for(v.toTensor(), inputs);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        if (list.get(j).is_meta()) list.set(j, host_for(list.get(j), inputs));
      }
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list.get(j);
        if (t.has_value() && t->is_meta()) list.set(j, host_for(*t, inputs));
      }
    } else if (v.isDevice() && v.toDevice().is_meta()) {
      v = c10::IValue(c10::Device(c10::kCPU));
    }
    stack->push_back(std::move(v));
  }
  dry_read(info.name + " (no meta kernel: ran on the device memory, zeros where computed)");
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// Whether a dry-run call computes for real: it draws nothing, and every neuron input holds
// values (an out= argument's old bytes do not matter), none larger than kDryValueBytes.
bool computes_values(const OpInfo& info, const c10::FunctionSchema& schema,
                     const torch::jit::Stack& stack, size_t base) {
  if (info.generator_arg >= 0) return false;
  bool ok = true;
  auto check = [&](const at::Tensor& t, bool out) {
    if (!ok || !t.defined() || t.device().type() != kNeuron) return;
    ok = static_cast<int64_t>(t.storage().nbytes()) <= kDryValueBytes &&
         (out || dry_has_values(t));
  };
  for (size_t i = 0; i < schema.arguments().size() && ok; ++i) {
    const auto& v = stack[base + i];
    const bool out = info.write[i] && schema.arguments()[i].is_out();
    if (v.isTensor()) {
      check(v.toTensor(), out);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) check(t, out);
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list.get(j);
        if (t.has_value()) check(*t, out);
      }
    }
  }
  return ok;
}

// The routing policy's ops: which result holds indices (-1: none). `max`/`min` only with a dim.
int index_result(const OpInfo& info) {
  const auto& b = info.base;
  if (b == "aten::topk" || b == "aten::sort") return 1;
  if ((b == "aten::max" || b == "aten::min") && info.name.find(".dim") != std::string::npos) return 1;
  if (b == "aten::argmax" || b == "aten::argmin") return 0;
  return -1;
}

// Where the policy's op takes its indices: the input's size along `dim` and whether the
// result keeps that dim (read from the arguments before the call).
struct IndexSite {
  int64_t dim = -1, n = 0;
  bool kept = true;
};
IndexSite index_site(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                     size_t base) {
  IndexSite s;
  const auto& self = stack[base].toTensor();
  std::optional<int64_t> dim;
  bool keepdim = false, has_keepdim = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& name = schema.arguments()[i].name();
    const auto& v = stack[base + i];
    if (name == "dim" && v.isInt()) dim = v.toInt();
    if (name == "keepdim" && v.isBool()) {
      keepdim = v.toBool();
      has_keepdim = true;
    }
  }
  if (!dim) {  // argmax over everything: one index into the flattened input
    s.n = self.numel();
    s.kept = false;
    return s;
  }
  s.dim = c10::maybe_wrap_dim(*dim, std::max<int64_t>(self.dim(), 1));
  s.n = self.dim() == 0 ? 1 : self.size(s.dim);
  s.kept = !has_keepdim || keepdim;
  return s;
}

}  // namespace

void set_dry_read_hook(std::function<void(const std::string&)> hook) {
  dry_read_hook() = std::move(hook);
}

void dry_read(const std::string& what) {
  if (dry_read_hook()) dry_read_hook()(what);
}

void tracked_composite(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  info_for(op).executed++;
  auto key = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)
                 ? c10::DispatchKey::CompositeExplicitAutogradNonFunctional
                 : c10::DispatchKey::CompositeExplicitAutograd;
  op.callBoxedForDispatchKey(key, *stack);
}

std::atomic<int64_t>& executed_counter(const char* name, const char* overload) {
  return info_for(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload)).executed;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpInfo& info = info_for(op);
  if (info.scalar_list) check_scalar_list(op, *stack);
  const Decision& d = *info.decision.load(std::memory_order_acquire);
  info.executed++;
  if (!info.is_view && g_mapping_on.load(std::memory_order_relaxed)) record_mapping();
  OpScope scope(&info.name);
  if (d.cpu_fallback) on_cpu_fallback(info, d);
  const bool dry = dry_run();
  if (dry && info.base == "aten::_local_scalar_dense") return dry_item(op, stack);
  if (!dry && info.foreach != ForeachKind::None && queue_foreach(op, info.foreach, stack)) {
    return;
  }
  settle();
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  Call call(info, d, schema);
  if (dry) call.real = computes_values(info, schema, *stack, base);
  const int index_at = dry && !call.real ? index_result(info) : -1;
  const IndexSite site = index_at >= 0 ? index_site(schema, *stack, base) : IndexSite{};
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[base + i];
    const bool w = info.write[i];
    if (v.isTensor()) {
      v = call.in(v.toTensor(), i, w);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, call.in(list.get(j), i, w));
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list.get(j);
        if (t.has_value()) list.set(j, call.in(*t, i, w));
      }
    } else if (v.isInt() && schema.arguments()[i].name() == "dtype") {
      call.dtype_given = true;
    } else if (v.isDevice() && v.toDevice().type() == kNeuron) {
      auto d = v.toDevice();
      if (call.index < 0) call.index = d.has_index() ? d.index() : current_device();
      v = c10::IValue(c10::Device(dry && !call.real ? c10::kMeta : c10::kCPU));
    }
  }
  if (call.cpu_arg != SIZE_MAX) {
    auto idx = call.index < 0 ? current_device() : call.index;
    mixed_devices(info, {kNeuron, idx}, call.cpu_seen, schema.arguments()[call.cpu_arg].name(),
                  call.cpu_arg);
  }
  if (call.index < 0) call.index = current_device();
  if (call.downcast_f || call.downcast_i) on_downcast(info, call.downcast_f);
  if (call.downcast_i && !info.wrap_warned.load(std::memory_order_relaxed)) {
    for (size_t i = 0; i < n; ++i) {  // Python ints: Scalars, or 0-dim CPU tensors
      const auto& v = (*stack)[base + i];
      if (v.isInt() && !fits_int32(v.toInt())) warn_wrap(info, v.toInt());
      if (!v.isTensor()) continue;
      const auto& t = v.toTensor();
      if (t.defined() && t.dim() == 0 && t.device().is_cpu() && t.scalar_type() == at::kLong &&
          !fits_int32(*t.const_data_ptr<int64_t>())) {
        warn_wrap(info, *t.const_data_ptr<int64_t>());
      }
    }
  }
  // No generator: the CPU kernel draws from CPU's global one, or the core's own stream once
  // its state was set (generator.cpp). A neuron generator passed in draws its own stream.
  std::optional<Draw> draw;
  if (dry && info.generator_arg >= 0) {
    (*stack)[base + info.generator_arg] = c10::IValue();  // meta kernels draw nothing
  } else if (info.generator_arg >= 0) {
    auto& g = (*stack)[base + info.generator_arg];
    if (g.isNone()) {
      const auto& core = default_generator(call.index);
      if (draws_own_stream(core)) draw.emplace(core);
    } else if (g.toGenerator().device().type() == kNeuron) {
      draw.emplace(g.toGenerator());
    }
    if (draw) g = c10::IValue(draw->generator());
  }
  const auto result_dtype = float_for_half(info, *stack, base);
  if (dry && !call.real) {
    redispatch_dry(op, info, stack, base, call.inputs);
  } else {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  draw.reset();
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t j = 0; j < nret; ++j) {
    auto& r = (*stack)[rbase + j];
    if (r.isTensor()) {
      r = call.out(result_dtype ? r.toTensor().to(*result_dtype) : r.toTensor());
    } else if (r.isTensorList()) {
      auto list = r.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) list.set(k, call.out(list.get(k)));
    }
  }
  if (index_at >= 0 && static_cast<size_t>(index_at) < nret && (*stack)[rbase + index_at].isTensor()) {
    dry_fill_index(info.base, (*stack)[rbase + index_at].toTensor(), site.dim, site.kept, site.n);
  }
  if (d.cpu_fallback) count_host_traffic(info, call, *stack, rbase);
}

// Sparse, quantized and other non-strided tensors: TorchNeuron has no kernels for them.
void unsupported(const std::string& op, const std::string& kind) {
  const bool quantized = kind == "quantized";
  TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": ", kind, " tensors are not supported on neuron, as "
                              "on Trainium. Keep them on CPU, or ",
                              quantized ? "dequantize() them" : "call .to_dense()",
                              " before moving them to neuron.");
}

std::string layout_kind(c10::Layout layout) {
  switch (layout) {
    case c10::kSparse: case c10::kSparseCsr: case c10::kSparseCsc: case c10::kSparseBsr:
    case c10::kSparseBsc:
      return "sparse";
    default: {
      std::ostringstream os;
      os << layout;
      return os.str();
    }
  }
}

void unsupported_fallback(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  unsupported(op.schema().name(), "sparse");
}

void quantized_fallback(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  unsupported(op.schema().name(), "quantized");
}

at::Tensor make_neuron(c10::Storage st, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

void set_policy(bool downcast_64bit, bool strict) {
  g_downcast.store(downcast_64bit);
  g_strict.store(strict);
}

void set_op_placement(const std::map<std::string, std::pair<int, std::string>>& ops,
                      int other_namespaces) {
  std::lock_guard<std::mutex> lock(g_info_mu);
  g_placement.clear();
  for (const auto& [name, d] : ops) g_placement[name] = {static_cast<uint8_t>(d.first), d.second};
  g_other_namespaces = static_cast<uint8_t>(other_namespaces);
  for (auto& [k, info] : g_infos) decide(*info);
}

void set_op_classes(const std::vector<std::string>& exact,
                    const std::vector<std::string>& int_reductions,
                    const std::vector<std::string>& cpu_index) {
  std::lock_guard<std::mutex> lock(g_info_mu);
  g_exact = {exact.begin(), exact.end()};
  g_int_reductions = {int_reductions.begin(), int_reductions.end()};
  g_cpu_index = {cpu_index.begin(), cpu_index.end()};
  for (auto& [k, info] : g_infos) decide(*info);
}

namespace {

// Sums per op name; fallback counters per the op that runs on the host.
std::map<std::string, int64_t> tally(std::atomic<int64_t> OpInfo::*field, bool by_host = false) {
  std::lock_guard<std::mutex> lock(g_info_mu);
  std::map<std::string, int64_t> out;
  for (auto& [k, info] : g_infos) {
    auto v = ((*info).*field).load();
    if (v) out[by_host ? info->decision.load()->host_name : info->name] += v;
  }
  return out;
}

}  // namespace

std::map<std::string, int64_t> executed_ops() { return tally(&OpInfo::executed); }
std::map<std::string, int64_t> fallback_ops() { return tally(&OpInfo::fallback, true); }
std::map<std::string, int64_t> downcast_ops() { return tally(&OpInfo::downcast); }

std::map<std::string, std::pair<int64_t, int64_t>> fallback_bytes() {
  auto to = tally(&OpInfo::to_host, true), from = tally(&OpInfo::from_host, true);
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  for (const auto& [name, n] : fallback_ops()) out[name] = {to[name], from[name]};
  return out;
}

void clear_op_tracking() {
  std::lock_guard<std::mutex> lock(g_info_mu);
  for (auto& [k, info] : g_infos) {
    info->executed = 0;
    info->fallback = 0;
    info->downcast = 0;
    info->to_host = 0;
    info->from_host = 0;
    info->site_tries = 0;
  }
}

void set_fallback_site_hook(std::function<bool(const std::string&)> hook) {
  auto next = hook ? std::make_shared<std::function<bool(const std::string&)>>(std::move(hook))
                   : nullptr;
  std::lock_guard<std::mutex> lock(g_site_mu);
  g_site_hook = std::move(next);
  g_site_on = static_cast<bool>(g_site_hook);
}

}  // namespace neuron
