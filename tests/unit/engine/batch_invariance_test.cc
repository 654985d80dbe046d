// Batch invariance, bit for bit (DESIGN.md section 6): a prompt's logits do
// not depend on the batch around it or on its chunking, and a request's
// tokens do not depend on what runs next to it, on chunked prefill, on
// preemption or on prefix-cache hits.
#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "forward_harness.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::ForwardHarness;
using testing::MakeEngine;
using testing::Prompt;
using testing::TinyModel;

bool BitEqual(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

class LogitsInvarianceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LogitsInvarianceTest, AloneInABatchOf32AndChunked) {
  const auto& m = TinyModel(GetParam());
  const uint32_t vocab = m.config.vocab_size;
  const auto prompt = Prompt(37, 1);
  ForwardHarness h(m, 400);
  const auto alone = h.PromptLogits(prompt);

  // Chunked at different sizes.
  for (uint32_t chunk : {1u, 5u, 16u, 20u}) {
    const auto chunked = h.PromptLogits(prompt, chunk);
    ASSERT_EQ(chunked.size(), alone.size());
    EXPECT_TRUE(BitEqual(chunked.data(), alone.data(), alone.size())) << "chunk " << chunk;
  }

  // In a batch of 32 sequences: the prompt in the middle, others of mixed
  // lengths, some of them single-token "decode" rows at a later position.
  std::vector<std::vector<uint32_t>> others;
  std::vector<std::vector<uint32_t>> tables;
  std::vector<SeqChunk> batch;
  others.reserve(32);
  tables.reserve(32);
  const uint32_t at = 17;
  for (uint32_t i = 0; i < 32; ++i) {
    if (i == at) {
      others.push_back(prompt);
    } else {
      others.push_back(Prompt(1 + (i * 7) % 45, 100 + i));
    }
    tables.push_back(h.Blocks(static_cast<uint32_t>(others.back().size())));
  }
  // Fill the KV of the "decode" sequences' history first, so that their
  // single row in the batch sits at a later position.
  for (uint32_t i = 0; i < 32; ++i) {
    if (i == at || i % 3 != 0 || others[i].size() < 2) continue;
    SeqChunk pre;
    pre.tokens = std::span<const uint32_t>(others[i]).first(others[i].size() - 1);
    pre.block_table = tables[i];
    h.Run({pre});
  }
  uint32_t row_of_prompt = 0, rows = 0;
  for (uint32_t i = 0; i < 32; ++i) {
    SeqChunk c;
    const bool decode = i != at && i % 3 == 0 && others[i].size() >= 2;
    const uint32_t start = decode ? static_cast<uint32_t>(others[i].size()) - 1 : 0;
    c.tokens = std::span<const uint32_t>(others[i]).subspan(start);
    c.start_pos = start;
    c.block_table = tables[i];
    c.num_logits = static_cast<uint32_t>(c.tokens.size());
    if (i == at) row_of_prompt = rows;
    rows += c.num_logits;
    batch.push_back(c);
  }
  const auto batched = h.Run(batch);
  EXPECT_TRUE(BitEqual(batched.data() + size_t{row_of_prompt} * vocab, alone.data(), alone.size()));

  // Each other sequence's last row equals its own lone computation.
  ForwardHarness h2(m, 400);
  rows = 0;
  for (uint32_t i = 0; i < 32; ++i) {
    const auto lone = h2.PromptLogits(others[i]);
    const size_t last_lone = (others[i].size() - 1) * vocab;
    rows += batch[i].num_logits;
    EXPECT_TRUE(BitEqual(batched.data() + size_t{rows - 1} * vocab, lone.data() + last_lone, vocab))
        << "sequence " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, LogitsInvarianceTest,
                         ::testing::Values("tiny-qwen2", "tiny-llama"),
                         [](const auto& info) {
                           return info.param == "tiny-qwen2" ? std::string("qwen2")
                                                             : std::string("llama");
                         });

struct GenCase {
  std::vector<uint32_t> prompt;
  SamplingParams params;
};

std::vector<GenCase> Cases(uint32_t n, bool sampled) {
  std::vector<GenCase> out;
  for (uint32_t i = 0; i < n; ++i) {
    GenCase c;
    c.prompt = Prompt(3 + (i * 11) % 60, 500 + i);
    c.params.max_tokens = 12 + i % 9;
    c.params.ignore_eos = true;
    if (sampled) {
      c.params.temperature = 0.9f;
      c.params.top_p = i % 2 ? 0.9f : 1.0f;
      c.params.top_k = i % 3 ? 40 : 0;
      c.params.seed = 1000 + i;
    } else {
      c.params.temperature = 0;
    }
    out.push_back(c);
  }
  return out;
}

// Runs `cases` (all submitted before stepping) and returns each one's tokens.
std::vector<std::vector<uint32_t>> Generate(const testing::LoadedModel& m,
                                            const std::vector<GenCase>& cases, EngineOptions o,
                                            EngineStats* stats = nullptr) {
  auto engine = MakeEngine(m, o);
  std::vector<Collector> col(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    GenerateRequest r;
    r.request_id = testing::Id("r", i);
    r.prompt_ids = cases[i].prompt;
    r.sampling = cases[i].params;
    r.on_output = col[i].Callback();
    Status st = engine->Submit(std::move(r));
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  engine->RunUntilIdle();
  std::vector<std::vector<uint32_t>> out;
  for (auto& c : col) {
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.finished_count, 1);
    out.push_back(c.tokens);
  }
  if (stats) *stats = engine->stats();
  EXPECT_EQ(engine->stats().free_blocks, o.num_blocks);
  return out;
}

class GenerationInvarianceTest : public ::testing::TestWithParam<bool> {};

TEST_P(GenerationInvarianceTest, ThirtyTwoTogetherEqualEachAlone) {
  const auto& m = TinyModel("tiny-qwen2");
  const auto cases = Cases(32, GetParam());
  EngineOptions o;
  o.num_blocks = 256;
  o.scheduler.max_batched_tokens = 96;  // chunked prefill mixed with decodes
  EngineStats stats;
  const auto together = Generate(m, cases, o, &stats);
  EXPECT_EQ(stats.preemptions, 0u);
  // Two and four compute threads give the same bits.
  for (uint32_t threads : {2u, 4u}) {
    EngineOptions more = o;
    more.threads = threads;
    EXPECT_EQ(Generate(m, cases, more), together) << threads << " threads";
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(together[i].size(), cases[i].params.max_tokens);
    EngineOptions alone_o;
    alone_o.num_blocks = 16;
    auto alone = Generate(m, {cases[i]}, alone_o);
    EXPECT_EQ(together[i], alone[0]) << "request " << i;
  }
}

TEST_P(GenerationInvarianceTest, ForcedPreemptionGivesIdenticalTokens) {
  const auto& m = TinyModel("tiny-llama");
  auto cases = Cases(8, GetParam());
  for (auto& c : cases) c.params.max_tokens = 40;
  EngineOptions big;
  big.num_blocks = 128;
  const auto reference = Generate(m, cases, big);
  EngineOptions tiny;
  tiny.block_size = 4;
  tiny.num_blocks = 40;  // ~100 tokens each, 8 at once: must preempt
  tiny.scheduler.max_batched_tokens = 32;
  EngineStats stats;
  const auto squeezed = Generate(m, cases, tiny, &stats);
  EXPECT_GT(stats.preemptions, 0u);
  EXPECT_EQ(squeezed, reference);
}

// The thread count changes no bits: every kernel keeps each reduction whole
// on one thread, however the work is split (kernels/cpu/ops.h). The bundled
// model is large enough that its GEMMs, norms and attention are really split
// (2 and 4 threads); the tiny ones split attention and the longer row ops.
const testing::LoadedModel& ModelByName(const std::string& name) {
  return name == "tandem-kjv" ? testing::BundledModel() : TinyModel(name);
}

class ThreadCountInvarianceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ThreadCountInvarianceTest, LogitsBitIdenticalWithOneTwoAndFourThreads) {
  const auto& m = ModelByName(GetParam());
  const uint32_t vocab = m.config.vocab_size;
  const auto long_prompt = Prompt(150, 7, vocab);
  const auto stepped = Prompt(40, 8, vocab);
  const auto fresh = Prompt(25, 9, vocab);
  auto run = [&](int threads) {
    ForwardHarness h(m, 64, 16, threads);
    // A 150-token prefill in one step, a prompt fed one token per step...
    std::vector<float> out = h.PromptLogits(long_prompt);
    const auto rows = h.PromptLogits(stepped, 1);
    out.insert(out.end(), rows.begin(), rows.end());
    // ...and a mixed step: a fresh 25-token chunk next to a decode row.
    const auto decode_blocks = h.Blocks(41);
    SeqChunk pre;
    pre.tokens = stepped;
    pre.block_table = decode_blocks;
    h.Run({pre});
    const uint32_t next = 11;
    const auto fresh_blocks = h.Blocks(static_cast<uint32_t>(fresh.size()));
    SeqChunk a, b;
    a.tokens = fresh;
    a.block_table = fresh_blocks;
    a.num_logits = static_cast<uint32_t>(fresh.size());
    b.tokens = std::span<const uint32_t>(&next, 1);
    b.start_pos = static_cast<uint32_t>(stepped.size());
    b.block_table = decode_blocks;
    b.num_logits = 1;
    const auto mixed = h.Run({a, b});
    out.insert(out.end(), mixed.begin(), mixed.end());
    return out;
  };
  const auto one = run(1);
  ASSERT_EQ(one.size(), size_t{150 + 40 + 25 + 1} * vocab);
  for (int threads : {2, 4}) {
    const auto got = run(threads);
    ASSERT_EQ(got.size(), one.size());
    size_t first_diff = 0;
    while (first_diff < one.size() && std::memcmp(&got[first_diff], &one[first_diff], 4) == 0) {
      ++first_diff;
    }
    EXPECT_EQ(first_diff, one.size())
        << threads << " threads: first differing logit at row " << first_diff / vocab;
  }
}

TEST_P(ThreadCountInvarianceTest, TokensIdenticalWithOneTwoAndFourThreads) {
  const auto& m = ModelByName(GetParam());
  auto cases = Cases(8, /*sampled=*/false);
  const auto seeded = Cases(8, /*sampled=*/true);
  cases.insert(cases.end(), seeded.begin(), seeded.end());
  EngineOptions o;
  o.num_blocks = 128;
  o.scheduler.max_batched_tokens = 64;  // chunked prefill next to decodes
  const auto one = Generate(m, cases, o);
  for (uint32_t threads : {2u, 4u}) {
    o.threads = threads;
    EXPECT_EQ(Generate(m, cases, o), one) << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ThreadCountInvarianceTest,
                         ::testing::Values("tiny-llama", "tandem-kjv"), [](const auto& info) {
                           return info.param == "tandem-kjv" ? std::string("kjv")
                                                             : std::string("tiny_llama");
                         });

// model.batch_invariant: false asks for nothing the cpu backend lacks: the
// key reaches the engine, the backend still reports invariance, and the
// 32-together-equal-alone result holds unchanged.
TEST(BatchInvariantKey, FalseIsAcceptedAndTheCpuBackendStaysInvariant) {
  auto fleet = ParseFleetConfig("model:\n  path: m\n  batch_invariant: false\nboth:\n  replicas: 1\n",
                                "x.yaml", "/tmp");
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  EngineOptions o = EngineOptions::FromFleetConfig(*fleet);
  EXPECT_FALSE(o.batch_invariant);
  EXPECT_EQ(o.backend, "cpu");
  o.num_blocks = 256;
  o.scheduler.max_batched_tokens = 96;
  const auto& m = TinyModel("tiny-qwen2");
  auto engine = MakeEngine(m, o);
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(engine->backend().Supports(BackendFeature::kBatchInvariant));
  engine.reset();
  const auto cases = Cases(6, /*sampled=*/true);
  const auto together = Generate(m, cases, o);
  for (size_t i = 0; i < cases.size(); ++i) {
    EngineOptions alone = o;
    alone.num_blocks = 16;
    EXPECT_EQ(Generate(m, {cases[i]}, alone)[0], together[i]) << "request " << i;
  }
}

// scheduler.threads unset (0): the CPUs of this process's affinity mask
// shared among the workers the fleet file lists; a value given is kept.
TEST(SchedulerThreads, DefaultSharesTheCoresAmongTheFleetsWorkers) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const uint32_t cpus = static_cast<uint32_t>(CPU_COUNT(&set));
  auto threads = [](const std::string& yaml) {
    auto fleet = ParseFleetConfig(yaml, "x.yaml", "/tmp");
    EXPECT_TRUE(fleet.ok()) << fleet.status().ToString();
    return fleet.ok() ? EngineOptions::FromFleetConfig(*fleet).threads : 0u;
  };
  EXPECT_EQ(threads("model:\n  path: m\nboth:\n  replicas: 1\n"), cpus);
  EXPECT_EQ(threads("model:\n  path: m\nprefill:\n  replicas: 1\ndecode:\n  replicas: 1\n"),
            std::max(1u, cpus / 2));
  EXPECT_EQ(threads("model:\n  path: m\nprefill:\n  replicas: 64\ndecode:\n  replicas: 64\n"),
            std::max(1u, cpus / 128));
  EXPECT_EQ(threads("model:\n  path: m\nscheduler:\n  threads: 3\nboth:\n  replicas: 1\n"), 3u);
  auto bad = ParseFleetConfig("model:\n  path: m\nscheduler:\n  threads: 257\n", "x.yaml", "/tmp");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("threads"), std::string::npos) << bad.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(GreedyAndSeeded, GenerationInvarianceTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? std::string("seeded") : std::string("greedy");
                         });

}  // namespace
}  // namespace tandem::engine
