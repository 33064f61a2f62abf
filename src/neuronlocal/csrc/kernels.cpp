// The few ATen kernels neuron implements itself rather than through the boxed fallback
// (fallback.cpp): allocation, views and resizing on neuron storage, copies between devices,
// dropout drawing its mask from CPU's global generator (as TorchNeuron's does), convolution through CPU's overrideable entry,
// and the choice of SDPA kernel. registration.cpp registers them.
#include "dry.h"

#include <ATen/native/Resize.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>

#include <unordered_map>

namespace neuron {
namespace kernels {
namespace {

struct IndexGuard {
  c10::DeviceIndex old;
  explicit IndexGuard(std::optional<c10::Device> d) : old(current_device()) {
    if (d && d->has_index()) set_current_device(d->index());
  }
  ~IndexGuard() {  // never throws: restores only what the constructor changed
    if (current_device() != old) set_current_device(old);
  }
};

at::Tensor to_neuron_like(const at::Tensor& r, c10::DeviceIndex idx) {
  if (!r.defined()) return r;
  if (r.is_meta()) return make_neuron(dry_storage(static_cast<int64_t>(r.storage().nbytes()), idx), r);
  return make_neuron(adopt_storage(r.storage(), idx), r);
}

// What a kernel computes on: the CPU alias, or in a dry run a meta tensor of the same shape.
at::Tensor operand(const at::Tensor& t) {
  if (!dry_run()) return cpu_alias(t);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

// Set while `_to_copy` runs: moving a tensor to another core is TorchNeuron's `.to()`, and
// only its own copy_ may cross cores.
thread_local bool t_moving = false;

void check_neuron_source(bool on_neuron, const char* what, const c10::Device& device) {
  TORCH_CHECK(on_neuron, "set_: expected neuron ", what, ", but got ", what, " on device ",
              device, ". Move it to neuron first (.to('neuron')).");
}

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

// A fresh allocation holds values in a dry run (undefined ones, as in a real run): what
// fills it decides what it holds (dry_values.cpp).
at::Tensor born(at::Tensor t) {
  if (dry_run()) dry_mark(t, true);
  return t;
}

}  // namespace

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> /*pin*/, std::optional<at::MemoryFormat> mf) {
  static auto& executed = executed_counter("aten::empty", "memory_format");
  executed++;
  if (layout && *layout != at::kStrided) unsupported("aten::empty", layout_kind(*layout));
  if (dtype && c10::isQIntType(*dtype)) unsupported("aten::empty", "quantized");
  settle();  // queued ops may hold the last reference to memory: free it before allocating
  IndexGuard g(device);
  return born(at::detail::empty_generic(size, allocator(),
                                        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                        c10::dtype_or_default(dtype), mf));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> /*pin*/) {
  static auto& executed = executed_counter("aten::empty_strided", "");
  executed++;
  if (layout && *layout != at::kStrided) unsupported("aten::empty_strided", layout_kind(*layout));
  if (dtype && c10::isQIntType(*dtype)) unsupported("aten::empty_strided", "quantized");
  settle();
  IndexGuard g(device);
  return born(at::detail::empty_strided_generic(size, stride, allocator(),
                                                c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                c10::dtype_or_default(dtype)));
}

// TorchNeuron's set_ takes only neuron storage (CPU memory cannot back a neuron tensor).
at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  check_neuron_source(source.device_type() == kNeuron, "storage", source.device());
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  check_neuron_source(source.device_type() == kNeuron, "storage", source.device());
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  check_neuron_source(source.device().type() == kNeuron, "source tensor", source.device());
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  IndexGuard g(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, allocator(), true);
  return at::native::set_storage_cpu_(self, st, 0, {0}, {});
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size,
                         std::optional<at::MemoryFormat> mf) {
  static auto& executed = executed_counter("aten::resize_", "");
  executed++;
  settle();
  IndexGuard g(self.device());
  auto* st = self.storage().unsafeGetStorageImpl();
  if (dry_run()) {  // the new shape and, when it grows, fresh data-less bytes (nothing to copy)
    auto* impl = self.unsafeGetTensorImpl();
    impl->set_sizes_contiguous(size);
    if (mf) impl->empty_tensor_restride(*mf);
    const auto need = static_cast<size_t>(
        (self.storage_offset() + self.numel()) * static_cast<int64_t>(self.element_size()));
    if (self.numel() && need > st->nbytes()) {
      st->set_data_ptr_noswap(dry_data(static_cast<int64_t>(need), self.device().index()));
      st->set_nbytes(need);
    }
    return self;
  }
  const void* before = st->data();
  const auto& out = at::native::resize_(self, size, mf);
  if (self.storage().unsafeGetStorageImpl() == st && st->data() != before) follow_resize(st);
  return out;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  // TorchNeuron copies between neuron tensors on one core only; `.to(device)` moves them.
  TORCH_CHECK(t_moving || self.device().type() != kNeuron || dst.device().type() != kNeuron ||
                  self.device().index() == dst.device().index(),
              "Device-to-device copy requires tensors on same Neuron core (copy_ from ",
              self.device(), " into ", dst.device(), "). Move the source first: "
              "dst.copy_(src.to(dst.device)).");
  // A dry run's device memory reads as zeros where no op wrote (ops run meta kernels); a
  // copy onto the device keeps its bytes up to kDryKeepBytes (metadata, counters, seeds that
  // programs read back), and larger ones are dropped.
  // Values (dry_values.cpp): a neuron source's, or an integer host source's (token ids,
  // labels, counts; float host data stands for weights and activations the run lacks).
  const bool from_neuron = self.device().type() == kNeuron;
  const bool values = dry_run() && (from_neuron ? dry_has_values(self)
                                                : !at::isFloatingType(self.scalar_type()) &&
                                                      !at::isComplexType(self.scalar_type()));
  if (dry_run()) {
    const bool to_host = dst.device().type() != kNeuron;
    if (to_host && from_neuron) {
      if (!values) dry_read("copy of a neuron tensor to " + dst.device().str());
    } else if (!to_host && dst.numel() * static_cast<int64_t>(dst.element_size()) >
                               (values && from_neuron ? kDryValueBytes : kDryKeepBytes)) {
      dry_mark(dst, false);
      return dst;
    }
  }
  auto src = from_neuron ? cpu_alias(self) : self;
  auto out = dst.device().type() == kNeuron ? cpu_alias(dst) : dst;
  out.copy_(src);
  if (dry_run() && dst.device().type() == kNeuron) {
    dry_mark(dst, values && (dry_has_values(dst) || covers_storage(dst)));
  }
  return dst;
}

at::Tensor to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                   std::optional<at::Layout> layout, std::optional<at::Device> device,
                   std::optional<bool> pin, bool non_blocking,
                   std::optional<at::MemoryFormat> mf) {
  static auto& executed = executed_counter("aten::_to_copy", "");
  executed++;
  const bool was = t_moving;
  t_moving = true;
  struct Restore {
    bool v;
    ~Restore() { t_moving = v; }
  } restore{was};
  return at::native::_to_copy(self, dtype, layout, device, pin, non_blocking, mf);
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  static auto& executed = executed_counter("aten::_copy_from_and_resize", "");
  executed++;
  // TorchNeuron's contract: from CPU into neuron, and only into an empty or same-size tensor.
  TORCH_CHECK(self.is_cpu() && dst.device().type() == kNeuron,
              "_copy_from_and_resize now only support copy from cpu tensor to neuron tensor, but "
              "got src tensor device is ", self.device(), " and dst device is ", dst.device());
  if (dst.numel() == 0) dst.resize_(self.sizes());
  TORCH_CHECK(self.sizes() == dst.sizes(),
              "_copy_from_and_resize now only support copy with same size, or dst.numel() == 0! "
              "(src ", self.sizes(), ", dst ", dst.sizes(), ")");
  return copy_from(self, dst, false);
}

// TorchNeuron's native_dropout: the keep mask is drawn on CPU from CPU's global generator
// (or the core's own stream once its state was set, as random ops do),
// so seeding and dropping out on neuron drops what CPU drops; nothing is drawn in eval mode
// or for p of 0 or 1, and a p outside [0, 1] is refused in training.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  static auto& executed = executed_counter("aten::native_dropout", "");
  executed++;
  const bool training = !train.has_value() || *train;
  TORCH_CHECK(!training || (p >= 0 && p <= 1),
              "dropout probability has to be between 0 and 1, but got ", p);
  if (dry_run()) {  // shapes only: the output and its mask
    return {at::empty_like(input), at::empty_like(input, input.options().dtype(at::kBool))};
  }
  auto x = cpu_alias(input);
  auto idx = input.device().index();
  at::Tensor out, mask;
  if (input.numel() == 0) {
    out = x.clone();
    mask = at::empty_like(x, x.options().dtype(at::kBool));
  } else if (!training || p == 0) {
    out = x.clone();
    mask = at::ones_like(x, x.options().dtype(at::kBool));
  } else if (p == 1) {
    mask = at::zeros_like(x, x.options().dtype(at::kBool));
    out = x.mul(mask).mul_(0.);
  } else {
    double p1m = 1. - p;
    auto noise = at::empty_like(x, LEGACY_CONTIGUOUS_MEMORY_FORMAT);
    std::optional<Draw> draw;  // CPU's global generator, or the core's own stream
    const at::Generator& core_gen = default_generator(idx);
    if (draws_own_stream(core_gen)) draw.emplace(core_gen);
    noise.bernoulli_(p1m, draw ? std::optional<at::Generator>(draw->generator()) : std::nullopt);
    out = x.mul(noise).mul_(1. / p1m);
    mask = noise.to(at::kBool);
  }
  auto o = make_neuron(adopt_storage(out.storage(), idx), out);
  auto m = make_neuron(adopt_storage(mask.storage(), idx), mask);
  return {o, m};
}

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  std::optional<at::Tensor> b;
  if (bias && bias->defined()) b = operand(*bias);
  auto r = at::convolution(operand(input), operand(weight), b, stride, padding, dilation,
                           transposed, output_padding, groups);
  return to_neuron_like(r, input.device().index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> mask) {
  int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  auto [gi, gw, gb] = at::convolution_backward(
      operand(grad_output), operand(input), operand(weight),
      std::vector<int64_t>{channels}, stride, padding, dilation, transposed, output_padding,
      groups, mask);
  // A gradient the mask leaves out is undefined (None), as TorchNeuron's kernel returns it:
  // CPU's kernel may compute one anyway (the weight's, in 2-D layout, when the bias's is asked).
  auto idx = input.device().index();
  auto kept = [&](const at::Tensor& g, bool wanted) {
    return wanted ? to_neuron_like(g, idx) : at::Tensor();
  };
  return {kept(gi, mask[0]), kept(gw, mask[1]), kept(gb, mask[2])};
}

void record_stream(at::Tensor& /*self*/, c10::Stream /*s*/) {}

// Lets `param.data = neuron_tensor` swap a CPU parameter in place, as for CUDA, so
// Module.to("neuron") keeps Parameter identity and tied weights stay tied.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  static auto& executed = executed_counter("aten::_has_compatible_shallow_copy_type", "");
  executed++;
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
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  if (auto choice = overrideable_choice(q, k, v)) return *choice;
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

}  // namespace kernels
}  // namespace neuron
