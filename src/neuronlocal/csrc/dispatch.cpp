// The eager path: every ATen op on neuron tensors runs ATen's CPU kernel on zero-copy
// CPU aliases of their bytes, and the results are adopted back as neuron tensors.
//
// One boxed fallback covers all ops. Per op it: checks that tensors share one core
// (CUDA's error otherwise), swaps neuron tensors for CPU aliases, injects the core's
// generator into random ops, applies Trainium's 64-bit policy (compute in 32 bits, cast
// back), redispatches to the CPU kernel, then maps each result back: the caller's own
// tensor for in-place/out= results, a view on the input's storage for views, otherwise a
// new neuron storage that owns the CPU result's bytes and counts them against the core.
// Per-op analysis of the schema is done once and cached.
#include "neuron.h"

#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <sstream>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace neuron {
namespace {

bool g_downcast = true;
bool g_strict = false;
// Op placement (policy and data in neuronlocal/eager/ops.py): per op name, the flags and
// the op TorchNeuron runs on the host; ops not listed run on the device.
constexpr uint8_t kHost = 1, kQuiet = 2, kKeep64 = 4;
std::unordered_map<std::string, std::pair<uint8_t, std::string>> g_placement;
uint8_t g_other_namespaces = 0;  // flags of non-aten ops that reach the fallback

struct OpInfo {
  std::string name;           // aten::add.Tensor
  bool is_view = false;       // returns aliases of inputs without writing them
  bool pointwise = false;     // int64 inputs are computed as int32
  bool exact = false;         // data movement: no arithmetic, so no 64-bit downcast
  bool cpu_fallback = false;  // TorchNeuron runs this op on CPU
  bool quiet = false;         // view/metadata op: its fallback is not warned
  std::string host_name;      // the op TorchNeuron runs on CPU (this one, or a piece)
  bool allow_cpu = false;     // CPU index tensors are accepted (as CUDA does)
  int generator_arg = -1;
  ForeachKind foreach = ForeachKind::None;  // queued and fused per tensor (foreach.cpp)
  std::vector<bool> write;    // per argument: mutated by the op
  std::atomic<int64_t> executed{0}, fallback{0}, downcast{0}, to_host{0}, from_host{0};
  std::atomic<bool> warned{false};
  std::atomic<bool> wrap_warned{false};  // an int64 value outside int32 was seen
};

std::mutex g_info_mu;
std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpInfo>> g_infos;

const std::unordered_set<std::string>& exact_ops() {
  static const std::unordered_set<std::string> s = {
      "aten::copy_", "aten::_to_copy", "aten::clone", "aten::fill_", "aten::zero_",
      "aten::index", "aten::index_select", "aten::gather", "aten::cat", "aten::stack",
      "aten::index_put_", "aten::_index_put_impl_", "aten::masked_fill_", "aten::masked_fill",
      "aten::masked_select", "aten::masked_scatter_", "aten::where", "aten::flip", "aten::roll",
      "aten::repeat", "aten::constant_pad_nd", "aten::embedding", "aten::_local_scalar_dense",
      "aten::nonzero", "aten::slice_scatter", "aten::select_scatter", "aten::diagonal_scatter",
      "aten::as_strided_scatter", "aten::tril", "aten::triu", "aten::equal", "aten::unfold",
      "aten::lift_fresh_copy", "aten::scatter", "aten::scatter_", "aten::set_", "aten::resize_",
      "aten::view_as_real", "aten::view_as_complex", "aten::_unsafe_view", "aten::detach",
      "aten::alias", "aten::narrow_copy", "aten::index_fill_", "aten::index_copy_",
      "aten::fill_diagonal_", "aten::random_", "aten::uniform_", "aten::normal_",
      "aten::bernoulli_", "aten::exponential_", "aten::geometric_", "aten::cauchy_",
      "aten::log_normal_", "aten::randperm", "aten::arange", "aten::linspace",
      "aten::_efficientzerotensor", "aten::isnan", "aten::sign", "aten::sort", "aten::topk",
      "aten::argsort", "aten::unique_consecutive", "aten::_unique2", "aten::bucketize",
      "aten::searchsorted", "aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge",
      "aten::max", "aten::min", "aten::amax", "aten::amin", "aten::argmax", "aten::argmin",
      "aten::maximum", "aten::minimum", "aten::abs", "aten::neg", "aten::clamp", "aten::count_nonzero",
      "aten::_pin_memory", "aten::record_stream",
  };
  return s;
}

const std::unordered_set<std::string>& int_reductions() {
  static const std::unordered_set<std::string> s = {
      "aten::sum", "aten::prod", "aten::cumsum", "aten::cumprod", "aten::mean", "aten::mm",
      "aten::bmm", "aten::matmul", "aten::dot", "aten::addmm", "aten::_cumsum", "aten::_cumprod",
  };
  return s;
}

// Host ops compute in 64 bits (TorchNeuron's CPU fallback runs them on CPU as they are).
void apply_placement(OpInfo& info) {
  auto it = g_placement.find(info.name);
  uint8_t flags = it != g_placement.end() ? it->second.first
                  : info.name.rfind("aten::", 0) == 0 ? 0 : g_other_namespaces;
  info.cpu_fallback = flags & kHost;
  info.quiet = flags & kQuiet;
  info.host_name = it != g_placement.end() ? it->second.second : info.name;
  if (flags & kKeep64) info.exact = true;
}

OpInfo& info_for(const c10::OperatorHandle& op) {
  const auto* key = &op.schema();
  std::lock_guard<std::mutex> lock(g_info_mu);
  auto it = g_infos.find(key);
  if (it != g_infos.end()) return *it->second;
  auto info = std::make_unique<OpInfo>();
  const auto& schema = op.schema();
  const std::string& base = schema.name();
  info->name = schema.overload_name().empty() ? base : base + "." + schema.overload_name();
  bool writes = false;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& arg = schema.arguments()[i];
    bool w = arg.alias_info() && arg.alias_info()->isWrite();
    info->write.push_back(w);
    writes |= w;
    auto t = arg.real_type();
    if (auto opt = t->castRaw<c10::OptionalType>()) t = opt->getElementType();
    if (t->kind() == c10::TypeKind::GeneratorType) info->generator_arg = static_cast<int>(i);
  }
  for (const auto& ret : schema.returns()) {
    if (ret.alias_info() && !ret.alias_info()->isWrite() && !writes) info->is_view = true;
  }
  info->pointwise = op.hasTag(at::Tag::pointwise) || int_reductions().count(base);
  info->exact = info->is_view || exact_ops().count(base) > 0;
  apply_placement(*info);
  info->allow_cpu = base.rfind("aten::index", 0) == 0 || base == "aten::_index_put_impl_";
  info->foreach = foreach_kind(op);
  auto& ref = *info;
  g_infos.emplace(key, std::move(info));
  return ref;
}

void release_storage(void* ctx) {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
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

std::string where(const c10::Device& d) {
  return d.type() == kNeuron ? "neuron:" + std::to_string(d.index()) : d.str();
}

// Sparse, quantized and other non-strided tensors: TorchNeuron has no kernels for them.
[[noreturn]] void unsupported(const std::string& op, const std::string& kind) {
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

// Under Trainium's 64-bit rule int64 is computed as int32; a value outside int32 changes.
// Warns once per op (then stops checking): one branch-free pass over contiguous data.
bool fits_int32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

void warn_wrap(OpInfo& info, int64_t value) {
  if (info.wrap_warned.exchange(true)) return;
  TORCH_WARN(info.name, ": the int64 value ", value, " does not fit in int32, and Trainium "
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

[[noreturn]] void mixed_devices(const OpInfo& info, const c10::Device& a, const c10::Device& b,
                                const std::string& arg) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
              "devices, ", where(a), " and ", where(b), "! (argument '", arg, "' of ", info.name,
              "). Move them to one device first, e.g. tensor.to('", where(a), "').");
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
  c10::DeviceIndex index = -1;
  c10::Device cpu_seen{c10::kCPU};
  size_t cpu_arg = SIZE_MAX;  // first non-scalar tensor argument on another device
  bool downcast_f = false, downcast_i = false;
  c10::SmallVector<Input, 8> inputs;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted;

  const c10::FunctionSchema& schema;
  Call(OpInfo& i, const c10::FunctionSchema& s) : info(i), schema(s) {}
  std::string op_arg_name(size_t arg) const { return schema.arguments()[arg].name(); }

  at::Tensor in(const at::Tensor& t, size_t arg, bool write) {
    if (!t.defined()) return t;
    const auto dev = t.device();
    if (dev.type() != kNeuron) {
      if (dev.is_cpu() && (t.dim() == 0 || info.allow_cpu)) return t;
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
    Input x{t, alias_of(t), {}, write};
    x.compute = x.alias;
    if (g_downcast && !info.exact) {
      auto st = t.scalar_type();
      if (st == at::kDouble || st == at::kComplexDouble) {
        x.compute = x.alias.to(st == at::kDouble ? at::kFloat : at::kComplexFloat);
        downcast_f = true;
      } else if (st == at::kLong && info.pointwise) {
        if (!info.wrap_warned.load(std::memory_order_relaxed)) check_int32_range(info, x.alias);
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
    if (ast.data() != nst->data() || ast.nbytes() != nst->nbytes()) {
      nst->set_data_ptr_noswap(adopt_data(ast, x.neuron.device().index()));
      nst->set_nbytes(ast.nbytes());
    }
    if (!n->sizes().equals(a->sizes()) || !n->strides().equals(a->strides()) ||
        n->storage_offset() != a->storage_offset()) {
      n->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
    }
  }

  at::Tensor out(at::Tensor r) {
    if (!r.defined() || !r.device().is_cpu()) return r;
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
    if (r._is_zerotensor()) r = at::zeros(r.sizes(), r.options());
    auto st = r.scalar_type();
    if ((downcast_f && (st == at::kFloat || st == at::kComplexFloat)) ||
        (downcast_i && st == at::kInt)) {
      r = r.to(st == at::kFloat ? at::kDouble : st == at::kInt ? at::kLong : at::kComplexDouble);
    }
    auto idx = index < 0 ? current_device() : index;
    auto nst = adopt_storage(r.storage(), idx);
    adopted.emplace_back(r.storage().unsafeGetStorageImpl(), nst);
    return make_neuron(nst, r);
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

void on_cpu_fallback(OpInfo& info) {
  info.fallback++;
  const std::string via = info.host_name == info.name ? "" : " (reached from " + info.name + ")";
  TORCH_CHECK(!g_strict, info.host_name, via, " has no Trainium kernel: TorchNeuron runs it on "
              "CPU. NEURONLOCAL_STRICT=1 makes CPU fallbacks errors; unset it to allow them, or "
              "avoid this op.");
  if (!info.quiet && !info.warned.exchange(true) && first_warning(info.host_name)) {
    TORCH_WARN(info.host_name, " executed via CPU fallback", via, " (TorchNeuron has no device "
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
  TORCH_CHECK(!(g_strict && is_float), info.name, " got a 64-bit floating point tensor: "
              "Trainium computes float64 as float32. Cast to float32 (tensor.float(), "
              "model.float()) or unset NEURONLOCAL_STRICT.");
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpInfo& info = info_for(op);
  info.executed++;
  if (info.cpu_fallback) on_cpu_fallback(info);
  if (info.foreach != ForeachKind::None && queue_foreach(op, info.foreach, stack)) return;
  settle();
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  Call call(info, schema);
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
    } else if (v.isDevice() && v.toDevice().type() == kNeuron) {
      auto d = v.toDevice();
      if (call.index < 0) call.index = d.has_index() ? d.index() : current_device();
      v = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  if (call.cpu_arg != SIZE_MAX) {
    auto idx = call.index < 0 ? current_device() : call.index;
    mixed_devices(info, {kNeuron, idx}, call.cpu_seen, schema.arguments()[call.cpu_arg].name());
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
  if (info.generator_arg >= 0 && (*stack)[base + info.generator_arg].isNone()) {
    (*stack)[base + info.generator_arg] = c10::IValue(default_generator(call.index));
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t j = 0; j < nret; ++j) {
    auto& r = (*stack)[rbase + j];
    if (r.isTensor()) {
      r = call.out(r.toTensor());
    } else if (r.isTensorList()) {
      auto list = r.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) list.set(k, call.out(list.get(k)));
    }
  }
  if (info.cpu_fallback) count_host_traffic(info, call, *stack, rbase);
}

// ---- explicit kernels -------------------------------------------------------------------

struct IndexGuard {
  c10::DeviceIndex old;
  explicit IndexGuard(std::optional<c10::Device> d) : old(current_device()) {
    if (d && d->has_index()) set_current_device(d->index());
  }
  ~IndexGuard() {  // never throws: restores only what the constructor changed
    if (current_device() != old) set_current_device(old);
  }
};

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> /*pin*/, std::optional<at::MemoryFormat> mf) {
  if (layout && *layout != at::kStrided) unsupported("aten::empty", layout_kind(*layout));
  if (dtype && c10::isQIntType(*dtype)) unsupported("aten::empty", "quantized");
  settle();  // queued ops may hold the last reference to memory: free it before allocating
  IndexGuard g(device);
  return at::detail::empty_generic(size, allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), mf);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> /*pin*/) {
  if (layout && *layout != at::kStrided) unsupported("aten::empty_strided", layout_kind(*layout));
  if (dtype && c10::isQIntType(*dtype)) unsupported("aten::empty_strided", "quantized");
  settle();
  IndexGuard g(device);
  return at::detail::empty_strided_generic(size, stride, allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor& set_empty(at::Tensor& self) {
  IndexGuard g(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, allocator(), true);
  return at::native::set_storage_cpu_(self, st, 0, {0}, {});
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<at::MemoryFormat> mf) {
  settle();
  IndexGuard g(self.device());
  return at::native::resize_(self, size, mf);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  auto src = self.device().type() == kNeuron ? cpu_alias(self) : self;
  auto out = dst.device().type() == kNeuron ? cpu_alias(dst) : dst;
  out.copy_(src);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (!dst.sizes().equals(self.sizes())) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// Mirrors ATen's CPU native_dropout, drawing the mask from the core's generator.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  auto x = cpu_alias(input);
  auto idx = input.device().index();
  at::Tensor out, mask;
  if (input.numel() == 0) {
    out = x.clone();
    mask = at::empty_like(x, x.options().dtype(at::kBool));
  } else if (train.has_value() && !*train) {
    out = x.clone();
    mask = at::ones_like(x, x.options().dtype(at::kBool));
  } else {
    double p1m = 1. - p;
    double scale = p1m == 0 ? 0. : 1. / p1m;
    auto noise = at::empty_like(x, LEGACY_CONTIGUOUS_MEMORY_FORMAT);
    noise.bernoulli_(p1m, default_generator(idx));
    out = x.mul(noise).mul_(scale);
    mask = noise.to(at::kBool);
  }
  auto o = make_neuron(adopt_storage(out.storage(), idx), out);
  auto m = make_neuron(adopt_storage(mask.storage(), idx), mask);
  return {o, m};
}

at::Tensor to_neuron_like(const at::Tensor& r, c10::DeviceIndex idx) {
  if (!r.defined()) return r;
  return make_neuron(adopt_storage(r.storage(), idx), r);
}

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) b = cpu_alias(*bias);
  auto r = at::convolution(cpu_alias(input), cpu_alias(weight), b, stride, padding, dilation,
                           transposed, output_padding, groups);
  return to_neuron_like(r, input.device().index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask) {
  int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  auto [gi, gw, gb] = at::convolution_backward(
      cpu_alias(grad_output), cpu_alias(input), cpu_alias(weight),
      std::vector<int64_t>{channels}, stride, padding, dilation, transposed, output_padding,
      groups, mask);
  auto idx = input.device().index();
  return {to_neuron_like(gi, idx), to_neuron_like(gw, idx), to_neuron_like(gb, idx)};
}

void record_stream(at::Tensor& /*self*/, c10::Stream /*s*/) {}

// Lets `param.data = neuron_tensor` swap a CPU parameter in place, as for CUDA, so
// Module.to("neuron") keeps Parameter identity and tied weights stay tied.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.device().type() == kNeuron || t.device().is_cpu());
  };
  return dense(self) && dense(from);
}

// scaled_dot_product_attention asks a DispatchStub which fused kernel to use; without a
// PrivateUse1 entry it takes the unfused math path, whose numerics differ from CPU's.
// Neuron makes CPU's choice, so SDPA runs CPU's flash kernel, forward and backward,
// through the fallback. The choice reads metadata only (dtype, sizes, strides,
// requires_grad: fused kernels are not differentiable w.r.t. every input), so it is asked
// on data-less CPU stand-ins. Under torch.compile the inputs are fake tensors whose sizes
// can be symbolic (Dynamo's automatic dynamic shapes): a symbolic size becomes a stand-in
// value, equal for equal expressions, without adding a guard, so the traced graph stays
// symbolic and the backend still compiles one static graph per concrete shape.
using SymbolValues = std::unordered_map<std::string, int64_t>;

int64_t stand_in(const c10::SymInt& s, SymbolValues& symbols) {
  if (auto v = s.maybe_as_int()) return *v;
  auto key = s.toSymNodeImplUnowned()->str();
  auto it = symbols.find(key);
  if (it != symbols.end()) return it->second;
  const int64_t v = 64 + 8 * static_cast<int64_t>(symbols.size());
  symbols.emplace(std::move(key), v);
  return v;
}

at::Tensor choice_stand_in(const at::Tensor& t, SymbolValues& symbols) {
  std::vector<int64_t> sizes, strides;
  for (const auto& s : t.sym_sizes()) sizes.push_back(stand_in(s, symbols));
  for (const auto& s : t.sym_strides()) strides.push_back(stand_in(s, symbols));
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, c10::GetCPUAllocator(), false);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(empty), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  if (t.requires_grad()) out.requires_grad_(true);
  return out;
}

int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  // Below the Python modes (FakeTensorMode while tracing): the stand-ins are plain CPU.
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  SymbolValues symbols;
  std::optional<at::Tensor> m;
  if (mask && mask->defined()) m = choice_stand_in(*mask, symbols);
  return at::_fused_sdp_choice(choice_stand_in(q, symbols), choice_stand_in(k, symbols),
                               choice_stand_in(v, symbols), m, dropout_p, is_causal, scale,
                               enable_gqa);
}

std::vector<std::unique_ptr<torch::Library>>& direct_libs() {
  static auto* v = new std::vector<std::unique_ptr<torch::Library>>();
  return *v;
}

}  // namespace

at::Tensor cpu_alias(const at::Tensor& t) {
  settle();
  return alias_of(t);
}

at::Tensor alias_of(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  const auto& st = impl->storage();
  auto* sti = st.unsafeGetStorageImpl();
  c10::raw::intrusive_ptr::incref(sti);
  c10::DataPtr dp(const_cast<void*>(st.data()), sti, &release_storage, c10::Device(c10::kCPU));
  auto cst = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                    st.nbytes(), std::move(dp),
                                                    c10::GetCPUAllocator(), true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(cst)), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

c10::StorageImpl* alias_source(const c10::Storage& cpu) {
  const auto& dp = cpu.data_ptr();
  return dp.get_deleter() == &release_storage ? static_cast<c10::StorageImpl*>(dp.get_context())
                                              : nullptr;
}

void set_policy(bool downcast_64bit, bool strict) {
  g_downcast = downcast_64bit;
  g_strict = strict;
}

void set_op_placement(const std::map<std::string, std::pair<int, std::string>>& ops,
                      int other_namespaces) {
  std::lock_guard<std::mutex> lock(g_info_mu);
  g_placement.clear();
  for (const auto& [name, d] : ops) g_placement[name] = {static_cast<uint8_t>(d.first), d.second};
  g_other_namespaces = static_cast<uint8_t>(other_namespaces);
  for (auto& [k, info] : g_infos) {
    info->exact = info->is_view || exact_ops().count(info->name.substr(0, info->name.find('.')));
    apply_placement(*info);
  }
}

// Sums per op name; fallback counters per the op that runs on the host.
std::map<std::string, int64_t> tally(std::atomic<int64_t> OpInfo::*field, bool by_host = false) {
  std::lock_guard<std::mutex> lock(g_info_mu);
  std::map<std::string, int64_t> out;
  for (auto& [k, info] : g_infos) {
    auto v = ((*info).*field).load();
    if (v) out[by_host ? info->host_name : info->name] += v;
  }
  return out;
}

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
  }
}

void register_direct(const std::vector<std::string>& names) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : names) {
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  direct_libs().push_back(std::move(lib));
}

void register_kernels() {
  static bool done = false;
  if (done) return;
  done = true;
  c10::SetAllocator(kNeuron, allocator());
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  lib->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  lib->impl("empty_strided", TORCH_FN(empty_strided));
  lib->impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  lib->impl("view", TORCH_FN(at::native::view));
  lib->impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  lib->impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_cpu_));
  lib->impl("set_.source_Storage", TORCH_FN(at::native::set_));
  lib->impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  lib->impl("set_", TORCH_FN(set_empty));
  lib->impl("resize_", TORCH_FN(resize));
  lib->impl("_copy_from", TORCH_FN(copy_from));
  lib->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  lib->impl("native_dropout", TORCH_FN(native_dropout));
  lib->impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  lib->impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
  lib->impl("record_stream", TORCH_FN(record_stream));
  lib->impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  // Foreach ops have a composite kernel that loops over the list, one neuron op per tensor
  // (an optimizer step would be hundreds of dispatches); direct, each is one host call of
  // CPU's foreach kernel on aliases, and the elementwise ones can be queued (foreach.cpp).
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
    auto full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    lib->impl(full.c_str() + 6, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  direct_libs().push_back(std::move(lib));
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&fused_sdp_choice);
  auto fb = std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  fb->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  direct_libs().push_back(std::move(fb));
  // Sparse and quantized neuron tensors: one clear error instead of "no kernel for backend".
  for (auto key : {c10::DispatchKey::SparsePrivateUse1, c10::DispatchKey::SparseCsrPrivateUse1,
                   c10::DispatchKey::QuantizedPrivateUse1}) {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "_", key, __FILE__, __LINE__);
    l->fallback(key == c10::DispatchKey::QuantizedPrivateUse1
                    ? torch::CppFunction::makeFromBoxedFunction<&quantized_fallback>()
                    : torch::CppFunction::makeFromBoxedFunction<&unsupported_fallback>());
    direct_libs().push_back(std::move(l));
  }
  // Compressed sparse constructors are composite: they build the tensor without reaching
  // a sparse kernel, so they are stopped at their own names (under both keys they reach).
  for (auto key : {c10::DispatchKey::PrivateUse1, c10::DispatchKey::SparseCsrPrivateUse1}) {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    for (const char* name :
         {"_sparse_compressed_tensor_unsafe", "_sparse_csr_tensor_unsafe",
          "_sparse_csc_tensor_unsafe", "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe",
          "sparse_compressed_tensor.comp_plain_value",
          "sparse_compressed_tensor.comp_plain_value_size", "sparse_csr_tensor.crow_col_value",
          "sparse_csr_tensor.crow_col_value_size", "sparse_csc_tensor.ccol_row_value",
          "sparse_csc_tensor.ccol_row_value_size", "sparse_bsr_tensor.crow_col_value",
          "sparse_bsr_tensor.crow_col_value_size", "sparse_bsc_tensor.ccol_row_value",
          "sparse_bsc_tensor.ccol_row_value_size"}) {
      l->impl(name, torch::CppFunction::makeFromBoxedFunction<&unsupported_fallback>());
    }
    direct_libs().push_back(std::move(l));
  }
  // Break clone -> copy_ -> _copy_from recursion on conjugate/negative views: _copy_from
  // falls through those keys to the PrivateUse1 kernel.
  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    l->impl("_copy_from", torch::CppFunction::makeFallthrough());
    direct_libs().push_back(std::move(l));
  }
}

}  // namespace neuron
