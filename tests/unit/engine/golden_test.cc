// The forward pass against Hugging Face transformers (float32): logits
// within 1e-3 absolute at the fixture's positions and 64 greedy tokens
// exactly equal, for every tests/fixtures/golden/*/golden.json present.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "forward_harness.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::ForwardHarness;
using testing::LoadedModel;
using testing::RepoPath;

constexpr double kLogitTolerance = 1e-3;

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, LogitsAndGreedyTokensMatchTransformers) {
  const std::string path = RepoPath("tests/fixtures/golden/" + GetParam() + "/golden.json");
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << "fixture " << path << " is absent (made by tools/make_golden.py)";
  }
  std::ifstream in(path);
  const auto golden = nlohmann::json::parse(in);
  const std::string dir = RepoPath(golden.at("model_dir").get<std::string>());
  if (!std::filesystem::exists(dir + "/config.json")) {
    GTEST_SKIP() << "model directory " << dir << " is absent";
  }
  auto cfg = model::LoadModelConfig(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto w = model::LoadWeights(dir, *cfg);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  LoadedModel m{*cfg, std::move(*w)};

  // Logits: each prompt in one forward pass, every position's logits.
  ForwardHarness h(m, 256);
  const auto& cases = golden.at("cases");
  for (const auto& c : cases) {
    const auto prompt = c.at("prompt_ids").get<std::vector<uint32_t>>();
    const auto logits = h.PromptLogits(prompt);
    const auto positions = c.at("logits_positions").get<std::vector<uint32_t>>();
    const auto& expected = c.at("logits");
    ASSERT_EQ(positions.size(), expected.size());
    double worst = 0;
    size_t bad = 0;
    for (size_t i = 0; i < positions.size(); ++i) {
      const auto row = expected[i].get<std::vector<float>>();
      ASSERT_EQ(row.size(), h.vocab());
      for (uint32_t j = 0; j < h.vocab(); ++j) {
        const double d = std::fabs(double(logits[size_t{positions[i]} * h.vocab() + j]) - row[j]);
        worst = std::max(worst, d);
        bad += !(d <= kLogitTolerance);
      }
    }
    std::printf("[   INFO   ] %s, prompt of %zu tokens: worst |logit diff| %.3g\n",
                GetParam().c_str(), prompt.size(), worst);
    EXPECT_EQ(bad, 0u) << GetParam() << " prompt of " << prompt.size()
                       << " tokens: worst |diff| " << worst;
  }

  // Greedy continuations through the engine, all cases in one batch.
  EngineOptions o;
  o.num_blocks = 512;
  o.scheduler.max_batched_tokens = 256;
  auto engine = testing::MakeEngine(m, o);
  ASSERT_NE(engine, nullptr);
  std::vector<Collector> out(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    GenerateRequest r;
    r.request_id = testing::Id("case", i);
    r.prompt_ids = cases[i].at("prompt_ids").get<std::vector<uint32_t>>();
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = golden.value("ignore_eos", true);
    r.sampling.max_tokens = static_cast<uint32_t>(cases[i].at("greedy_ids").size());
    r.on_output = out[i].Callback();
    ASSERT_TRUE(engine->Submit(std::move(r)).ok());
  }
  engine->RunUntilIdle();
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(out[i].tokens, cases[i].at("greedy_ids").get<std::vector<uint32_t>>())
        << GetParam() << " case " << i;
  }
  EXPECT_EQ(engine->stats().free_blocks, o.num_blocks);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest,
                         ::testing::Values("tiny-qwen2", "tiny-llama", "tiny-llama-bias", "tandem-kjv"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

}  // namespace
}  // namespace tandem::engine
