// Rank 0's ParallelBackend in this process with its follower ranks as real
// `tandem rank` processes (shared-memory communicators, issue 18): every
// golden prompt of every fixture model in one batch, prefilled (one long
// prompt in two chunks) and then decoded greedily for several steps, gives
// logits bit-identical to the one-process cpu backend for TP 2, TP 4, PP 2
// (micro-batches in flight), TP 2 x PP 2 and, on the bundled model, PP 3 and
// TP 2 x PP 3. A follower killed with SIGKILL fails the next step with
// UNAVAILABLE naming the rank; followers whose rank 0 dies exit 1.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/kv_pool.h"
#include "engine/llama_forward.h"
#include "engine/parallel_backend.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/rank_processes.h"

namespace tandem::engine {
namespace {

constexpr uint32_t kBlockSize = 16;
constexpr uint32_t kDecodeSteps = 6;

struct Model {
  std::string dir;
  model::ModelConfig config;
  model::ModelWeights weights;
  std::vector<std::vector<uint32_t>> prompts;  // the golden cases' prompt ids
};

std::string ModelDir(const std::string& name) {
  return name == "tandem-kjv" ? std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv"
                              : std::string(TANDEM_SOURCE_DIR) + "/tests/fixtures/golden/" + name;
}

Model Load(const std::string& name) {
  Model m;
  m.dir = ModelDir(name);
  auto cfg = model::LoadModelConfig(m.dir);
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  m.config = *cfg;
  auto w = model::LoadWeights(m.dir, m.config);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  m.weights = std::move(*w);
  std::ifstream in(std::string(TANDEM_SOURCE_DIR) + "/tests/fixtures/golden/" + name +
                   "/golden.json");
  const auto golden = nlohmann::json::parse(in);
  for (const auto& c : golden.at("cases")) {
    m.prompts.push_back(c.at("prompt_ids").get<std::vector<uint32_t>>());
  }
  return m;
}

// One batch's chunks with their backing arrays.
struct Step {
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<SeqChunk> chunks;
};

// Drives one backend through the scenario, returning every step's logits.
class Scenario {
 public:
  explicit Scenario(const Model& m) : m_(m) {
    uint32_t next = 0;
    for (const auto& p : m.prompts) {
      const uint32_t need = static_cast<uint32_t>(p.size()) + kDecodeSteps;
      std::vector<uint32_t> blocks;
      for (uint32_t i = 0; i < (need + kBlockSize - 1) / kBlockSize; ++i) blocks.push_back(next++);
      tables_.push_back(std::move(blocks));
    }
    num_blocks_ = next;
  }
  uint32_t num_blocks() const { return num_blocks_; }

  // Prefill: the longest prompt in two chunks (two steps), the others in
  // the second step beside its second chunk; then greedy decode steps, all
  // sequences in one batch. Tokens chosen from `backend`'s own logits.
  std::vector<std::vector<float>> Run(ComputeBackend& backend) {
    const size_t n = m_.prompts.size();
    size_t longest = 0;
    for (size_t i = 0; i < n; ++i) {
      if (m_.prompts[i].size() > m_.prompts[longest].size()) longest = i;
    }
    std::vector<std::vector<float>> out;
    std::vector<uint32_t> pos(n, 0), last(n, 0);
    const auto& lp = m_.prompts[longest];
    const uint32_t half = static_cast<uint32_t>(lp.size()) / 2;
    if (half > 0) {
      Step s;
      s.tokens.emplace_back(lp.begin(), lp.begin() + half);
      s.chunks.push_back({s.tokens.back(), 0, tables_[longest], 0});
      out.push_back(Forward(backend, s));
      pos[longest] = half;
    }
    Step prefill;
    prefill.tokens.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      prefill.tokens.emplace_back(m_.prompts[i].begin() + pos[i], m_.prompts[i].end());
      prefill.chunks.push_back({prefill.tokens.back(), pos[i], tables_[i], 1});
      pos[i] = static_cast<uint32_t>(m_.prompts[i].size());
    }
    out.push_back(Forward(backend, prefill));
    for (uint32_t step = 0; step < kDecodeSteps; ++step) {
      const std::vector<float>& logits = out.back();
      Step d;
      d.tokens.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        const float* row = logits.data() + i * m_.config.vocab_size;
        last[i] = static_cast<uint32_t>(std::max_element(row, row + m_.config.vocab_size) - row);
        d.tokens.push_back({last[i]});
        d.chunks.push_back({d.tokens.back(), pos[i]++, tables_[i], 1});
      }
      out.push_back(Forward(backend, d));
    }
    return out;
  }

 private:
  std::vector<float> Forward(ComputeBackend& backend, const Step& s) {
    size_t rows = 0;
    for (const auto& c : s.chunks) rows += c.num_logits;
    std::vector<float> logits(rows * m_.config.vocab_size, -1.0f);
    Status st = backend.Forward(s.chunks, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return logits;
  }

  const Model& m_;
  std::vector<std::vector<uint32_t>> tables_;
  uint32_t num_blocks_ = 0;
};

// Rank 0 of `layout` in this process, ranks 1.. as `tandem rank` children.
struct Group {
  AlignedKvPoolAllocator alloc;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<parallel::RankProcesses> ranks;
  std::unique_ptr<ComputeBackend> backend;
};

std::unique_ptr<Group> StartGroup(const Model& m, const parallel::ParallelLayout& layout,
                                  uint32_t num_blocks) {
  static std::atomic<int> groups{0};
  auto g = std::make_unique<Group>();
  const std::string name = fmt::format("tandem-pbtest-{}-{}", getpid(), groups++);
  auto pool = KvPool::Create(ShardKvLayout(m.config, ShardSpec{layout, 0}, kBlockSize),
                             num_blocks, g->alloc);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  if (!pool.ok()) return nullptr;
  g->pool = std::move(*pool);
  auto ranks = parallel::RankProcesses::Start(layout.world(), [&](uint32_t rank) {
    return std::vector<std::string>{
        std::string(TANDEM_BINARY_DIR) + "/tandem", "rank", "--model", m.dir,
        "--tensor-parallel", std::to_string(layout.tp), "--pipeline-parallel",
        std::to_string(layout.pp), "--rank", std::to_string(rank), "--group", name,
        "--num-blocks", std::to_string(num_blocks), "--block-size", std::to_string(kBlockSize)};
  });
  EXPECT_TRUE(ranks.ok()) << ranks.status().ToString();
  if (!ranks.ok()) return nullptr;
  g->ranks = std::move(*ranks);
  ParallelBackendOptions o;
  o.layout = layout;
  o.group = name;
  o.join_timeout_ms = 60000;
  auto backend = CreateParallelBackend(m.config, m.weights, g->pool.get(), o);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  if (!backend.ok()) return nullptr;
  g->backend = std::move(*backend);
  return g;
}

struct Case {
  std::string model;
  parallel::ParallelLayout layout;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << parallel::ToString(c.layout); }

class ParallelBackendLogits : public ::testing::TestWithParam<Case> {};

TEST_P(ParallelBackendLogits, BitIdenticalToOneProcess) {
  const Case& c = GetParam();
  const Model m = Load(c.model);
  Scenario scenario(m);
  // The reference: the whole model in this process.
  AlignedKvPoolAllocator ref_alloc;
  auto ref_pool = KvPool::Create(ShardKvLayout(m.config, ShardSpec{}, kBlockSize),
                                 scenario.num_blocks(), ref_alloc);
  ASSERT_TRUE(ref_pool.ok());
  auto ref = CreateBackend("cpu", m.config, m.weights, ref_pool->get(), 1);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  const auto want = scenario.Run(**ref);

  auto group = StartGroup(m, c.layout, scenario.num_blocks());
  ASSERT_NE(group, nullptr);
  EXPECT_TRUE(group->backend->Supports(BackendFeature::kBatchInvariant));
  const auto got = scenario.Run(*group->backend);
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size()) << "step " << s;
    size_t differ = 0;
    float max_diff = 0;
    for (size_t i = 0; i < want[s].size(); ++i) {
      if (std::memcmp(&got[s][i], &want[s][i], sizeof(float)) != 0) {
        ++differ;
        max_diff = std::max(max_diff, std::abs(got[s][i] - want[s][i]));
      }
    }
    EXPECT_EQ(differ, 0u) << "step " << s << ": " << differ << " of " << want[s].size()
                          << " logits differ, max |diff| " << max_diff;
  }
  // The shutdown plan: every follower exits 0.
  group->backend.reset();
  Status st = group->ranks->WaitAll(30000);
  EXPECT_TRUE(st.ok()) << st.ToString();
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string model = info.param.model;
  std::replace(model.begin(), model.end(), '-', '_');
  return model + "_" + parallel::ToString(info.param.layout);
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (const char* model : {"tandem-kjv", "tiny-llama", "tiny-qwen2", "tiny-llama-bias"}) {
    for (parallel::ParallelLayout l : {parallel::ParallelLayout{2, 1}, parallel::ParallelLayout{4, 1},
                                       parallel::ParallelLayout{1, 2}, parallel::ParallelLayout{2, 2}}) {
      out.push_back({model, l});
    }
  }
  // Deeper pipelines (3 micro-batches in flight; uneven stages 2-2-1) on the
  // bundled model's 5 layers.
  out.push_back({"tandem-kjv", {1, 3}});
  out.push_back({"tandem-kjv", {2, 3}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ParallelBackendLogits, ::testing::ValuesIn(Cases()), CaseName);

TEST(ParallelBackend, KilledFollowerFailsTheStepNamingTheRank) {
  const Model m = Load("tiny-qwen2");
  const parallel::ParallelLayout layout{2, 2};
  auto group = StartGroup(m, layout, 16);
  ASSERT_NE(group, nullptr);
  std::vector<uint32_t> tokens{5, 6, 7}, table{0};
  std::vector<SeqChunk> batch{{tokens, 0, table, 1}};
  std::vector<float> logits(m.config.vocab_size);
  ASSERT_TRUE(group->backend->Forward(batch, logits).ok());
  const pid_t victim = group->ranks->pids()[1];  // rank 2: stage 1, tensor rank 0
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  std::vector<uint32_t> next{9};
  std::vector<SeqChunk> decode{{next, 3, table, 1}};
  Status st = group->backend->Forward(decode, logits);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("rank 2"), std::string::npos) << st.ToString();
  // Broken for good: the next step fails at once, the same way.
  Status again = group->backend->Forward(decode, logits);
  EXPECT_EQ(again.code(), StatusCode::kUnavailable) << again.ToString();
}

// Followers started by this process (so PR_SET_PDEATHSIG does not fire), rank
// 0 in a forked child that is killed with SIGKILL after one step: every
// follower notices through its communicators and exits 1 by itself.
TEST(ParallelBackend, FollowersExitNonZeroWhenRankZeroDies) {
  const Model m = Load("tiny-qwen2");
  const parallel::ParallelLayout layout{2, 2};
  const std::string name = fmt::format("tandem-pbtest-{}-orphans", getpid());
  auto ranks = parallel::RankProcesses::Start(layout.world(), [&](uint32_t rank) {
    return std::vector<std::string>{
        std::string(TANDEM_BINARY_DIR) + "/tandem", "rank", "--model", m.dir,
        "--tensor-parallel", "2", "--pipeline-parallel", "2", "--rank", std::to_string(rank),
        "--group", name, "--num-blocks", "16"};
  });
  ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t rank0 = fork();
  ASSERT_GE(rank0, 0);
  if (rank0 == 0) {
    // Rank 0: one step, say so, then wait to be killed.
    close(fds[0]);
    AlignedKvPoolAllocator alloc;
    auto pool = KvPool::Create(ShardKvLayout(m.config, ShardSpec{layout, 0}, kBlockSize), 16,
                               alloc);
    ParallelBackendOptions o;
    o.layout = layout;
    o.group = name;
    auto backend = CreateParallelBackend(m.config, m.weights, pool->get(), o);
    if (!backend.ok()) _exit(3);
    std::vector<uint32_t> tokens{5, 6, 7}, table{0};
    std::vector<SeqChunk> batch{{tokens, 0, table, 1}};
    std::vector<float> logits(m.config.vocab_size);
    const char ok = (*backend)->Forward(batch, logits).ok() ? 'y' : 'n';
    (void)!write(fds[1], &ok, 1);
    while (true) pause();
  }
  close(fds[1]);
  char ok = 0;
  ASSERT_EQ(read(fds[0], &ok, 1), 1);
  close(fds[0]);
  EXPECT_EQ(ok, 'y');
  ASSERT_EQ(kill(rank0, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(rank0, &status, 0), rank0);
  // Every follower exits on its own, non-zero (not killed: this process,
  // their parent, lives on).
  Status st = (*ranks)->WaitAll(30000);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("exited with status 1"), std::string::npos) << st.ToString();
}

// What a rank group cannot do is refused by Engine::Create at once (before
// waiting for followers that will never come), naming what is wrong.
TEST(ParallelBackend, EngineRefusesWhatARankGroupCannotDo) {
  const Model m = Load("tiny-qwen2");
  auto create = [&](EngineOptions o) { return Engine::Create(m.config, m.weights, std::move(o)); };
  EngineOptions o;
  o.num_blocks = 8;
  o.parallel = {2, 1};
  o.parallel_group = "never-joined";
  o.parallel_join_timeout_ms = 600000;  // a test that waited for it would time out first
  EngineOptions tiers = o;
  tiers.host_tier_blocks = 4;
  auto r = create(tiers);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("not built for a rank group (tp2pp1)"), std::string::npos)
      << r.status().ToString();
  EngineOptions cuda = o;
  cuda.backend = "cuda";
  r = create(cuda);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("backend 'cuda' has no rank group runtime"),
            std::string::npos)
      << r.status().ToString();
  EngineOptions split = o;
  split.parallel = {1, 3};
  r = create(split);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pipeline_parallel 3 exceeds num_hidden_layers 2"),
            std::string::npos)
      << r.status().ToString();
}

TEST(ParallelBackend, RefusesALayoutTheModelCannotSplit) {
  const Model m = Load("tiny-qwen2");
  AlignedKvPoolAllocator alloc;
  auto pool = KvPool::Create(ShardKvLayout(m.config, ShardSpec{}, kBlockSize), 4, alloc);
  ASSERT_TRUE(pool.ok());
  ParallelBackendOptions o;
  o.layout = {3, 1};
  o.group = "unused";
  auto b = CreateParallelBackend(m.config, m.weights, pool->get(), o);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("tensor_parallel 3 does not divide num_attention_heads 4"),
            std::string::npos)
      << b.status().ToString();
}

}  // namespace
}  // namespace tandem::engine
