// Shared helpers for the engine tests: the tiny golden models (loaded once
// per process) and an engine factory.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::engine::testing {

struct LoadedModel {
  model::ModelConfig config;
  model::ModelWeights weights;
};

inline std::string RepoPath(const std::string& rel) {
  return (std::filesystem::path(TANDEM_SOURCE_DIR) / rel).string();
}

// The model in `rel_dir` (relative to the repository), loaded once per
// process. Aborts the test on failure.
inline const LoadedModel& ModelAt(const std::string& rel_dir) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[rel_dir];
  if (!slot) {
    const std::string dir = RepoPath(rel_dir);
    auto cfg = model::LoadModelConfig(dir);
    if (!cfg.ok()) {
      ADD_FAILURE() << cfg.status().ToString();
      std::abort();
    }
    auto w = model::LoadWeights(dir, *cfg);
    if (!w.ok()) {
      ADD_FAILURE() << w.status().ToString();
      std::abort();
    }
    slot = std::make_unique<LoadedModel>(LoadedModel{*cfg, std::move(*w)});
  }
  return *slot;
}

// `name`: a folder under tests/fixtures/golden ("tiny-llama", "tiny-qwen2").
inline const LoadedModel& TinyModel(const std::string& name = "tiny-qwen2") {
  return ModelAt("tests/fixtures/golden/" + name);
}

// The bundled models/tandem-kjv (hidden 256, vocab 4096): large enough that
// the CPU kernels split its GEMMs, norms and attention between threads.
inline const LoadedModel& BundledModel() { return ModelAt("models/tandem-kjv"); }

inline std::unique_ptr<Engine> MakeEngine(const LoadedModel& m, EngineOptions o = {}) {
  auto e = Engine::Create(m.config, m.weights, std::move(o));
  if (!e.ok()) {
    ADD_FAILURE() << e.status().ToString();
    return nullptr;
  }
  return std::move(*e);
}

// The tiny model in a pool of `num_blocks` with the growth reserve at
// `conservativeness` (scheduler.schedule_conservativeness; 0: off).
inline std::unique_ptr<Engine> MakeSmallPoolEngine(uint32_t num_blocks, double conservativeness) {
  EngineOptions o;
  o.num_blocks = num_blocks;
  o.scheduler.schedule_conservativeness = conservativeness;
  return MakeEngine(TinyModel(), std::move(o));
}

// Deterministic pseudo-random prompt of `n` ids in [3, vocab).
inline std::vector<uint32_t> Prompt(uint32_t n, uint32_t salt, uint32_t vocab = 512) {
  std::vector<uint32_t> p(n);
  uint64_t x = 0x9E3779B97F4A7C15ull * (salt + 1);
  for (auto& t : p) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    t = 3 + static_cast<uint32_t>(x % (vocab - 3));
  }
  return p;
}

// Collects one request's outputs.
struct Collector {
  std::vector<uint32_t> tokens;
  std::string text;
  bool finished = false;
  int finished_count = 0;
  FinishReason reason = FinishReason::kNone;
  Status status;
  RequestOutput last;
  OutputCallback Callback() {
    return [this](const RequestOutput& o) {
      tokens.insert(tokens.end(), o.token_ids.begin(), o.token_ids.end());
      text += o.text;
      if (o.finished) {
        finished = true;
        ++finished_count;
        reason = o.finish_reason;
        status = o.status;
      }
      last = o;
    };
  }
};

// A request of `prompt` (empty for AddPrefilled: the reserved one) for
// `max_tokens` tokens, EOS ignored, seed 7; outputs into `c` (may be null).
inline GenerateRequest MakeRequest(const std::string& id, std::vector<uint32_t> prompt,
                                   uint32_t max_tokens, Collector* c, float temperature = 0) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = 7;
  r.sampling.ignore_eos = true;
  if (c) r.on_output = c->Callback();
  return r;
}

// The tokens `prompt` gives alone, on a fresh engine of the tiny model.
inline std::vector<uint32_t> GenerateAlone(const std::vector<uint32_t>& prompt, uint32_t max_tokens,
                                           float temperature = 0) {
  auto e = MakeEngine(TinyModel());
  Collector c;
  EXPECT_TRUE(e->Submit(MakeRequest("alone", prompt, max_tokens, &c, temperature)).ok());
  e->RunUntilIdle();
  return c.tokens;
}

}  // namespace tandem::engine::testing

namespace tandem::engine::testing {
// "prefix" + n (std::string's operator+ on a literal trips GCC 12's -Wrestrict).
inline std::string Id(const char* prefix, size_t n) {
  std::string s(prefix);
  s += std::to_string(n);
  return s;
}
}  // namespace tandem::engine::testing
