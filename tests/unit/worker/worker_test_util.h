// Shared pieces of the decoder/prefiller unit tests: the tiny golden Llama,
// engines on loopback-transport pools, and a recording DecodeSink.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "decoder/decoder.h"
#include "engine/engine.h"
#include "kvtransfer/transport.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "prefiller/prefiller.h"

namespace tandem::worker_test {

using namespace std::chrono_literals;

struct TinyModel {
  model::ModelConfig config;
  model::ModelWeights weights;
};

inline const TinyModel& Tiny() {
  static TinyModel* m = [] {
    auto* t = new TinyModel();
    const std::string dir =
        (std::filesystem::path(TANDEM_SOURCE_DIR) / "tests/fixtures/golden/tiny-llama").string();
    auto cfg = model::LoadModelConfig(dir);
    if (!cfg.ok()) std::abort();
    t->config = *cfg;
    auto w = model::LoadWeights(dir, *cfg);
    if (!w.ok()) std::abort();
    t->weights = std::move(w).value();
    return t;
  }();
  return *m;
}

constexpr uint32_t kBlockSize = 16;

inline engine::KvLayout TinyLayout() {
  engine::KvLayout l;
  l.num_layers = Tiny().config.num_hidden_layers;
  l.num_kv_heads = Tiny().config.num_key_value_heads;
  l.head_dim = Tiny().config.head_dim;
  l.block_size = kBlockSize;
  return l;
}

class PoolAllocator final : public engine::KvPoolAllocator {
 public:
  explicit PoolAllocator(kvtransfer::Transport& t) : t_(t) {}
  Result<std::span<std::byte>> Allocate(size_t bytes) override {
    if (bytes != t_.pool_bytes()) return InternalError("size mismatch");
    return std::span<std::byte>(t_.pool(), bytes);
  }

 private:
  kvtransfer::Transport& t_;
};

// A loopback transport and an engine whose KV pool is that transport's.
struct Node {
  std::unique_ptr<kvtransfer::Transport> transport;
  std::unique_ptr<PoolAllocator> allocator;
  std::unique_ptr<engine::Engine> engine;

  // `progress`: wired to the engine's scheduling and step hooks, as
  // worker_runtime does for a prefiller (prefiller::EngineProgress).
  // `tune`: changes the engine's options last (e.g. a step hook).
  static std::unique_ptr<Node> Make(const std::string& name, uint32_t num_blocks,
                                    std::shared_ptr<prefiller::EngineProgress> progress = nullptr,
                                    const std::function<void(engine::EngineOptions&)>& tune = {}) {
    auto n = std::make_unique<Node>();
    kvtransfer::TransportOptions o;
    o.backend = "loopback";
    o.agent_name = name;
    o.block_bytes = TinyLayout().block_bytes();
    o.num_blocks = num_blocks;
    auto t = kvtransfer::CreateTransport(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (!t.ok()) return nullptr;
    n->transport = std::move(t).value();
    n->allocator = std::make_unique<PoolAllocator>(*n->transport);
    engine::EngineOptions eo;
    eo.block_size = kBlockSize;
    eo.num_blocks = num_blocks;
    eo.scheduler.max_batched_tokens = 64;
    eo.allocator = n->allocator.get();
    if (progress) {
      eo.on_queue_time = [progress](int32_t, const std::string&, double) { progress->Scheduled(); };
      eo.on_step = [progress](const engine::StepStats&) { progress->StepEnded(); };
    }
    if (tune) tune(eo);
    auto e = engine::Engine::Create(Tiny().config, Tiny().weights, eo);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return nullptr;
    n->engine = std::move(e).value();
    n->engine->Start();
    return n;
  }
  ~Node() {
    if (engine) engine->Stop();
  }
};

inline std::vector<uint32_t> Prompt(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> p;
  for (uint32_t i = 0; i < n; ++i) p.push_back(3 + (seed * 131 + i * 17) % 500);
  return p;
}

// Records what a decode stream would carry.
class RecordingSink final : public decoder::DecodeSink {
 public:
  void OnTokens(uint32_t first_index, std::span<const uint32_t> ids) override {
    std::lock_guard lock(mu_);
    if (first_index != tokens.size()) out_of_order = true;
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    ++hand_offs;
  }
  void OnFinished(const decoder::DecodeResult& r) override {
    std::lock_guard lock(mu_);
    finished = true;
    result = r;
  }
  void OnError(const Status& s) override {
    std::lock_guard lock(mu_);
    error = s;
    errored = true;
  }
  bool Ended() {
    std::lock_guard lock(mu_);
    return finished || errored;
  }
  std::mutex mu_;
  std::vector<uint32_t> tokens;
  size_t hand_offs = 0;  // OnTokens calls
  bool out_of_order = false;
  bool finished = false;
  bool errored = false;
  decoder::DecodeResult result;
  Status error;
};

inline bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout = 10s) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// Holds the engine thread wherever a hook of its calls AtStep while the
// gate is held: after a step (EngineOptions::on_step: no request in a
// forward pass, so an Abort finishes it on the caller's thread) or as a
// step's forward starts (on_forward_for_tests: an Abort is finished after
// the step).
class StepGate {
 public:
  void Hold() {
    std::lock_guard lock(mu_);
    hold_ = true;
  }
  void Release() {
    std::lock_guard lock(mu_);
    hold_ = false;
    cv_.notify_all();
  }
  void AtStep() {
    std::unique_lock lock(mu_);
    if (!hold_) return;
    parked_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return !hold_; });
    parked_ = false;
  }
  bool WaitParked() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 10s, [this] { return parked_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false;    // guarded by mu_
  bool parked_ = false;  // guarded by mu_
};

// Releases the gate however the test ends (the engine's Stop joins its thread).
struct GateRelease {
  StepGate& gate;
  ~GateRelease() { gate.Release(); }
};

// The success notice a prefiller sends for target `t` once its KV landed.
inline decoder::KvNoticeInfo SuccessNotice(const decoder::KvTargetInfo& t, uint32_t first_token) {
  decoder::KvNoticeInfo n;
  n.request_id = t.request_id;
  n.reservation_id = t.reservation_id;
  n.generation = t.generation;
  n.first_token_id = first_token;
  n.capability = t.capability;
  return n;
}

// One ReserveOrWait call's answer, as its transport would get it.
class Answer {
 public:
  decoder::Decoder::ReserveDone Done() {
    return [this](const Result<decoder::KvTargetInfo>& r) {
      std::lock_guard lock(mu_);
      ++calls_;
      got_ = r;
    };
  }
  bool Has() {
    std::lock_guard lock(mu_);
    return got_.has_value();
  }
  int calls() {
    std::lock_guard lock(mu_);
    return calls_;
  }
  Result<decoder::KvTargetInfo> Get() {
    std::lock_guard lock(mu_);
    return *got_;
  }

 private:
  std::mutex mu_;
  std::optional<Result<decoder::KvTargetInfo>> got_;
  int calls_ = 0;
};

inline engine::SamplingParams Greedy(uint32_t max_tokens) {
  engine::SamplingParams s;
  s.temperature = 0;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  s.seed = 1;
  return s;
}

}  // namespace tandem::worker_test
