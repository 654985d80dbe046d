// The engine's `cuda` backend (label gpu): without a device it, and an
// Engine with backend "cuda", refuse to start with a clear error, and the
// graph cache's buckets and capture fallback work (these run everywhere);
// with one, the golden fixtures' greedy continuations (tests/fixtures/golden,
// weights loaded as bf16 the way workers load them) are reproduced token for
// token, the logits stay within a bf16 tolerance of transformers' f32 ones,
// in batch-invariant mode a prompt's logits are bit-identical whether it
// runs whole, in chunks, or beside other sequences, and decode steps through
// CUDA graphs give the same logit bits as eager steps.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_graphs.h"
#include "engine/engine.h"
#include "kernels/cuda/device.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::engine {
namespace {

// Logits of small models computed with bf16 weights and activations against
// transformers' f32: absolute error allowed (the fixtures' logits are O(10)).
constexpr double kBf16LogitTolerance = 0.25;

bool HaveDevice(std::string* why) {
  char buf[256] = "";
  const int n = kernels::cuda::DeviceCount(buf, sizeof(buf));
  *why = buf;
  return n > 0;
}

std::string Repo(const std::string& rel) { return std::string(TANDEM_SOURCE_DIR) + "/" + rel; }

struct Fixture {
  model::ModelConfig config;
  model::ModelWeights weights;
  nlohmann::json golden;
};

bool LoadFixture(const std::string& name, Fixture* f, std::string* why) {
  const std::string path = Repo("tests/fixtures/golden/" + name + "/golden.json");
  if (!std::filesystem::exists(path)) {
    *why = path + " is absent";
    return false;
  }
  std::ifstream in(path);
  f->golden = nlohmann::json::parse(in);
  const std::string dir = Repo(f->golden.at("model_dir").get<std::string>());
  auto cfg = model::LoadModelConfig(dir);
  if (!cfg.ok()) {
    *why = cfg.status().ToString();
    return false;
  }
  auto w = model::LoadWeights(dir, *cfg, model::WeightFormat::kBf16);  // as workers load for cuda
  if (!w.ok()) {
    *why = w.status().ToString();
    return false;
  }
  f->config = *cfg;
  f->weights = std::move(*w);
  return true;
}

// A backend over its own pool, handing out fresh blocks.
class Harness {
 public:
  Harness(const Fixture& f, bool batch_invariant, uint32_t num_blocks = 512, bool graphs = true)
      : vocab_(f.config.vocab_size) {
    KvLayout l{f.config.num_hidden_layers, f.config.num_key_value_heads, f.config.head_dim, 16};
    auto pool = KvPool::Create(l, num_blocks, alloc_);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    CudaBackendOptions o;
    o.batch_invariant = batch_invariant;
    o.cuda_graphs = graphs;
    auto b = CreateCudaBackend(f.config, f.weights, pool_.get(), o);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    if (b.ok()) backend_ = std::move(*b);
  }
  bool ok() const { return backend_ != nullptr; }
  std::vector<uint32_t> Blocks(uint32_t tokens) {
    std::vector<uint32_t> out;
    for (uint32_t i = 0; i < (tokens + 15) / 16; ++i) out.push_back(next_++);
    return out;
  }
  std::vector<float> Run(const std::vector<SeqChunk>& batch) {
    size_t rows = 0;
    for (const auto& c : batch) rows += c.num_logits;
    std::vector<float> logits(rows * vocab_, std::nanf(""));
    const Status st = backend_->Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return logits;
  }
  uint32_t vocab() const { return vocab_; }
  const ComputeBackend& backend() const { return *backend_; }

 private:
  uint32_t vocab_;
  AlignedKvPoolAllocator alloc_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<ComputeBackend> backend_;
  uint32_t next_ = 0;
};

uint32_t Greedy(const float* row, uint32_t vocab) {
  uint32_t best = 0;
  for (uint32_t j = 1; j < vocab; ++j) {
    if (row[j] > row[best]) best = j;
  }
  return best;
}

TEST(CudaBackend, WithoutADeviceStartUpFailsWithAClearError) {
  std::string why;
  if (HaveDevice(&why)) GTEST_SKIP() << "a CUDA device is present: this test is for machines without one";
  Fixture f;
  if (!LoadFixture("tiny-llama", &f, &why)) GTEST_SKIP() << why;
  AlignedKvPoolAllocator alloc;
  KvLayout l{f.config.num_hidden_layers, f.config.num_key_value_heads, f.config.head_dim, 16};
  auto pool = KvPool::Create(l, 8, alloc);
  ASSERT_TRUE(pool.ok());
  auto b = CreateCudaBackend(f.config, f.weights, pool->get(), {});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status().ToString();
  EXPECT_NE(b.status().message().find("no usable CUDA device"), std::string::npos)
      << b.status().ToString();
}

TEST(CudaBackend, EngineWithBackendCudaFailsAtStartUpWithoutADevice) {
  std::string why;
  if (HaveDevice(&why)) GTEST_SKIP() << "a CUDA device is present: this test is for machines without one";
  Fixture f;
  if (!LoadFixture("tiny-llama", &f, &why)) GTEST_SKIP() << why;
  EngineOptions o;
  o.backend = "cuda";
  o.num_blocks = 8;
  auto e = Engine::Create(f.config, f.weights, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition) << e.status().ToString();
  EXPECT_NE(e.status().message().find("no usable CUDA device"), std::string::npos)
      << e.status().ToString();
}

class CudaBackendGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaBackendGolden, GreedyTokensMatchTheFixture) {
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): GPU test not run";
  Fixture f;
  if (!LoadFixture(GetParam(), &f, &why)) GTEST_SKIP() << why;
  Harness h(f, /*batch_invariant=*/false);
  ASSERT_TRUE(h.ok());
  const uint32_t vocab = h.vocab();
  for (const auto& c : f.golden.at("cases")) {
    const auto prompt = c.at("prompt_ids").get<std::vector<uint32_t>>();
    const auto want = c.at("greedy_ids").get<std::vector<uint32_t>>();
    const auto blocks = h.Blocks(static_cast<uint32_t>(prompt.size() + want.size()));
    // Prefill with every position's logits, checked against the fixture's.
    SeqChunk p;
    p.tokens = prompt;
    p.block_table = blocks;
    p.num_logits = static_cast<uint32_t>(prompt.size());
    const auto logits = h.Run({p});
    const auto positions = c.at("logits_positions").get<std::vector<uint32_t>>();
    double worst = 0;
    for (size_t i = 0; i < positions.size(); ++i) {
      const auto row = c.at("logits")[i].get<std::vector<float>>();
      for (uint32_t j = 0; j < vocab; ++j) {
        const double d = std::fabs(double(logits[size_t{positions[i]} * vocab + j]) - row[j]);
        worst = std::max(worst, std::isnan(d) ? 1e9 : d);
      }
    }
    std::printf("[   INFO   ] %s, prompt of %zu tokens: worst |logit diff| vs f32 %.3g\n",
                GetParam().c_str(), prompt.size(), worst);
    EXPECT_LE(worst, kBf16LogitTolerance) << GetParam();
    // Decode one token per step (the decode kernel), teacher-forced: each
    // step is fed the fixture's previous token, so every step is compared
    // with transformers' f32 greedy choice at the same context. bf16 may
    // pick another token only where f32's choice is a near tie: with every
    // logit within kBf16LogitTolerance of f32's (checked above on the
    // prompt), the bf16 pick's logit can exceed that of f32's choice by at
    // most twice the tolerance. (A free-running bf16 greedy decode leaves
    // f32's path at the first such tie and is not comparable after it.)
    std::vector<uint32_t> seq = prompt;
    size_t same = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      std::vector<float> row;
      if (i == 0) {
        row.assign(&logits[(prompt.size() - 1) * vocab], &logits[prompt.size() * vocab]);
      } else {
        seq.push_back(want[i - 1]);
        SeqChunk d;
        d.tokens = std::span<const uint32_t>(seq).subspan(seq.size() - 1, 1);
        d.start_pos = static_cast<uint32_t>(seq.size() - 1);
        d.block_table = blocks;
        d.num_logits = 1;
        row = h.Run({d});
      }
      ASSERT_EQ(row.size(), size_t{vocab});
      const uint32_t pick = Greedy(row.data(), vocab);
      if (pick == want[i]) {
        ++same;
        continue;
      }
      const double gap = double(row[pick]) - double(row[want[i]]);
      EXPECT_LE(gap, 2 * kBf16LogitTolerance)
          << GetParam() << ", prompt of " << prompt.size() << " tokens, step " << i
          << ": bf16 picks " << pick << ", f32 picked " << want[i] << ", which bf16 puts " << gap
          << " below";
    }
    std::printf(
        "[   INFO   ] %s, prompt of %zu tokens: %zu of %zu teacher-forced greedy tokens equal "
        "f32's\n",
        GetParam().c_str(), prompt.size(), same, want.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaBackendGolden,
                         ::testing::Values("tiny-qwen2", "tiny-llama", "tandem-kjv"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

TEST(CudaBackendInvariance, BatchInvariantModeGivesTheSameLogitsWholeChunkedAndBatched) {
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): GPU test not run";
  Fixture f;
  if (!LoadFixture("tandem-kjv", &f, &why)) GTEST_SKIP() << why;
  Harness h(f, /*batch_invariant=*/true);
  ASSERT_TRUE(h.ok());
  std::vector<uint32_t> prompt(150), other(70);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + (i * 37) % 4000;
  for (size_t i = 0; i < other.size(); ++i) other[i] = 5 + (i * 91) % 4000;
  const uint32_t n = static_cast<uint32_t>(prompt.size());
  // Whole.
  auto b1 = h.Blocks(n);
  SeqChunk whole{prompt, 0, b1, 1};
  const auto a = h.Run({whole});
  // In chunks of 40 (the last chunk's last row gives the logits).
  auto b2 = h.Blocks(n);
  std::vector<float> b;
  for (uint32_t s = 0; s < n; s += 40) {
    const uint32_t len = std::min(40u, n - s);
    SeqChunk c{std::span<const uint32_t>(prompt).subspan(s, len), s, b2, s + len == n ? 1u : 0u};
    b = h.Run({c});
  }
  // Beside another sequence.
  auto b3 = h.Blocks(n);
  auto b4 = h.Blocks(static_cast<uint32_t>(other.size()));
  const auto c = h.Run({SeqChunk{other, 0, b4, 1}, SeqChunk{prompt, 0, b3, 1}});
  const std::vector<float> c_row(c.begin() + h.vocab(), c.end());
  EXPECT_EQ(a, b) << "whole vs chunked";
  EXPECT_EQ(a, c_row) << "alone vs batched";
}

// ---- CUDA graphs of decode steps ----

TEST(CudaGraphCache, Buckets) {
  EXPECT_EQ(CudaGraphCache::BatchBucket(0), 0u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(1), 1u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(3), 4u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(64), 64u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(65), 128u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(512), 512u);
  EXPECT_EQ(CudaGraphCache::BatchBucket(513), 0u);  // eager
  EXPECT_EQ(CudaGraphCache::BlockBucket(1), 32u);
  EXPECT_EQ(CudaGraphCache::BlockBucket(33), 64u);
  EXPECT_EQ(CudaGraphCache::BlockBucket(8192), 8192u);
}

// A capture that cannot happen (here: on the legacy default stream, which
// CUDA never captures; without a device, because there is none) falls back
// to eager steps with the reason recorded, and every step still runs.
TEST(CudaGraphCache, ImpossibleCaptureFallsBackToEagerWithTheReason) {
  CudaGraphCache cache(/*enabled=*/true);
  int runs = 0;
  auto enqueue = [&] {
    ++runs;
    return Status::Ok();
  };
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(cache.Run({4, 32}, 0, nullptr, enqueue).ok());
  // First sight eager; the capture's enqueue (no launch) then its fallback; two more eager.
  EXPECT_EQ(cache.stats().failed_captures, 1u);
  EXPECT_EQ(cache.stats().replays, 0u);
  EXPECT_EQ(cache.stats().eager_steps, 4u);
  EXPECT_NE(cache.stats().last_failure.find("cudaStreamBeginCapture"), std::string::npos)
      << cache.stats().last_failure;
  EXPECT_EQ(runs, 4);
  CudaGraphCache off(/*enabled=*/false);
  ASSERT_TRUE(off.Run({4, 32}, 0, nullptr, enqueue).ok());
  EXPECT_EQ(off.stats().eager_steps, 1u);
  EXPECT_EQ(off.stats().failed_captures, 0u);
}

TEST(CudaBackend, BadGraphSwitchIsRefusedNamingTheVariable) {
  Fixture f;
  std::string why;
  if (!LoadFixture("tiny-llama", &f, &why)) GTEST_SKIP() << why;
  AlignedKvPoolAllocator alloc;
  KvLayout l{f.config.num_hidden_layers, f.config.num_key_value_heads, f.config.head_dim, 16};
  auto pool = KvPool::Create(l, 8, alloc);
  ASSERT_TRUE(pool.ok());
  ::setenv("TANDEM_CUDA_GRAPHS", "sometimes", 1);
  auto b = CreateCudaBackend(f.config, f.weights, pool->get(), {});
  ::unsetenv("TANDEM_CUDA_GRAPHS");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status().ToString();
  EXPECT_NE(b.status().message().find("TANDEM_CUDA_GRAPHS"), std::string::npos)
      << b.status().ToString();
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Decode steps of batches 1, 3, 8, 13 and 33 (padded to 1, 4, 8, 16, 64),
// one context past a 512-token decode split and past the 32-block table
// bucket: graph replays give the eager steps' logits bit for bit, in both
// modes. The graph backend must really have replayed graphs.
class CudaGraphsVsEager : public ::testing::TestWithParam<bool> {};

TEST_P(CudaGraphsVsEager, DecodeLogitsAreBitIdentical) {
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): GPU test not run";
  Fixture f;
  if (!LoadFixture("tandem-kjv", &f, &why)) GTEST_SKIP() << why;
  Harness graph(f, GetParam(), 4096, /*graphs=*/true);
  Harness eager(f, GetParam(), 4096, /*graphs=*/false);
  ASSERT_TRUE(graph.ok() && eager.ok());
  const uint32_t vocab = graph.vocab();
  for (uint32_t n : {1u, 3u, 8u, 13u, 33u}) {
    SCOPED_TRACE("batch " + std::to_string(n));
    std::vector<std::vector<uint32_t>> seqs(n), tables(n);
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t len = i == 1 ? 600 : 5 + (i * 13) % 70;  // one context > 512 and > 32 blocks
      for (uint32_t k = 0; k < len; ++k) seqs[i].push_back(3 + (k * 31 + i * 7) % 4000);
      tables[i] = graph.Blocks(len + 8);
      ASSERT_EQ(eager.Blocks(len + 8), tables[i]);
    }
    std::vector<SeqChunk> pre;
    for (uint32_t i = 0; i < n; ++i) pre.push_back(SeqChunk{seqs[i], 0, tables[i], 1});
    auto lg = graph.Run(pre);
    ASSERT_TRUE(SameBits(lg, eager.Run(pre))) << "prefill";
    for (int step = 0; step < 5; ++step) {  // eager, capture, replays
      std::vector<SeqChunk> dec;
      for (uint32_t i = 0; i < n; ++i) {
        seqs[i].push_back(Greedy(&lg[size_t{i} * vocab], vocab));
        const uint32_t pos = static_cast<uint32_t>(seqs[i].size() - 1);
        dec.push_back(SeqChunk{std::span<const uint32_t>(seqs[i]).subspan(pos, 1), pos, tables[i], 1});
      }
      lg = graph.Run(dec);
      ASSERT_TRUE(SameBits(lg, eager.Run(dec))) << "decode step " << step;
    }
  }
  const CudaGraphStats gs = GetCudaGraphStats(graph.backend());
  const CudaGraphStats es = GetCudaGraphStats(eager.backend());
  EXPECT_TRUE(gs.enabled);
  EXPECT_EQ(gs.failed_captures, 0u) << gs.last_failure;
  EXPECT_GE(gs.captures, 5u);
  EXPECT_GE(gs.replays, 15u);
  EXPECT_FALSE(es.enabled);
  EXPECT_EQ(es.replays, 0u);
  EXPECT_EQ(es.eager_steps, 25u);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaGraphsVsEager, ::testing::Bool(), [](const auto& info) {
  return info.param ? std::string("batch_invariant") : std::string("default");
});

// Batch-invariant mode through graphs: every decode step's logits (a batch
// of 3 padded to 4) equal a fresh whole-prompt prefill of the same tokens.
TEST(CudaBackendInvariance, GraphDecodeStepsEqualWholePrefill) {
  std::string why;
  if (!HaveDevice(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): GPU test not run";
  Fixture f;
  if (!LoadFixture("tandem-kjv", &f, &why)) GTEST_SKIP() << why;
  Harness h(f, /*batch_invariant=*/true, 1024);
  ASSERT_TRUE(h.ok());
  const uint32_t vocab = h.vocab();
  std::vector<std::vector<uint32_t>> seqs(3), tables(3);
  for (uint32_t i = 0; i < 3; ++i) {
    for (uint32_t k = 0; k < 20 + 17 * i; ++k) seqs[i].push_back(3 + (k * 53 + i) % 4000);
    tables[i] = h.Blocks(static_cast<uint32_t>(seqs[i].size()) + 8);
  }
  std::vector<SeqChunk> pre;
  for (uint32_t i = 0; i < 3; ++i) pre.push_back(SeqChunk{seqs[i], 0, tables[i], 1});
  auto lg = h.Run(pre);
  for (int step = 0; step < 6; ++step) {
    std::vector<SeqChunk> dec;
    for (uint32_t i = 0; i < 3; ++i) {
      seqs[i].push_back(Greedy(&lg[size_t{i} * vocab], vocab));
      const uint32_t pos = static_cast<uint32_t>(seqs[i].size() - 1);
      dec.push_back(SeqChunk{std::span<const uint32_t>(seqs[i]).subspan(pos, 1), pos, tables[i], 1});
    }
    lg = h.Run(dec);
    for (uint32_t i = 0; i < 3; ++i) {
      const auto fresh = h.Run({SeqChunk{seqs[i], 0, h.Blocks(static_cast<uint32_t>(seqs[i].size())), 1}});
      ASSERT_EQ(0, std::memcmp(fresh.data(), &lg[size_t{i} * vocab], vocab * sizeof(float)))
          << "sequence " << i << ", step " << step;
    }
  }
  EXPECT_GT(GetCudaGraphStats(h.backend()).replays, 0u);
}

}  // namespace
}  // namespace tandem::engine
