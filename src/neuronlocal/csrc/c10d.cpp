// The `neuron` c10d backend: every collective runs on gloo, over zero-copy CPU aliases.
//
// TorchNeuron registers a process-group backend named `neuron`. Device memory is host
// memory here, so each collective hands an inner ProcessGroupGloo (built in Python from the
// group's store, rank, size and timeout) the CPU alias of every neuron tensor, and gloo
// writes the result straight into the neuron tensor's bytes. The backend is a C++
// c10d::Backend that Python registers in a stock c10d::ProcessGroup for devices `neuron` and
// `cpu`, so the group is an ordinary ProcessGroup: Dynamo traces it (compiled DDP, FSDP2,
// TP), DDP's reducer and functional collectives reach it through c10d's dispatcher ops
// without the GIL, and CPU tensors (what compiled graphs pass) take the same path.
//
// On top of gloo it keeps the backend's contract: errors naming the collective, rank and
// timeout; all_to_all with even splits only (as TorchNeuron); all_gather_into_tensor and
// reduce_scatter_tensor on flat buffers (element counts only, as NCCL); an optional
// cross-rank check of shapes and dtypes; one report record per collective; every reduce op
// NCCL has, PREMUL_SUM included (reduce_op.cpp; reduce, as gloo's, may leave partial sums in
// non-root ranks' tensors).
//
// In a dry run (no inner gloo) the group stands for all its ranks from this one process:
// every collective completes at once, recorded as in a real run, with uniform-rank
// semantics (every rank holds this rank's data). Neuron tensors hold no bytes, so only CPU
// tensors (object collectives) get data: gathers copy this rank's input to every slot. Neuron
// tensors that hold values (index math: dry_values.cpp) get the uniform-rank result too: the
// gathers', all_reduce's (SUM is this rank's times the group size; AVG, MAX, MIN leave it)
// and all_to_all_single's (every rank sends this rank's chunk for it); any other collective's
// result holds none.
#include "collective_args.h"
#include "dry.h"
#include "neuron.h"
#include "reduce_op.h"

#include <ATen/ThreadLocalPythonObjects.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <mutex>
#include <sstream>

namespace neuron {
namespace {

using c10d::OpType;
using c10d::Work;
using Future = c10::ivalue::Future;
using WorkPtr = c10::intrusive_ptr<Work>;

// Set by a dry-run collective that decided which of its results hold values (see the top).
thread_local bool t_dry_kept = false;

// Python hooks, set once by neuronlocal.distributed and never released: they must outlive
// every group, and a decref after interpreter shutdown would crash.
py::object* g_record = nullptr;       // record_collective(op, nbytes, rank, group_size, link)
PyObject* g_error_class = nullptr;    // NeuronCollectiveError

// A collective failed in gloo (peer died, timeout, mismatched sizes). Python sees it as
// neuronlocal.distributed.NeuronCollectiveError, a torch.distributed.DistBackendError.
class CollectiveError : public c10::DistBackendError {
 public:
  explicit CollectiveError(const std::string& msg) : c10::DistBackendError({__func__, __FILE__, __LINE__}, msg) {}
};

struct Where {
  int rank;
  int size;
  std::string timeout;
};

std::string strip(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

CollectiveError failure(const Where& w, const char* what, const std::string& cause) {
  std::ostringstream os;
  os << "neuron backend: " << what << " failed on rank " << w.rank << " of " << w.size
     << " (timeout " << w.timeout << "). A peer rank may have died or stopped calling "
     << "collectives, or the ranks passed tensors of different shapes or dtypes (run with "
     << "NEURONLOCAL_DIST_CHECKS=1 to have that checked before every collective). gloo said: "
     << cause;
  return CollectiveError(os.str());
}

// Rethrows `e` as a CollectiveError (unchanged when it already is one).
[[noreturn]] void rethrow(std::exception_ptr e, const Where& w, const char* what) {
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& ex) {
    throw failure(w, what, strip(ex));
  }
}

// ---- the one failure gloo cannot report -------------------------------------------------------
// When ranks pass tensors of different sizes, gloo's I/O thread throws where nothing can
// catch it and the process aborts with a bare SIGABRT. A full cross-rank check before every
// collective (NEURONLOCAL_DIST_CHECKS=1) turns that into a ValueError but costs one more
// small collective per call, so by default this terminate handler says what happened, on
// which rank and in which collective, names the fix, and exits with status 1.
std::atomic<const char*> g_last_what{nullptr};
std::atomic<int64_t> g_last_numel{0};
std::atomic<int> g_last_dtype{0};
std::atomic<int> g_rank{-1};
std::terminate_handler g_previous_terminate = nullptr;

void on_terminate() {
  std::string cause;
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      cause = ex.what();
    } catch (...) {
    }
  }
  const char* what = g_last_what.load();
  if (what != nullptr && cause.find("gloo") != std::string::npos) {
    bool sizes = cause.find("size doesn't match") != std::string::npos;
    auto dtype = static_cast<c10::ScalarType>(g_last_dtype.load());
    std::fprintf(stderr,
                 "neuron backend: rank %d: %s (the last collective issued here was %s of %lld "
                 "%s elements). gloo cannot recover, so the process exits. Every rank must pass "
                 "tensors of the same shape and dtype to the same collective, in the same "
                 "order; NEURONLOCAL_DIST_CHECKS=1 checks that before every collective and "
                 "raises a ValueError listing each rank's shapes. gloo said: %s\n",
                 g_rank.load(),
                 sizes ? "the ranks passed tensors of different sizes to a collective"
                       : "a collective failed inside gloo's I/O thread",
                 what, static_cast<long long>(g_last_numel.load()),
                 std::string(c10::getDtypeNames(dtype).first).c_str(), cause.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

void install_terminate_guard(int rank) {
  static std::once_flag once;
  g_rank = rank;
  std::call_once(once, [] { g_previous_terminate = std::set_terminate(&on_terminate); });
}

// gloo's works capture the caller's thread-local state and are released on gloo's threads.
// Python objects in it (torch's backward stashes a contextvars.Context there) would then be
// decref'd off the main thread, which aborts the process if the interpreter is finalizing.
// Collectives never need them, so gloo is called with that part of the state empty.
struct NoPythonObjects {
  at::impl::ThreadLocalPythonObjects saved = at::impl::ThreadLocalPythonObjects::get_state();
  NoPythonObjects() { at::impl::ThreadLocalPythonObjects::set_state({}); }
  ~NoPythonObjects() { at::impl::ThreadLocalPythonObjects::set_state(std::move(saved)); }
  NoPythonObjects(const NoPythonObjects&) = delete;
  NoPythonObjects& operator=(const NoPythonObjects&) = delete;
};

// A collective's tensor as gloo takes it. CPU tensors are TorchNeuron's error (its collectives
// take device tensors only), except while compiled code runs: a compiled graph runs on CPU
// aliases of its neuron inputs (host_core() is set then) and its collectives pass those.
at::Tensor host(const at::Tensor& t) {
  if (t.device().type() == kNeuron) return cpu_alias(t);
  TORCH_CHECK_VALUE(t.device().is_cpu() && host_core() >= 0, "neuron backend: Expected neuron "
                    "device, got ", t.device().type(), ": collectives of the neuron process "
                    "group take neuron tensors. Move the tensor first (t.to(\"neuron\")).");
  return t;
}

std::vector<at::Tensor> hosts(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host(t));
  return out;
}

std::vector<std::vector<at::Tensor>> hosts(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(ts.size());
  for (const auto& l : ts) out.push_back(hosts(l));
  return out;
}

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& l : ts) out.insert(out.end(), l.begin(), l.end());
  return out;
}

// `big` (size copies of `small` along dim 0, NCCL only checks element counts) as the alias
// gloo wants: dim-0 chunks shaped like `small`. A contiguous flat buffer is only re-viewed.
at::Tensor stacked(const at::Tensor& big, const at::Tensor& small, int size, const char* what,
                   bool gather) {
  const char* b = gather ? "output" : "input";
  const char* s = gather ? "input" : "output";
  TORCH_CHECK_VALUE(big.numel() == small.numel() * size, "neuron backend: ", what, " needs ", b,
                    ".numel() == world_size * ", s, ".numel(), got ", big.numel(), " and ",
                    small.numel(), " with world size ", size, ". Size the ", b, " as world_size x ",
                    s, ".");
  TORCH_CHECK_TYPE(big.scalar_type() == small.scalar_type(), "neuron backend: ", what,
                   " needs one dtype for input and output, got ", small.scalar_type(), " and ",
                   big.scalar_type(), ". Cast one of them.");
  auto a = host(big);
  if (!a.is_contiguous()) return a;
  std::vector<int64_t> shape = small.sizes().vec();
  if (shape.empty()) shape.push_back(size);
  else shape[0] *= size;
  return a.view(shape);
}

int64_t nbytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

// Runs `f` with the GIL released if this thread holds it: for waits on gloo's threads, which
// may need the GIL to free what they hold.
template <class F>
void without_gil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    f();
  } else {
    f();
  }
}

struct Unfinished {  // what a work dropped unfinished at exit holds (see ~NeuronWork)
  std::vector<WorkPtr> inner;
  std::vector<at::Tensor> result;
  c10::intrusive_ptr<Future> future;
};

// One gloo collective (or several, for coalesced calls) seen as one neuron collective:
// failures become CollectiveErrors, and the future yields the caller's (neuron) tensors.
class NeuronWork : public Work {
 public:
  NeuronWork(std::vector<WorkPtr> inner, std::vector<at::Tensor> result,
             std::shared_ptr<const Where> where, const char* what, OpType type, uint64_t seq)
      : Work(where->rank, type), inner_(std::move(inner)), result_(std::move(result)),
        where_(std::move(where)), what_(what), seq_(seq) {}

  // Gloo's threads finish a work by completing its future, and then drop their references
  // to it. Should those be the last ones, they free tensors that Python sees, which takes
  // the GIL: an abort if the interpreter is finalizing. A work dropped unfinished once exit
  // has begun (an unwaited isend may never finish) therefore leaves what it holds allocated.
  ~NeuronWork() override {
    if (python_calls_closed() && !isCompleted()) {
      (void)new Unfinished{std::move(inner_), std::move(result_), std::move(future_)};
    }
  }
  NeuronWork(const NeuronWork&) = delete;
  NeuronWork& operator=(const NeuronWork&) = delete;

  // The group's collective count when this one was issued: 0, 1, 2, ... per group.
  uint64_t getSequencenumber() const override { return seq_; }

  bool isCompleted() override {
    for (auto& w : inner_) if (!w->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : inner_) if (!w->isSuccess()) return false;
    return true;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : inner_) {
      if (auto e = w->exception()) {
        try {
          rethrow(e, *where_, what_);
        } catch (...) {
          return std::current_exception();
        }
      }
    }
    return nullptr;
  }
  int sourceRank() const override { return inner_.size() == 1 ? inner_[0]->sourceRank() : -1; }
  std::vector<at::Tensor> result() override {
    wait(kNoTimeout);
    return result_;
  }
  void synchronize() override { wait(kNoTimeout); }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : inner_) {
      try {
        w->wait(timeout);
      } catch (...) {
        rethrow(std::current_exception(), *where_, what_);
      }
    }
    return true;
  }
  void abort() override {
    for (auto& w : inner_) w->abort();
  }
  c10::intrusive_ptr<Future> getFuture() override {
    std::lock_guard<std::mutex> lock(future_mu_);
    if (future_) return future_;
    auto type = c10::ListType::ofTensors();
    if (inner_.empty()) {
      future_ = c10::make_intrusive<Future>(type);
      future_->markCompleted(c10::IValue(result_));
      return future_;
    }
    c10::intrusive_ptr<Future> src;
    if (inner_.size() == 1) {
      src = inner_[0]->getFuture();
    } else {
      c10::List<c10::intrusive_ptr<Future>> all(c10::FutureType::create(c10::AnyType::get()));
      for (auto& w : inner_) all.push_back(w->getFuture());
      src = c10::collectAll(all);
    }
    future_ = src->then(
        [result = result_, where = where_, what = what_](Future& parent) -> c10::IValue {
          if (parent.hasError()) rethrow(parent.exception_ptr(), *where, what);
          return c10::IValue(result);
        },
        type);
    return future_;
  }

 private:
  std::vector<WorkPtr> inner_;
  std::vector<at::Tensor> result_;
  std::shared_ptr<const Where> where_;
  const char* what_;
  uint64_t seq_;
  std::mutex future_mu_;
  c10::intrusive_ptr<Future> future_;
};

// ---- cross-rank check of collective inputs -------------------------------------------------
// gloo trusts every rank to pass matching buffers: a size mismatch aborts the process from
// gloo's I/O thread and a dtype mismatch of equal item size silently mixes bytes. The check
// all-gathers a small fingerprint of each call first and fails on every rank alike.
constexpr int kMaxTensors = 4;
constexpr int kMaxDims = 8;
constexpr int kWidth = 3 + kMaxTensors * (2 + kMaxDims);

const std::vector<std::string>& op_names() {
  static const std::vector<std::string> names = {
      "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
      "all_gather_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter",
      "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "broadcast", "reduce",
      "gather", "scatter", "all_to_all_single", "all_to_all"};
  return names;
}

int64_t op_code(const std::string& what) {
  uint32_t h = 2166136261u;  // FNV-1a: the same on every rank
  for (unsigned char c : what) h = (h ^ c) * 16777619u;
  return h;
}

std::vector<int64_t> fingerprint(const char* what, const std::vector<at::Tensor>& ts,
                                 int64_t root) {
  std::vector<int64_t> row = {op_code(what), static_cast<int64_t>(ts.size()), root};
  for (size_t i = 0; i < ts.size() && i < kMaxTensors; ++i) {
    row.push_back(static_cast<int64_t>(ts[i].scalar_type()));
    row.push_back(ts[i].dim());
    for (int d = 0; d < kMaxDims; ++d) row.push_back(d < ts[i].dim() ? ts[i].size(d) : 0);
  }
  row.resize(kWidth, 0);
  return row;
}

std::string describe(const int64_t* row) {
  std::ostringstream os;
  std::string name = "?";
  for (const auto& n : op_names()) if (op_code(n) == row[0]) name = n;
  os << name << ", " << row[1] << " tensor(s)";
  if (row[2] >= 0) os << ", root " << row[2];
  for (int64_t i = 0; i < std::min<int64_t>(row[1], kMaxTensors); ++i) {
    const int64_t* t = row + 3 + i * (2 + kMaxDims);
    auto dtype = static_cast<c10::ScalarType>(t[0]);
    os << ", torch." << c10::getDtypeNames(dtype).first << "[";
    for (int64_t d = 0; d < std::min<int64_t>(t[1], kMaxDims); ++d) os << (d ? ", " : "") << t[2 + d];
    os << "]";
  }
  return os.str();
}

// A timeout as Python's str(timedelta) writes it (H:MM:SS[.ffffff]), as the group was made with.
std::string hms(std::chrono::milliseconds t) {
  auto ms = t.count();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(ms / 3600000),
                static_cast<long long>(ms / 60000 % 60), static_cast<long long>(ms / 1000 % 60));
  std::string out = buf;
  if (ms % 1000) {
    std::snprintf(buf, sizeof(buf), ".%06lld", static_cast<long long>(ms % 1000 * 1000));
    out += buf;
  }
  return out;
}

class NeuronBackend : public c10d::Backend {
 public:
  // link: the link class of the group's member ranks (core/topology.py), recorded with each
  // collective.
  NeuronBackend(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size, int record_rank,
                std::string timeout, bool checks, std::string link)
      : Backend(rank, size), gloo_(std::move(gloo)),
        where_(std::make_shared<const Where>(Where{rank, size, std::move(timeout)})),
        record_rank_(record_rank), link_(std::move(link)), checks_(checks && gloo_) {
    if (gloo_) install_terminate_guard(record_rank);
  }
  // Destroying gloo joins its threads, which may be waiting for the GIL (see ~NeuronWork).
  ~NeuronBackend() override {
    without_gil([this] { gloo_.reset(); });
  }
  NeuronBackend(const NeuronBackend&) = delete;
  NeuronBackend& operator=(const NeuronBackend&) = delete;

  const std::string getBackendName() const override { return "neuron"; }
  // torch.distributed's _set_pg_timeout (through Backend.set_timeout): gloo's timeout, and
  // the one this backend's errors name.
  void setTimeout(std::chrono::milliseconds timeout) override {
    if (gloo_) gloo_->setTimeout(timeout);
    where_ = std::make_shared<const Where>(Where{where_->rank, where_->size, hms(timeout)});
  }
  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    if (gloo_) gloo_->setGroupUid(uid);
  }
  void setSequenceNumberForGroup() override {
    if (gloo_) gloo_->setSequenceNumberForGroup();
  }
  uint64_t getSequenceNumberForGroup() override {
    return gloo_ ? gloo_->getSequenceNumberForGroup() : seq_.load();
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    if (gloo_) return gloo_->getBackendOptions();
    return c10::make_intrusive<Options>("neuron");
  }

  // gloo issues each op at once; a coalescing block returns one work over all of them.
  void startCoalescing() override {
    coalescing_ = true;
    coalesced_.clear();
    coalesced_result_.clear();
  }
  WorkPtr endCoalescing() override {
    coalescing_ = false;
    return c10::make_intrusive<NeuronWork>(std::move(coalesced_), std::move(coalesced_result_),
                                           where_, "coalesced collectives", OpType::COALESCED,
                                           seq_++);
  }

  WorkPtr allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, ts, "all_reduce");
    check("all_reduce", ts);
    if (!gloo_) uniform_reduce(ts, o.reduceOp);
    return issue("all_reduce", OpType::ALLREDUCE, ts, [&] {
      auto a = hosts(ts);
      for (const auto& t : a) premultiply_(t, plan);
      auto g = o;
      g.reduceOp = plan.op;
      return std::vector<WorkPtr>{gloo_->allreduce(a, g)};
    });
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& ts,
                              const c10d::AllreduceCoalescedOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, ts, "all_reduce_coalesced");
    check("all_reduce_coalesced", ts);
    return issue("all_reduce_coalesced", OpType::ALLREDUCE_COALESCED, ts, [&] {
      c10d::AllreduceOptions g = o;
      g.reduceOp = plan.op;
      std::vector<WorkPtr> works;
      for (const auto& t : ts) {
        std::vector<at::Tensor> one = {host(t)};
        premultiply_(one[0], plan);
        works.push_back(gloo_->allreduce(one, g));
      }
      return works;
    });
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                    const c10d::AllgatherOptions& o) override {
    no_empty_rows("all_gather", ins);
    check("all_gather", ins);
    if (!gloo_) uniform_gather(outs, ins);
    return issue("all_gather", OpType::ALLGATHER, flat(outs), [&] {
      auto ao = hosts(outs);
      auto ai = hosts(ins);
      return std::vector<WorkPtr>{gloo_->allgather(ao, ai, o)};
    });
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    check("all_gather_into_tensor", {in});
    if (!gloo_) uniform_gather_flat(out, in, size_);
    return issue("all_gather_into_tensor", OpType::_ALLGATHER_BASE, {out}, [&] {
      auto ao = stacked(out, in, size_, "all_gather_into_tensor", true);
      auto ai = host(in);
      return std::vector<WorkPtr>{gloo_->_allgather_base(ao, ai, o)};
    });
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                              std::vector<at::Tensor>& ins,
                              const c10d::AllgatherOptions& o) override {
    // TorchNeuron's layout (outs[i][r]: input i of rank r), one all-gather per input.
    all_gather_coalesced_lists(outs, ins, size_);
    check("all_gather_coalesced", ins);
    if (!gloo_) uniform_gather(outs, ins);
    return issue("all_gather_coalesced", OpType::ALLGATHER_COALESCED, flat(outs), [&] {
      std::vector<WorkPtr> works;
      for (size_t i = 0; i < ins.size(); ++i) {
        std::vector<std::vector<at::Tensor>> ao = {hosts(outs[i])};
        std::vector<at::Tensor> ai = {host(ins[i])};
        works.push_back(gloo_->allgather(ao, ai, o));
      }
      return works;
    });
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                          std::vector<at::Tensor>& ins,
                                          const c10d::AllgatherOptions& o) override {
    no_empty_rows("all_gather_into_tensor_coalesced", ins);
    check("all_gather_into_tensor_coalesced", ins);
    return issue("all_gather_into_tensor_coalesced", OpType::COALESCED, outs, [&] {
      TORCH_CHECK_VALUE(outs.size() == ins.size(), "neuron backend: all_gather_into_tensor "
                        "coalesced needs one output per input, got ", outs.size(), " and ",
                        ins.size(), ".");
      std::vector<WorkPtr> works;
      for (size_t i = 0; i < outs.size(); ++i) {
        auto ao = stacked(outs[i], ins[i], size_, "all_gather_into_tensor", true);
        auto ai = host(ins[i]);
        works.push_back(gloo_->_allgather_base(ao, ai, o));
      }
      return works;
    });
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outs,
                         std::vector<std::vector<at::Tensor>>& ins,
                         const c10d::ReduceScatterOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, outs, "reduce_scatter");
    TORCH_CHECK_VALUE(outs.size() == 1 && ins.size() == 1, "neuron backend: reduce_scatter takes "
                      "one output tensor and one input list, got ", outs.size(), " and ",
                      ins.size(), ".");
    // TorchNeuron's forms: one tensor scattered along one dimension, or world-size tensors.
    const auto how = reduce_scatter_plan(outs[0], ins[0], size_);
    check("reduce_scatter", outs);
    return issue("reduce_scatter", OpType::REDUCE_SCATTER, outs, [&] {
      auto g = o;
      g.reduceOp = plan.op;
      if (how.dim < 0) {
        auto ao = hosts(outs);
        auto ai = hosts(ins);
        for (auto& l : ai) for (auto& t : l) t = premultiplied(t, plan);
        return std::vector<WorkPtr>{gloo_->reduce_scatter(ao, ai, g)};
      }
      // The scatter dimension first, then NCCL's flat form; the result copied into place.
      auto in = premultiplied(host(ins[0][0]).reshape(how.in_shape).movedim(how.dim, 0)
                                  .contiguous(), plan);
      auto out = host(outs[0]);
      auto tmp = at::empty(out.reshape(how.out_shape).movedim(how.dim, 0).sizes(),
                           out.options());
      gloo_->_reduce_scatter_base(tmp, in, g)->wait();
      out.copy_(tmp.movedim(0, how.dim).reshape(out.sizes()));
      return std::vector<WorkPtr>{};
    });
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, {in}, "reduce_scatter_tensor");
    check("reduce_scatter_tensor", {in});
    return issue("reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, {out}, [&] {
      auto ai = premultiplied(stacked(in, out, size_, "reduce_scatter_tensor", false), plan);
      auto ao = host(out);
      auto g = o;
      g.reduceOp = plan.op;
      return std::vector<WorkPtr>{gloo_->_reduce_scatter_base(ao, ai, g)};
    });
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                          std::vector<at::Tensor>& ins,
                                          const c10d::ReduceScatterOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, ins, "reduce_scatter_tensor_coalesced");
    check("reduce_scatter_tensor_coalesced", ins);
    return issue("reduce_scatter_tensor_coalesced", OpType::REDUCE_SCATTER_TENSOR_COALESCED, outs,
                 [&] {
      auto g = o;
      g.reduceOp = plan.op;
      TORCH_CHECK_VALUE(outs.size() == ins.size(), "neuron backend: reduce_scatter_tensor "
                        "coalesced needs one output per input, got ", outs.size(), " and ",
                        ins.size(), ".");
      std::vector<WorkPtr> works;
      for (size_t i = 0; i < outs.size(); ++i) {
        auto ai = premultiplied(stacked(ins[i], outs[i], size_, "reduce_scatter_tensor", false),
                                plan);
        auto ao = host(outs[i]);
        works.push_back(gloo_->_reduce_scatter_base(ao, ai, g));
      }
      return works;
    });
  }
  WorkPtr broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    check("broadcast", ts, o.rootRank);
    t_dry_kept = true;  // uniform-rank: every rank's tensor is this rank's already
    return issue("broadcast", OpType::BROADCAST, ts, [&] {
      auto a = hosts(ts);
      return std::vector<WorkPtr>{gloo_->broadcast(a, o)};
    });
  }
  WorkPtr reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    auto plan = plan_reduce(o.reduceOp, ts, "reduce");
    check("reduce", ts, o.rootRank);
    return issue("reduce", OpType::REDUCE, ts, [&] {
      // Only the root's tensors change (as NCCL's and TorchNeuron's reduce): gloo uses the
      // others as scratch, so they get copies.
      auto a = hosts(ts);
      if (rank_ != o.rootRank) for (auto& t : a) t = t.clone();
      for (const auto& t : a) premultiply_(t, plan);
      auto g = o;
      g.reduceOp = plan.op;
      return std::vector<WorkPtr>{gloo_->reduce(a, g)};
    });
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                 const c10d::GatherOptions& o) override {
    no_empty_rows("gather", ins);
    check("gather", ins, o.rootRank);
    return issue("gather", OpType::GATHER, flat(outs), [&] {
      auto ao = hosts(outs);
      auto ai = hosts(ins);
      return std::vector<WorkPtr>{gloo_->gather(ao, ai, o)};
    });
  }
  WorkPtr scatter(std::vector<at::Tensor>& outs, std::vector<std::vector<at::Tensor>>& ins,
                  const c10d::ScatterOptions& o) override {
    check("scatter", outs, o.rootRank);
    return issue("scatter", OpType::SCATTER, outs, [&] {
      auto ao = hosts(outs);
      auto ai = hosts(ins);
      return std::vector<WorkPtr>{gloo_->scatter(ao, ai, o)};
    });
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    even_splits("output", out, out_splits);
    even_splits("input", in, in_splits);
    check("all_to_all_single", {in});
    if (!gloo_) uniform_all_to_all(out, in, rank_, size_);
    return issue("all_to_all_single", OpType::ALLTOALL_BASE, {out}, [&] {
      auto ao = host(out);
      auto ai = host(in);
      std::vector<int64_t> none;
      return std::vector<WorkPtr>{gloo_->alltoall_base(ao, ai, none, none, o)};
    });
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                   const c10d::AllToAllOptions& o) override {
    all_to_all_lists(outs, ins, size_);
    check("all_to_all", ins);
    // One flat exchange; the list API is rare, so a pack/unpack copy is acceptable here.
    return issue("all_to_all", OpType::ALLTOALL, outs, [&] {
      std::vector<at::Tensor> parts;
      for (const auto& t : ins) parts.push_back(host(t).reshape(-1));
      auto flat_in = at::cat(parts);
      auto flat_out = at::empty_like(flat_in);
      std::vector<int64_t> none;
      gloo_->alltoall_base(flat_out, flat_in, none, none, o)->wait();
      auto chunks = flat_out.chunk(static_cast<int64_t>(outs.size()));
      for (size_t i = 0; i < outs.size(); ++i) host(outs[i]).copy_(chunks[i].view(outs[i].sizes()));
      return std::vector<WorkPtr>{};
    });
  }
  WorkPtr send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return issue("send", OpType::SEND, ts, [&] {
      auto a = hosts(ts);
      return std::vector<WorkPtr>{gloo_->send(a, dst, tag)};
    });
  }
  WorkPtr recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return issue("recv", OpType::RECV, ts, [&] {
      auto a = hosts(ts);
      return std::vector<WorkPtr>{gloo_->recv(a, src, tag)};
    });
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return issue("recv", OpType::RECVANYSOURCE, ts, [&] {
      auto a = hosts(ts);
      return std::vector<WorkPtr>{gloo_->recvAnysource(a, tag)};
    });
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    return issue("barrier", OpType::BARRIER, {}, [&] {
      return std::vector<WorkPtr>{gloo_->barrier(o)};
    });
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    if (!gloo_) return;
    NoPythonObjects clean;
    gloo_->monitoredBarrier(o, wait_all_ranks);
  }

 private:
  template <typename Start>
  WorkPtr issue(const char* what, OpType type, std::vector<at::Tensor> result, Start&& start) {
    if (!result.empty()) {  // for the terminate guard's message
      g_last_numel = result[0].numel();
      g_last_dtype = static_cast<int>(result[0].scalar_type());
    }
    g_last_what = what;
    std::vector<WorkPtr> inner;
    if (gloo_) {
      NoPythonObjects clean;
      inner = start();
    } else if (!t_dry_kept) {
      for (const auto& t : result) dry_mark(t, false);
    }
    t_dry_kept = false;
    record(what, nbytes(result));
    for (const auto& t : result) tag_storage(t, kTagCollectives);  // the peak's breakdown
    if (coalescing_) coalesced_result_.insert(coalesced_result_.end(), result.begin(), result.end());
    auto work = c10::make_intrusive<NeuronWork>(std::move(inner), std::move(result), where_, what,
                                                type, seq_++);
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  // The run report counts collectives per rank: bytes are this rank's result tensors.
  void record(const char* what, int64_t bytes) const {
    if (g_record == nullptr) return;
    PythonCall call;
    if (!call.ok()) return;
    py::gil_scoped_acquire gil;
    try {
      (*g_record)(what, bytes, record_rank_, size_, link_);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("neuronlocal record_collective");
    }
  }

  void check(const char* what, const std::vector<at::Tensor>& ts, int64_t root = -1) {
    if (!checks_) return;
    auto row = fingerprint(what, ts, root);
    auto mine = at::tensor(row, at::kLong);
    auto all = at::empty({size_ * kWidth}, at::kLong);
    {
      NoPythonObjects clean;
      gloo_->_allgather_base(all, mine, c10d::AllgatherOptions())->wait();
    }
    const int64_t* rows = all.const_data_ptr<int64_t>();
    bool same = true;
    for (int r = 1; r < size_ && same; ++r) {
      same = std::equal(rows, rows + kWidth, rows + r * kWidth);
    }
    if (same) return;
    std::ostringstream os;
    os << "neuron backend: ranks called " << what << " with mismatched inputs (shapes, dtypes, "
       << "tensor counts, roots or collectives differ):";
    for (int r = 0; r < size_; ++r) os << "\n  rank " << r << ": " << describe(rows + r * kWidth);
    os << "\nEvery rank must pass tensors of the same shape and dtype to the same collective, "
       << "in the same order.";
    TORCH_CHECK_VALUE(false, os.str());
  }

  // Dry run: every rank's input is this rank's, so each output slot gets a copy of it, where
  // it has bytes: CPU tensors, and neuron ones up to the size whose bytes a dry run keeps
  // (metadata such as DDP's parameter counts, which libraries read back).
  static at::Tensor bytes_of(const at::Tensor& t) {
    if (t.device().is_cpu()) return t;
    if (t.numel() * static_cast<int64_t>(t.element_size()) > kDryKeepBytes) return {};
    return cpu_alias(t);
  }
  // Whether a dry-run result holds values: a neuron one when its input did and it was
  // written whole (a CPU one is not tracked).
  static void mark_from(const at::Tensor& out, const at::Tensor& in, bool written) {
    if (out.device().type() != kNeuron) return;
    const bool values = written && (in.device().is_cpu() || dry_has_values(in));
    dry_mark(out, values && (dry_has_values(out) || covers_storage(out)));
  }
  static void uniform_gather(std::vector<std::vector<at::Tensor>>& outs,
                             const std::vector<at::Tensor>& ins) {
    t_dry_kept = true;
    for (size_t i = 0; i < outs.size(); ++i) {
      auto in = i < ins.size() ? bytes_of(ins[i]) : at::Tensor();
      for (auto& o : outs[i]) {
        auto out = bytes_of(o);
        const bool written = in.defined() && out.defined() && out.numel() == in.numel();
        if (written) out.copy_(in.view_as(out));
        mark_from(o, i < ins.size() ? ins[i] : o, written);
      }
    }
  }
  static void uniform_gather_flat(const at::Tensor& out, const at::Tensor& in, int size) {
    t_dry_kept = true;
    auto i = bytes_of(in), o = bytes_of(out);
    const bool written = i.defined() && o.defined() && o.is_contiguous() &&
                         o.numel() == i.numel() * size;
    if (written) for (const auto& chunk : o.view({-1}).chunk(size)) chunk.copy_(i.reshape({-1}));
    mark_from(out, in, written);
  }
  void uniform_reduce(const std::vector<at::Tensor>& ts, const c10d::ReduceOp& op) const {
    t_dry_kept = true;
    const auto k = op.op_;
    const bool same = k == c10d::ReduceOp::AVG || k == c10d::ReduceOp::MAX ||
                      k == c10d::ReduceOp::MIN || k == c10d::ReduceOp::BAND ||
                      k == c10d::ReduceOp::BOR;
    for (const auto& t : ts) {
      if (t.device().type() != kNeuron || !dry_has_values(t)) continue;
      if (k == c10d::ReduceOp::SUM && !t.is_complex()) {
        cpu_alias(t).mul_(size_);
      } else if (!same) {
        dry_mark(t, false);
      }
    }
  }
  static void uniform_all_to_all(const at::Tensor& out, const at::Tensor& in, int rank, int size) {
    t_dry_kept = true;
    const bool written = out.device().type() == kNeuron && dry_has_values(in) &&
                         in.numel() == out.numel() && in.numel() % size == 0 &&
                         out.is_contiguous();
    if (written) {
      auto mine = cpu_alias(in).reshape({size, -1})[rank].clone();
      for (const auto& chunk : cpu_alias(out).view({size, -1}).unbind(0)) chunk.copy_(mine);
    }
    mark_from(out, in, written);
  }

  // TorchNeuron's alltoall supports only even splits; say so instead of computing.
  void even_splits(const char* name, const at::Tensor& t, const std::vector<int64_t>& splits) {
    if (!splits.empty()) {
      bool even = static_cast<int>(splits.size()) == size_ &&
                  std::all_of(splits.begin(), splits.end(), [&](int64_t s) { return s == splits[0]; });
      TORCH_CHECK_NOT_IMPLEMENTED(even, "neuron backend: all_to_all_single: Only even split "
                                  "sizes are supported (as TorchNeuron). Got ", name,
                                  "_split_sizes: ", c10::IntArrayRef(splits), " for world size ",
                                  size_, ". Pad every chunk to ",
                                  *std::max_element(splits.begin(), splits.end()),
                                  " rows and pass equal splits (or None).");
      return;
    }
    int64_t rows = t.dim() ? t.size(0) : 0;
    TORCH_CHECK_VALUE(rows % size_ == 0, "neuron backend: all_to_all_single with no split sizes "
                      "needs ", name, ".shape[0] (", rows, ") divisible by the world size (",
                      size_, ").");
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<const Where> where_;
  int record_rank_;
  std::string link_;
  bool checks_;
  bool coalescing_ = false;
  std::atomic<uint64_t> seq_{0};
  std::vector<WorkPtr> coalesced_;
  std::vector<at::Tensor> coalesced_result_;
};

// The group Python sees: a stock c10d::ProcessGroup (the type Dynamo traces) named after
// TorchNeuron's backend. Its backend also serves CPU tensors, for the CPU aliases compiled
// graphs pass, but the group lists only `neuron` as its device, as TorchNeuron's does, so
// PyTorch's object collectives and barrier use neuron tensors.
class NeuronGroup : public c10d::ProcessGroup {
 public:
  NeuronGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const c10::intrusive_ptr<c10d::Backend>& backend)
      : ProcessGroup(store, rank, size) {
    setDefaultBackend(BackendType::CUSTOM);
    for (auto type : {kNeuron, c10::DeviceType::CPU}) setBackend(type, BackendType::CUSTOM, backend);
    // A dry run keeps CPU: object collectives then travel as CPU bytes (neuron ones hold none).
    if (!dry_run()) deviceTypes_.erase(c10::DeviceType::CPU);
  }
  const std::string getBackendName() const override { return "neuron"; }
};

}  // namespace

void bind_c10d(py::module_& m) {
  m.def("_c10d_backend",
        [](const c10::intrusive_ptr<c10d::Backend>& gloo, int rank, int size, int record_rank,
           std::string timeout, bool checks, std::string link) -> c10::intrusive_ptr<c10d::Backend> {
          return c10::make_intrusive<NeuronBackend>(gloo, rank, size, record_rank,
                                                    std::move(timeout), checks, std::move(link));
        },
        "the neuron c10d backend over an inner gloo backend");
  m.def("_c10d_dry_backend",
        [](int rank, int size, int record_rank, std::string link) -> c10::intrusive_ptr<c10d::Backend> {
          return c10::make_intrusive<NeuronBackend>(nullptr, rank, size, record_rank, "none",
                                                    false, std::move(link));
        },
        "the neuron c10d backend of a dry run: collectives complete without peers");
  m.def("_c10d_group",
        [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
           const c10::intrusive_ptr<c10d::Backend>& backend) -> c10::intrusive_ptr<c10d::ProcessGroup> {
          return c10::make_intrusive<NeuronGroup>(store, rank, size, backend);
        },
        "the process group over a neuron backend");
  m.def("_c10d_register_work",
        [](py::module_ mod) {
          static bool done = false;  // called with the GIL held, after torch registers Work
          if (done) return;
          done = true;
          py::class_<NeuronWork, c10d::Work, c10::intrusive_ptr<NeuronWork>>(
              mod, "NeuronWork", "A collective of the neuron backend, as TorchNeuron's Work")
              .def("get_sequence_number", &NeuronWork::getSequencenumber,
                   "the group's collective count when this one was issued (0, 1, 2, ...)");
        },
        "gives the backend's works their Python type, once torch.distributed's Work exists");
  m.def("_c10d_set_hooks",
        [](py::object record, py::object error_class) {
          if (g_record == nullptr) g_record = new py::object(std::move(record));  // never freed
          if (g_error_class == nullptr) g_error_class = error_class.release().ptr();
        },
        "record_collective and the error class, set once");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveError& e) {
      PyErr_SetString(g_error_class ? g_error_class : PyExc_RuntimeError,
                      e.what_without_backtrace());
    }
  });
}

}  // namespace neuron
