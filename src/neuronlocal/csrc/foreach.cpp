// Runs of foreach ops, fused per tensor (the host's version of Trainium's adaptive eager
// execution, which fuses queued ops into one).
//
// An optimizer step is a run of `_foreach_*` ops, each sweeping every parameter: AdamW
// makes eight sweeps over parameters, gradients and both moments, far more bytes than the
// CPU caches hold, so each sweep streams from memory. Plain CPU PyTorch runs the same
// optimizer as a loop over parameters, one parameter's whole update while it is in cache,
// and is twice as fast. So elementwise foreach ops on neuron are queued, not run: the run
// is executed when anything else happens (any other op, a copy, an alias for compiled code
// or collectives, a memory query, synchronize), index by index, every queued op on tensor
// i before any op on tensor i+1. Each op on each tensor is the CPU foreach kernel on a
// one-element list, so results are bitwise those of running the ops one after the other.
//
// Reordering is only valid when tensors at different indices never share bytes, so an op
// is queued only when that holds for the whole run (else the run is executed first, and an
// op that overlaps itself runs at once), and only for dense 16/32-bit float tensors of one
// shape and dtype per index, outside grad mode, with no lone Tensor arguments: the cases
// whose per-tensor kernels cannot fail or depend on other state. Out-of-place results are
// allocated when the op is called, so memory accounting sees them at the same point.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

namespace neuron {

std::atomic<bool> g_foreach_queued{false};

namespace {

// Byte ranges of the queued run's tensors, by the index they belong to. Addresses, not
// storages: two storages may share bytes (an adopted alias), and bytes are what matter.
class RangeSet {
 public:
  // Whether [begin, end) overlaps a range of another index.
  bool conflicts(uintptr_t begin, uintptr_t end, size_t index) const {
    if (begin == end) return false;
    auto it = ranges_.lower_bound(begin > max_len_ ? begin - max_len_ : 0);
    for (; it != ranges_.end() && it->first < end; ++it) {
      for (const auto& [e, i] : it->second) {
        if (i != index && e > begin) return true;
      }
    }
    return false;
  }
  void add(uintptr_t begin, uintptr_t end, size_t index) {
    if (begin == end) return;
    auto& v = ranges_[begin];
    for (const auto& r : v) {
      if (r.first == end && r.second == index) return;
    }
    v.emplace_back(end, index);
    max_len_ = std::max(max_len_, end - begin);
  }
  void clear() {
    ranges_.clear();
    max_len_ = 0;
  }
  bool empty() const { return ranges_.empty(); }

 private:
  std::map<uintptr_t, std::vector<std::pair<uintptr_t, size_t>>> ranges_;
  uintptr_t max_len_ = 0;
};

// One queued op: its arguments with neuron tensors replaced by CPU aliases taken at call
// time (later set_/data assignments do not redirect it), lists kept whole.
struct Queued {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<at::Tensor> outs;  // out-of-place results: aliases of the returned tensors
  size_t n;
  // Out-of-place ops run as the per-tensor `out=` op writing straight into the result
  // (aten::sqrt.out for _foreach_sqrt), else as the foreach op plus a copy.
  std::optional<c10::OperatorHandle> out_op;
};

std::mutex g_mu;
std::vector<Queued> g_queue;
RangeSet g_ranges;

const std::unordered_set<std::string>& elementwise() {
  static const std::unordered_set<std::string> s = {
      "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1",
      "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
      "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "zero", "add",
      "sub", "mul", "div", "pow", "maximum", "minimum", "clamp_min", "clamp_max", "lerp",
      "addcmul", "addcdiv", "copy",
  };
  return s;
}

bool is_tensor_list(const c10::Argument& a) {
  auto t = a.real_type();
  if (auto l = t->castRaw<c10::ListType>()) return l->getElementType()->kind() == c10::TypeKind::TensorType;
  return false;
}

bool is_scalar_list(const c10::Argument& a) {
  auto t = a.real_type();
  if (auto l = t->castRaw<c10::ListType>()) return l->getElementType()->kind() == c10::TypeKind::NumberType;
  return false;
}

bool mentions_tensor(const c10::Argument& a) {
  auto t = a.real_type();
  if (auto o = t->castRaw<c10::OptionalType>()) t = o->getElementType();
  return t->kind() == c10::TypeKind::TensorType;
}

bool queueable_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

std::pair<uintptr_t, uintptr_t> bytes_of(const at::Tensor& t) {
  auto begin = reinterpret_cast<uintptr_t>(t.storage().data()) +
               static_cast<uintptr_t>(t.storage_offset() * t.element_size());
  return {begin, begin + static_cast<uintptr_t>(t.numel() * t.element_size())};
}

// The tensor lists of a call, if the op may be queued.
struct Args {
  std::vector<std::pair<size_t, std::vector<at::Tensor>>> lists;  // (argument, tensors)
  size_t n = 0;
  c10::DeviceIndex index = -1;
};

bool collect(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base,
             Args& out) {
  const auto& args = schema.arguments();
  for (size_t a = 0; a < args.size(); ++a) {
    if (!is_tensor_list(args[a])) continue;
    std::vector<at::Tensor> ts = stack[base + a].toTensorVector();
    if (out.lists.empty()) out.n = ts.size();
    if (ts.empty() || ts.size() != out.n) return false;
    out.lists.emplace_back(a, std::move(ts));
  }
  if (out.lists.empty()) return false;
  for (size_t a = 0; a < args.size(); ++a) {
    if (is_scalar_list(args[a]) && stack[base + a].toListRef().size() != out.n) return false;
  }
  const auto& first = out.lists.front().second;
  for (size_t i = 0; i < out.n; ++i) {
    const auto& ref = first[i];
    for (const auto& [a, ts] : out.lists) {
      const auto& t = ts[i];
      if (!t.defined() || t.device().type() != kNeuron || t.layout() != at::kStrided) return false;
      if (out.index < 0) out.index = t.device().index();
      if (t.device().index() != out.index || !queueable_dtype(t.scalar_type()) ||
          t.scalar_type() != ref.scalar_type() || !t.sizes().equals(ref.sizes()) ||
          !t.strides().equals(ref.strides()) || !t.is_non_overlapping_and_dense()) {
        return false;
      }
    }
  }
  return true;
}

// Whether the call's tensors keep to their own index, among themselves and against `queued`.
bool index_disjoint(const Args& args, const RangeSet& queued) {
  RangeSet mine;
  for (const auto& [a, ts] : args.lists) {
    for (size_t i = 0; i < ts.size(); ++i) {
      auto [b, e] = bytes_of(ts[i]);
      if (queued.conflicts(b, e, i) || mine.conflicts(b, e, i)) return false;
      mine.add(b, e, i);
    }
  }
  return true;
}

void add_ranges(const std::vector<at::Tensor>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    auto [b, e] = bytes_of(ts[i]);
    g_ranges.add(b, e, i);
  }
}

// The per-tensor out= overload of an out-of-place foreach op: same name without
// `_foreach_`, same arguments with lists as single values, then `out`. Looked up once.
std::optional<c10::OperatorHandle> per_tensor_out(const c10::OperatorHandle& op) {
  static std::unordered_map<const c10::FunctionSchema*, std::optional<c10::OperatorHandle>> memo;
  const auto& schema = op.schema();
  auto it = memo.find(&schema);
  if (it != memo.end()) return it->second;
  std::optional<c10::OperatorHandle> found;
  const std::string name = "aten::" + schema.name().substr(std::string("aten::_foreach_").size());
  const auto& fargs = schema.arguments();
  for (const auto& on : c10::Dispatcher::singleton().getAllOpNames()) {
    if (on.name != name || found) continue;
    auto h = c10::Dispatcher::singleton().findOp(on);
    if (!h || !h->hasTag(at::Tag::out)) continue;
    const auto& args = h->schema().arguments();
    if (args.size() != fargs.size() + 1) continue;
    bool same = true;
    for (size_t a = 0; a < fargs.size() && same; ++a) {
      auto want = fargs[a].real_type();
      if (auto l = want->castRaw<c10::ListType>()) want = l->getElementType();
      same = args[a].real_type()->str() == want->str();
    }
    if (same) found = *h;
  }
  memo.emplace(&schema, found);
  return found;
}

// Runs the queue, index by index. Called with g_mu held.
void run_queue() {
  std::vector<Queued> queue;
  queue.swap(g_queue);
  g_ranges.clear();
  g_foreach_queued.store(false, std::memory_order_release);
  RECORD_FUNCTION("neuron::foreach_run", std::vector<c10::IValue>());
  size_t n = 0;
  for (const auto& q : queue) n = std::max(n, q.n);
  const auto cpu = c10::DispatchKeySet(c10::DispatchKey::CPU);
  for (size_t i = 0; i < n; ++i) {
    for (auto& q : queue) {
      if (i >= q.n) continue;
      const auto& args = q.op.schema().arguments();
      const bool direct = q.out_op.has_value();
      torch::jit::Stack stack;
      stack.reserve(args.size() + 1);
      for (size_t a = 0; a < args.size(); ++a) {
        auto& v = q.args[a];
        if (is_tensor_list(args[a])) {
          if (direct) {
            stack.emplace_back(v.toTensorList().get(i));
            continue;
          }
          c10::List<at::Tensor> one;
          one.push_back(v.toTensorList().get(i));
          stack.emplace_back(std::move(one));
        } else if (is_scalar_list(args[a])) {
          if (direct) {
            stack.push_back(v.toListRef()[i]);
            continue;
          }
          c10::impl::GenericList one(c10::NumberType::get());
          one.push_back(v.toListRef()[i]);
          stack.emplace_back(std::move(one));
        } else {
          stack.push_back(v);
        }
      }
      if (direct) {
        stack.emplace_back(q.outs[i]);
        q.out_op->redispatchBoxed(cpu, &stack);
      } else {
        q.op.redispatchBoxed(cpu, &stack);
        if (!q.outs.empty()) q.outs[i].copy_(stack.back().toTensorList().get(0));
      }
    }
    // Release index i now, so tensors the caller already dropped free as the run goes.
    for (auto& q : queue) {
      if (i >= q.n) continue;
      for (auto& v : q.args) {
        if (v.isTensorList()) {
          auto l = v.toTensorList();
          l.set(i, at::Tensor());
        }
      }
      if (!q.outs.empty()) q.outs[i] = at::Tensor();
    }
  }
}

at::Tensor empty_on(const at::Tensor& like, c10::DeviceIndex index) {
  auto prev = current_device();
  set_current_device(index);
  at::Tensor t;
  try {
    t = at::detail::empty_strided_generic(like.sizes(), like.strides(), allocator(),
                                          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                          like.scalar_type());
  } catch (...) {
    set_current_device(prev);
    throw;
  }
  set_current_device(prev);
  return t;
}

}  // namespace

ForeachKind foreach_kind(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  const std::string prefix = "aten::_foreach_";
  if (name.rfind(prefix, 0) != 0 || op.hasTag(at::Tag::out)) return ForeachKind::None;
  std::string base = name.substr(prefix.size());
  const bool inplace = !base.empty() && base.back() == '_';
  if (inplace) base.pop_back();
  if (!elementwise().count(base)) return ForeachKind::None;
  bool lists = false;
  for (const auto& a : schema.arguments()) {
    if (is_tensor_list(a)) lists = true;
    else if (mentions_tensor(a)) return ForeachKind::None;
  }
  if (!lists) return ForeachKind::None;
  const auto& rets = schema.returns();
  if (inplace && rets.empty()) return ForeachKind::InPlace;
  if (!inplace && rets.size() == 1 && is_tensor_list(rets[0])) return ForeachKind::OutOfPlace;
  return ForeachKind::None;
}

bool checks_scalar_list(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::_foreach_add", "aten::_foreach_add_", "aten::_foreach_sub", "aten::_foreach_sub_",
      "aten::_foreach_mul", "aten::_foreach_mul_", "aten::_foreach_div", "aten::_foreach_div_"};
  const auto& schema = op.schema();
  return names.count(schema.name()) && schema.overload_name().rfind("ScalarList", 0) == 0;
}

void check_scalar_list(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t base = stack.size() - op.schema().arguments().size();
  const auto& tensors = stack[base];
  const auto& scalars = stack[base + 1];
  if (!tensors.isList() || !scalars.isList()) return;
  TORCH_CHECK_VALUE(tensors.toListRef().size() == scalars.toListRef().size(),
                    "Tensor list must have same number of elements as scalar list (got ",
                    tensors.toListRef().size(), " tensors and ", scalars.toListRef().size(),
                    " scalars); pass one scalar per tensor");
}

bool queue_foreach(const c10::OperatorHandle& op, ForeachKind kind, torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) return false;
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  Args args;
  if (!collect(schema, *stack, base, args)) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!index_disjoint(args, g_ranges)) {
    if (g_queue.empty() || !index_disjoint(args, RangeSet())) return false;
    run_queue();
  }
  Queued q{op, {}, {}, args.n, std::nullopt};
  if (kind == ForeachKind::OutOfPlace) q.out_op = per_tensor_out(op);
  q.args.reserve(nargs);
  size_t next = 0;
  for (size_t a = 0; a < nargs; ++a) {
    if (next < args.lists.size() && args.lists[next].first == a) {
      c10::List<at::Tensor> aliases;
      aliases.reserve(args.n);
      for (const auto& t : args.lists[next].second) aliases.push_back(alias_of(t));
      q.args.emplace_back(std::move(aliases));
      ++next;
    } else {
      q.args.push_back((*stack)[base + a]);
    }
  }
  torch::jit::drop(*stack, nargs);
  if (kind == ForeachKind::OutOfPlace) {
    std::vector<at::Tensor> results;
    results.reserve(args.n);
    q.outs.reserve(args.n);
    for (const auto& t : args.lists.front().second) {
      results.push_back(empty_on(t, args.index));
      q.outs.push_back(alias_of(results.back()));
    }
    add_ranges(results);
    stack->emplace_back(c10::List<at::Tensor>(results));
  }
  for (const auto& [a, ts] : args.lists) add_ranges(ts);
  g_queue.push_back(std::move(q));
  g_foreach_queued.store(true, std::memory_order_release);
  return true;
}

void run_queued_foreach() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_queue.empty()) run_queue();
}

}  // namespace neuron
