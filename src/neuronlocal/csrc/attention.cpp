// The attention kernels TorchNeuron registers for neuron: SDPA's overrideable fused entry
// (what `sdpa_kernel([SDPBackend.OVERRIDEABLE])` runs, forward and backward) and
// `_native_multi_head_attention` (nn.MultiheadAttention's inference fast path), with
// TorchNeuron's contract: what they accept, reject and return. They compute with CPU's
// kernels on aliases, so results match CPU's; registration.cpp registers them.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/SDPBackend.h>

#include <cmath>
#include <limits>
#include <mutex>

namespace neuron {
namespace kernels {
namespace {

std::optional<at::Tensor> alias_opt(const std::optional<at::Tensor>& t) {
  if (t && t->defined()) return cpu_alias(*t);
  return std::nullopt;
}

at::Tensor on_core(const at::Tensor& r, c10::DeviceIndex idx) {
  if (!r.defined()) return r;
  return make_neuron(adopt_storage(r.storage(), idx), r);
}

double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// Attention probabilities the math way (for dropout and a bias gradient, which CPU's flash
// kernel does not compute): softmax(q k^T * scale + bias), masked where causal or a bool
// mask excludes, and their logsumexp.
std::pair<at::Tensor, at::Tensor> probabilities(const at::Tensor& q, const at::Tensor& k,
                                                const std::optional<at::Tensor>& bias,
                                                bool is_causal, double scale) {
  auto s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
  const auto inf = -std::numeric_limits<float>::infinity();
  if (is_causal) {
    auto keep = at::ones({q.size(-2), k.size(-2)}, s.options().dtype(at::kBool)).tril_();
    s.masked_fill_(keep.logical_not(), inf);
  }
  if (bias) {
    if (bias->scalar_type() == at::kBool) s.masked_fill_(bias->logical_not(), inf);
    else s.add_(bias->to(at::kFloat));
  }
  auto lse = at::logsumexp(s, -1);
  return {at::softmax(s, -1), lse};
}

// Dropout of the overrideable path: a mask drawn from a generator seeded from CPU's global
// generator (TorchNeuron's kernel draws its mask there too, so the stream continues as on
// CPU); the seed travels as the op's philox seed, so backward draws the same mask.
at::Tensor keep_mask(const at::Tensor& p, double dropout_p, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  return at::empty_like(p).bernoulli_(1.0 - dropout_p, gen).div_(1.0 - dropout_p);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
sdpa_overrideable(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                  bool return_debug_mask, std::optional<double> scale) {
  static auto& executed =
      executed_counter("aten::_scaled_dot_product_fused_attention_overrideable", "");
  executed++;
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "_scaled_dot_product_fused_attention_overrideable: neuron takes 4D query, key and "
              "value (batch, heads, sequence, head_dim); got ", query.dim(), "D, ", key.dim(),
              "D and ", value.dim(), "D.");
  TORCH_CHECK(!return_debug_mask, "_scaled_dot_product_fused_attention_overrideable: neuron "
              "returns no debug attention mask; call it with return_debug_mask=False.");
  const auto idx = query.device().index();
  auto q = cpu_alias(query), k = cpu_alias(key), v = cpu_alias(value);
  auto bias = alias_opt(attn_bias);
  at::Tensor out, lse;
  auto seed = at::zeros({}, q.options().dtype(at::kLong));
  if (dropout_p > 0) {
    auto [p, l] = probabilities(q, k, bias, is_causal, scale_of(q, scale));
    {
      auto* cpu = at::detail::getDefaultCPUGenerator().get<at::CPUGeneratorImpl>();
      std::lock_guard<std::mutex> lock(cpu->mutex_);
      seed.fill_(static_cast<int64_t>(cpu->random64() >> 1));
    }
    out = at::matmul(p.mul_(keep_mask(p, dropout_p, seed.item<int64_t>())), v.to(at::kFloat))
              .to(q.scalar_type());
    lse = l;
  } else {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, bias, scale);
  }
  auto none = at::Tensor();
  return {on_core(out, idx), on_core(lse, idx), none, none, c10::SymInt(q.size(-2)),
          c10::SymInt(k.size(-2)), on_core(seed, idx), on_core(at::zeros_like(seed), idx), none};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_overrideable_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& /*cum_seq_q*/,
    const at::Tensor& /*cum_seq_k*/, int64_t /*max_q*/, int64_t /*max_k*/, double dropout_p,
    bool is_causal, const at::Tensor& philox_seed, const at::Tensor& /*philox_offset*/,
    std::optional<double> scale) {
  static auto& executed =
      executed_counter("aten::_scaled_dot_product_fused_attention_overrideable_backward", "");
  executed++;
  const auto idx = query.device().index();
  auto q = cpu_alias(query), k = cpu_alias(key), v = cpu_alias(value), go = cpu_alias(grad_out);
  std::optional<at::Tensor> bias;
  if (attn_bias.defined()) bias = cpu_alias(attn_bias);
  const bool bias_grad = bias && grad_input_mask[3] && bias->is_floating_point();
  if (dropout_p == 0 && !bias_grad) {
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        go, q, k, v, cpu_alias(out), cpu_alias(logsumexp), 0.0, is_causal, bias, scale);
    return {on_core(gq, idx), on_core(gk, idx), on_core(gv, idx), at::Tensor()};
  }
  // The math way: dS = P * (dP - rowsum(dP * P)), with P the (dropped) probabilities.
  const double s = scale_of(q, scale);
  auto [p, lse] = probabilities(q, k, bias, is_causal, s);
  auto pd = p;
  auto dof = go.to(at::kFloat), vf = v.to(at::kFloat);
  at::Tensor dp = at::matmul(dof, vf.transpose(-2, -1));
  if (dropout_p > 0) {
    auto m = keep_mask(p, dropout_p, cpu_alias(philox_seed).item<int64_t>());
    pd = p * m;
    dp.mul_(m);
  }
  auto ds = p * (dp - (dp * p).sum(-1, true));
  auto gq = at::matmul(ds, k.to(at::kFloat)).mul_(s).to(q.scalar_type());
  auto gk = at::matmul(ds.transpose(-2, -1), q.to(at::kFloat)).mul_(s).to(k.scalar_type());
  auto gv = at::matmul(pd.transpose(-2, -1), dof).to(v.scalar_type());
  at::Tensor gb;
  if (bias_grad) gb = ds.sum_to_size(bias->sizes()).to(bias->scalar_type());
  return {on_core(gq, idx), on_core(gk, idx), on_core(gv, idx), on_core(gb, idx)};
}

// TorchNeuron's `_native_multi_head_attention`: no mask tensor (mask_type 1 without one is
// causal), no attention weights; the weights it returns are an empty tensor.
std::tuple<at::Tensor, at::Tensor> native_multi_head_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t embed_dim,
    int64_t num_head, const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
    const at::Tensor& proj_weight, const at::Tensor& proj_bias,
    const std::optional<at::Tensor>& mask, bool need_weights, bool average_attn_weights,
    std::optional<int64_t> mask_type) {
  static auto& executed = executed_counter("aten::_native_multi_head_attention", "");
  executed++;
  TORCH_CHECK_VALUE(embed_dim % num_head == 0, "embed_dim (", embed_dim,
                    ") must be divisible by num_head (", num_head, ")");
  TORCH_CHECK_NOT_IMPLEMENTED(!(mask && mask->defined()),
                              "Arbitrary mask tensors not yet supported in Neuron implementation. "
                              "Please use mask_type=1 for causal masking or mask=None.");
  TORCH_CHECK_NOT_IMPLEMENTED(!(need_weights && !average_attn_weights),
                              "Returning per-head attention weights not yet supported in Neuron "
                              "implementation. Please use average_attn_weights=True or "
                              "need_weights=False.");
  TORCH_CHECK_NOT_IMPLEMENTED(!need_weights,
                              "Returning attention weights (need_weights=True) is not yet "
                              "supported in Neuron implementation. Please use need_weights=False.");
  const auto idx = query.device().index();
  std::optional<at::Tensor> causal;
  std::optional<int64_t> type;
  if (mask_type && *mask_type == 1) {
    const auto n = query.size(1);
    causal = at::ones({n, n}, qkv_weight.options().device(c10::kCPU).dtype(at::kBool)).triu_(1);
    type = 0;
  }
  auto [out, weights] = at::_native_multi_head_attention(
      cpu_alias(query), cpu_alias(key), cpu_alias(value), embed_dim, num_head,
      cpu_alias(qkv_weight), cpu_alias(qkv_bias), cpu_alias(proj_weight), cpu_alias(proj_bias),
      causal, false, true, type);
  return {on_core(out, idx), at::empty({0}, query.options())};
}

// TorchNeuron picks the overrideable fused kernel for 4D neuron inputs. neuronlocal keeps
// CPU's choice (its flash kernel, or math) while one of CPU's backends is enabled, so results
// match CPU's (nullopt); with those disabled (`sdpa_kernel([SDPBackend.OVERRIDEABLE])`) it
// picks the overrideable kernel, as TorchNeuron does, for 4D inputs of one head count, else
// math (TorchNeuron's choice for other inputs).
std::optional<int64_t> overrideable_choice(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v) {
  const auto& ctx = at::globalContext();
  if (ctx.userEnabledFlashSDP() || ctx.userEnabledMathSDP() ||
      !ctx.userEnabledOverrideableSDP()) {
    return std::nullopt;
  }
  const bool fits =
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.sym_size(1) == k.sym_size(1);
  return static_cast<int64_t>(fits ? at::SDPBackend::overrideable : at::SDPBackend::math);
}

}  // namespace kernels
}  // namespace neuron
