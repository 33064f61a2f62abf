// Random numbers: the generator of a logical core, with TorchNeuron's state format.
//
// TorchNeuron's generator is a Philox (seed, offset) pair; its state is 16 bytes, the seed
// (uint64) then the offset (int64), and an 8-byte state (a seed alone) is accepted too.
// TorchNeuron has no device kernel for random ops: its CPU fallback (and its dropout and
// attention kernels) draw from CPU's global generator, so a core's default generator holds
// a seed and an offset that eager draws do not move. A neuron generator passed to a random
// op explicitly draws its own stream here: a CPU generator (Mersenne Twister) seeded with
// the seed, so a seed gives the numbers CPU gives. The offset counts the 32-bit words drawn
// since seeding, so (seed, offset) fixes the position in the stream and set_state can
// rebuild it in any process. A state read in this process is restored exactly (with the
// Box-Muller sample CPU's normal ops may keep between calls); one from elsewhere is rebuilt
// by stepping the engine, without that cached sample.
//
// A core's default generator draws its own stream too once its state is set (set_state:
// torch.neuron.set_rng_state, fork_rng's restore), until it is seeded again (manual_seed,
// seed). DTensor's random-number tracker works that way: it sets each core's (seed, offset)
// for a random op inside torch.random.fork_rng, which restores CPU's global generator
// afterwards, so draws from that one would repeat in every region (and trunc_normal_'s
// redraw loop would never end).
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>
#include <deque>
#include <mutex>

namespace neuron {
namespace {

constexpr int64_t kBlock = at::MERSENNE_STATE_N;  // words per twist of the engine
constexpr size_t kSnapshots = 256;               // states read here, kept for set_state
constexpr int64_t kMaxTwists = int64_t{1} << 24;  // one op drawing 10^10 words: never reached

// The engine after one more twist of `pod`'s state words (the engine's own twist, reached
// by drawing once from a copy positioned at the end of its block).
at::mt19937_data_pod twisted(at::mt19937_data_pod pod) {
  pod.left_ = 1;
  pod.next_ = 0;
  at::mt19937 e;
  e.set_data(pod);
  e();
  return e.data();
}

// Twists since seeding of an engine that has drawn `words` words.
int64_t twists_at(int64_t words) { return words == 0 ? 0 : (words - 1) / kBlock + 1; }

struct Snapshot {
  uint64_t seed;
  int64_t offset;
  at::mt19937 engine;
  std::optional<float> next_float;
  std::optional<double> next_double;
};

class NeuronGenerator final : public c10::GeneratorImpl {
 public:
  explicit NeuronGenerator(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kNeuron, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host_(at::detail::createCPUGenerator(seed)) {}

  static c10::DeviceType device_type() { return kNeuron; }

  void set_current_seed(uint64_t seed) override {
    host_.set_current_seed(seed);  // also drops CPU's cached normal samples
    offset_ = 0;
    own_stream_ = false;
  }
  uint64_t current_seed() const override { return host_.current_seed(); }
  uint64_t seed() override {
    auto s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  uint64_t get_offset() const override { return static_cast<uint64_t>(offset_); }
  void set_offset(uint64_t offset) override {
    move_to(current_seed(), static_cast<int64_t>(offset));
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::detail::empty_cpu({16}, at::kByte, std::nullopt, std::nullopt, std::nullopt,
                                   std::nullopt);
    const uint64_t seed = current_seed();
    std::memcpy(t.data_ptr<uint8_t>(), &seed, 8);
    std::memcpy(t.data_ptr<uint8_t>() + 8, &offset_, 8);
    remember();
    return t.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& state) override {
    const auto n = state.numel();
    TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && (n == 16 || n == 8),
                "RNG state is wrong size: a neuron generator's state is 16 bytes (seed and "
                "offset, as TorchNeuron's) or 8 (a seed), got ", n, " bytes");
    const auto* p = static_cast<const uint8_t*>(state.data());
    uint64_t seed = 0;
    int64_t offset = 0;
    std::memcpy(&seed, p, 8);
    if (n == 16) std::memcpy(&offset, p + 8, 8);
    TORCH_CHECK(offset >= 0, "RNG state has a negative offset (", offset, ")");
    move_to(seed, offset);
    own_stream_ = true;
  }

  // Whether random ops on this core draw this generator's stream when none is passed.
  bool own_stream() const { return own_stream_; }

  // The CPU generator random ops draw from; call account() with the engine as it was before.
  at::Generator& host() { return host_; }
  at::mt19937_data_pod engine_data() { return host_.get<at::CPUGeneratorImpl>()->engine().data(); }

  // Advances the offset by the words drawn since `before` (the engine's data then).
  void account(const at::mt19937_data_pod& before) {
    const auto after = engine_data();
    int64_t twists = 0;
    if (std::memcmp(before.state_.data(), after.state_.data(), sizeof(after.state_)) != 0) {
      auto pod = before;
      do {
        pod = twisted(pod);
        ++twists;
      } while (std::memcmp(pod.state_.data(), after.state_.data(), sizeof(after.state_)) != 0 &&
               twists < kMaxTwists);
    }
    if (twists == 0) {
      offset_ += static_cast<int64_t>(after.next_) - static_cast<int64_t>(before.next_);
    } else {
      offset_ = (twists_at(offset_) + twists - 1) * kBlock + after.next_;
    }
  }

 private:
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device_.index());
    g->host_ = host_.clone();
    g->offset_ = offset_;
    g->snapshots_ = snapshots_;
    return g;
  }

  void remember() const {
    auto* cpu = host_.get<at::CPUGeneratorImpl>();
    const uint64_t seed = cpu->current_seed();
    for (const auto& s : snapshots_)
      if (s.seed == seed && s.offset == offset_) return;
    if (snapshots_.size() == kSnapshots) snapshots_.pop_front();
    snapshots_.push_back({seed, offset_, cpu->engine(), cpu->next_float_normal_sample(),
                          cpu->next_double_normal_sample()});
  }

  // Positions the stream at `offset` words after seeding with `seed`: from the closest
  // known position before it (a state read here, the current one, or the seed itself).
  void move_to(uint64_t seed, int64_t offset) {
    auto* cpu = host_.get<at::CPUGeneratorImpl>();
    if (seed == cpu->current_seed() && offset == offset_) return;
    const Snapshot* from = nullptr;
    for (const auto& s : snapshots_) {
      if (s.seed == seed && s.offset <= offset && (!from || s.offset > from->offset)) from = &s;
    }
    if (from && from->offset == offset) {
      cpu->set_engine(from->engine);
      cpu->set_next_float_normal_sample(from->next_float);
      cpu->set_next_double_normal_sample(from->next_double);
      offset_ = offset;
      return;
    }
    at::mt19937_data_pod pod;
    int64_t pos = 0;
    if (seed == cpu->current_seed() && offset_ <= offset && (!from || from->offset < offset_)) {
      pod = cpu->engine().data();
      pos = offset_;
    } else if (from) {
      pod = from->engine.data();
      pos = from->offset;
    } else {
      pod = at::mt19937(seed).data();
    }
    for (int64_t i = twists_at(pos); i < twists_at(offset); ++i) pod = twisted(pod);
    if (offset > 0) {
      pod.next_ = static_cast<uint32_t>(offset - (twists_at(offset) - 1) * kBlock);
      pod.left_ = static_cast<int>(kBlock + 1 - pod.next_);
    }
    cpu->set_current_seed(seed);  // drops the cached normal samples, which the state lacks
    at::mt19937 e;
    e.set_data(pod);
    cpu->set_engine(e);
    offset_ = offset;
  }

  at::Generator host_;
  int64_t offset_ = 0;
  std::atomic<bool> own_stream_{false};
  mutable std::deque<Snapshot> snapshots_;
};

NeuronGenerator* neuron_impl(const at::Generator& g) {
  return g.defined() && g.device().type() == kNeuron ? g.get<NeuronGenerator>() : nullptr;
}

}  // namespace

at::Generator make_generator(c10::DeviceIndex index) {
  return at::make_generator<NeuronGenerator>(index);
}

bool draws_own_stream(const at::Generator& gen) {
  auto* g = neuron_impl(gen);
  return g != nullptr && g->own_stream();
}

Draw::Draw(const at::Generator& gen) : gen_(gen), impl_(neuron_impl(gen)) {
  if (!impl_) return;
  lock_ = std::unique_lock<std::mutex>(impl_->mutex_);
  auto* g = static_cast<NeuronGenerator*>(impl_);
  before_ = g->engine_data();
  gen_ = g->host();
}

Draw::~Draw() {
  if (impl_) static_cast<NeuronGenerator*>(impl_)->account(before_);
}

}  // namespace neuron
