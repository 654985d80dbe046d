// Sharded forward (issue 18, docs/parallelism.md "Layout and sharding"):
// every rank of a TP x PP layout is a thread with its own LlamaForward shard,
// its own KvPool of the rank-local geometry and a communicator joining its
// stage's tensor ranks. The logits of TP 2, TP 4, PP 2 and TP 2 x PP 2 are
// compared bit for bit (memcmp) with TP 1's — a prefill of several prompts in
// one batch, then 64 greedy decode steps through the KV pool — and the
// greedy tokens with the golden transformers tokens.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include <unistd.h>

#include "engine/llama_forward.h"
#include "kernels/cpu/ops.h"
#include "parallel/communicator.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using parallel::Communicator;
using parallel::ParallelLayout;
using testing::LoadedModel;

// ---------------------------------------------------------------------------
// The communicator a stage's tensor ranks share.
using CommFactory = std::function<Result<std::unique_ptr<Communicator>>(
    const std::string& group, int rank, int size)>;

CommFactory ShmComms() {
  return [](const std::string& group, int rank, int size) {
    return parallel::CreateShmCommunicator(group, rank, size, /*join_timeout_ms=*/30'000);
  };
}

// One rank: its shard, its KV pool, its communicator.
struct Rank {
  std::unique_ptr<LlamaForward> forward;
  AlignedKvPoolAllocator alloc;
  std::unique_ptr<KvPool> kv;
  std::unique_ptr<Communicator> comm;
};

struct Sequence {
  std::vector<uint32_t> tokens;  // prompt, then the greedy tokens
  std::vector<uint32_t> blocks;
  size_t prompt = 0;
};

constexpr uint32_t kBlockSize = 16;

// Runs `prompts` (prefilled together in one step, every position's logits)
// and then `decode_steps` greedy steps of all of them together under
// `layout`. Returns each step's logits (from the last stage's tensor rank 0)
// and, in `seqs`, the generated tokens.
std::vector<std::vector<float>> Run(const LoadedModel& m, ParallelLayout layout,
                                    const std::vector<std::vector<uint32_t>>& prompts,
                                    int decode_steps, std::vector<Sequence>* seqs,
                                    const CommFactory& comms) {
  const auto& cfg = m.config;
  const uint32_t world = layout.world();
  std::vector<Rank> ranks(world);
  uint32_t blocks_needed = 0;
  for (const auto& p : prompts) {
    blocks_needed += static_cast<uint32_t>(p.size() + decode_steps + kBlockSize) / kBlockSize;
  }
  for (uint32_t r = 0; r < world; ++r) {
    auto f = LlamaForward::Create(cfg, m.weights, ShardSpec{layout, r});
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return {};
    ranks[r].forward = std::move(*f);
    auto kv = KvPool::Create(ShardKvLayout(cfg, ShardSpec{layout, r}, kBlockSize), blocks_needed,
                             ranks[r].alloc);
    EXPECT_TRUE(kv.ok()) << kv.status().ToString();
    if (!kv.ok()) return {};
    ranks[r].kv = std::move(*kv);
  }
  if (layout.tp > 1) {  // each stage's tensor ranks join their group together
    std::vector<std::thread> joins;
    std::vector<Status> st(world);
    static int serial = 0;
    const std::string base = "tandem-tpfwd-" + std::to_string(getpid()) + "-" +
                             std::to_string(serial++);
    for (uint32_t r = 0; r < world; ++r) {
      joins.emplace_back([&, r] {
        auto c = comms(base + "-s" + std::to_string(layout.stage_of(r)),
                       static_cast<int>(layout.tp_rank_of(r)), static_cast<int>(layout.tp));
        if (!c.ok()) {
          st[r] = c.status();
          return;
        }
        ranks[r].comm = std::move(*c);
      });
    }
    for (auto& t : joins) t.join();
    for (const auto& s : st) EXPECT_TRUE(s.ok()) << s.ToString();
    if (::testing::Test::HasFailure()) return {};
  }

  seqs->assign(prompts.size(), {});
  uint32_t next_block = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto& s = (*seqs)[i];
    s.tokens = prompts[i];
    s.prompt = prompts[i].size();
    const uint32_t n = static_cast<uint32_t>(s.prompt + decode_steps + kBlockSize) / kBlockSize;
    for (uint32_t b = 0; b < n; ++b) s.blocks.push_back(next_block++);
  }
  // The reference (1 x 1) runs with a 2-thread kernel pool on this thread;
  // sharded ranks run on their own threads with the calling thread only.
  kernels::cpu::ThreadPool pool(2);

  std::vector<std::vector<float>> out;
  const uint32_t hidden = cfg.hidden_size, vocab = cfg.vocab_size;
  for (int step = 0; step <= decode_steps; ++step) {
    std::vector<SeqChunk> batch(seqs->size());
    size_t tokens = 0, rows = 0;
    for (size_t i = 0; i < seqs->size(); ++i) {
      const auto& s = (*seqs)[i];
      SeqChunk& c = batch[i];
      const size_t start = step == 0 ? 0 : s.tokens.size() - 1;
      c.tokens = std::span<const uint32_t>(s.tokens).subspan(start);
      c.start_pos = static_cast<uint32_t>(start);
      c.block_table = s.blocks;
      c.num_logits = static_cast<uint32_t>(c.tokens.size());
      tokens += c.tokens.size();
      rows += c.num_logits;
    }
    std::vector<float> logits(rows * vocab), hidden_a(tokens * hidden), hidden_b(tokens * hidden);
    for (uint32_t stage = 0; stage < layout.pp; ++stage) {
      StageIo io;
      if (stage > 0) io.hidden_in = (stage % 2 == 1 ? hidden_a : hidden_b);
      if (stage + 1 < layout.pp) io.hidden_out = (stage % 2 == 0 ? hidden_a : hidden_b);
      else io.logits = logits;
      if (layout.tp == 1) {
        Rank& rk = ranks[stage];
        kernels::cpu::ThreadPool::StepScope scope(&pool);
        const Status st = rk.forward->ForwardStage(batch, *rk.kv, io, nullptr, &pool);
        EXPECT_TRUE(st.ok()) << st.ToString();
        continue;
      }
      std::vector<std::thread> threads;
      std::vector<Status> st(layout.tp);
      // Each tensor rank writes its stage's output into its own buffer (as
      // each rank's StageRunner does): tensor rank 0's feeds the next stage,
      // the others' must equal it. One buffer shared by the ranks' threads
      // was a data race (ThreadSanitizer: memcpy at llama_forward_stage.cc
      // from every rank's thread).
      std::vector<std::vector<float>> outs(layout.tp);
      for (uint32_t t = 0; t < layout.tp; ++t) {
        threads.emplace_back([&, t] {
          Rank& rk = ranks[layout.rank_of(stage, t)];
          StageIo mine = io;
          if (t != 0) {
            mine.logits = {};  // only tensor rank 0 needs them
            if (!io.hidden_out.empty()) {
              outs[t].resize(io.hidden_out.size());
              mine.hidden_out = outs[t];
            }
          }
          st[t] = rk.forward->ForwardStage(batch, *rk.kv, mine, rk.comm.get(), nullptr);
        });
      }
      for (auto& th : threads) th.join();
      for (uint32_t t = 0; t < layout.tp; ++t) {
        EXPECT_TRUE(st[t].ok()) << "tensor rank " << t << ": " << st[t].ToString();
        if (t != 0 && !io.hidden_out.empty()) {
          EXPECT_EQ(std::memcmp(outs[t].data(), io.hidden_out.data(),
                                io.hidden_out.size() * sizeof(float)),
                    0)
              << "stage " << stage << ": tensor rank " << t << "'s output differs from rank 0's";
        }
      }
    }
    if (::testing::Test::HasFailure()) return out;
    // Greedy: the last row of each sequence.
    std::vector<int32_t> best(rows);
    kernels::cpu::Argmax(logits.data(), best.data(), static_cast<int>(rows),
                         static_cast<int>(vocab));
    size_t row = 0;
    for (size_t i = 0; i < seqs->size(); ++i) {
      row += batch[i].num_logits;
      if (step < decode_steps) (*seqs)[i].tokens.push_back(static_cast<uint32_t>(best[row - 1]));
    }
    out.push_back(std::move(logits));
  }
  return out;
}

struct Fixture {
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::vector<uint32_t>> golden;  // greedy ids; empty: none
};

// The cases of a golden.json whose prompts are at most `max_prompt` tokens.
Fixture Golden(const std::string& name, size_t max_prompt) {
  std::ifstream in(testing::RepoPath("tests/fixtures/golden/" + name + "/golden.json"));
  const auto g = nlohmann::json::parse(in);
  Fixture f;
  for (const auto& c : g.at("cases")) {
    auto p = c.at("prompt_ids").get<std::vector<uint32_t>>();
    if (p.size() > max_prompt) continue;
    f.prompts.push_back(std::move(p));
    f.golden.push_back(c.at("greedy_ids").get<std::vector<uint32_t>>());
  }
  return f;
}

void ExpectBitIdentical(const LoadedModel& m, const Fixture& fx, const CommFactory& comms,
                        const std::string& what) {
  constexpr int kSteps = 64;
  std::vector<Sequence> ref_seqs;
  const auto ref = Run(m, ParallelLayout{1, 1}, fx.prompts, kSteps, &ref_seqs, comms);
  ASSERT_EQ(ref.size(), size_t{kSteps + 1});
  for (size_t i = 0; i < fx.prompts.size(); ++i) {
    if (fx.golden[i].empty()) continue;
    const std::vector<uint32_t> gen(ref_seqs[i].tokens.begin() + ref_seqs[i].prompt,
                                    ref_seqs[i].tokens.end());
    const size_t n = std::min(gen.size(), fx.golden[i].size());
    EXPECT_EQ(std::vector<uint32_t>(gen.begin(), gen.begin() + n),
              std::vector<uint32_t>(fx.golden[i].begin(), fx.golden[i].begin() + n))
        << what << " tp1: case " << i << " greedy tokens differ from transformers";
  }
  for (ParallelLayout layout : {ParallelLayout{2, 1}, ParallelLayout{4, 1}, ParallelLayout{1, 2},
                                ParallelLayout{2, 2}}) {
    SCOPED_TRACE(what + " " + parallel::ToString(layout));
    std::vector<Sequence> seqs;
    const auto got = Run(m, layout, fx.prompts, kSteps, &seqs, comms);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t step = 0; step < ref.size(); ++step) {
      ASSERT_EQ(got[step].size(), ref[step].size());
      if (std::memcmp(got[step].data(), ref[step].data(), ref[step].size() * sizeof(float)) != 0) {
        double worst = 0;
        for (size_t j = 0; j < ref[step].size(); ++j) {
          worst = std::max(worst, std::fabs(double(got[step][j]) - ref[step][j]));
        }
        ADD_FAILURE() << "step " << step << ": logits differ from tp1pp1, max |diff| " << worst;
        break;
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(seqs[i].tokens, ref_seqs[i].tokens) << "sequence " << i;
    }
  }
}

// The bundled model (hidden 256, 8 heads / 2 KV heads: split at TP 2,
// replicated at TP 4; 5 layers: stages of 3 and 2): a 100-token prompt beside
// three golden prompts.
TEST(TpForwardTest, BundledModelBitIdenticalAcrossLayouts) {
  const LoadedModel& m = testing::BundledModel();
  Fixture fx = Golden("tandem-kjv", 64);
  std::ifstream in(testing::RepoPath("tests/fixtures/golden/tandem-kjv/golden.json"));
  const auto g = nlohmann::json::parse(in);
  for (const auto& c : g.at("cases")) {
    auto p = c.at("prompt_ids").get<std::vector<uint32_t>>();
    if (p.size() < 100) continue;
    p.resize(100);
    fx.prompts.push_back(std::move(p));
    fx.golden.emplace_back();
    break;
  }
  ASSERT_EQ(fx.prompts.back().size(), 100u);
  ExpectBitIdentical(m, fx, ShmComms(), "tandem-kjv");
}

// tiny-llama: 1 KV head (replicated on every tensor rank), Llama-3 RoPE,
// untied LM head; tiny-qwen2: q/k/v bias, tied embedding; tiny-llama-bias:
// o_proj bias (added once, after the all-reduce).
class TpFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TpFixtureTest, BitIdenticalAcrossLayoutsAndGoldenTokens) {
  ExpectBitIdentical(testing::TinyModel(GetParam()), Golden(GetParam(), 1000), ShmComms(),
                     GetParam());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TpFixtureTest,
                         ::testing::Values("tiny-llama", "tiny-qwen2", "tiny-llama-bias"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

TEST(TpForwardTest, LayoutThatCannotSplitTheModelIsRefused) {
  const LoadedModel& m = testing::BundledModel();
  auto f = LlamaForward::Create(m.config, m.weights, ShardSpec{ParallelLayout{3, 1}, 0});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("tensor_parallel 3 does not divide num_attention_heads 8"),
            std::string::npos)
      << f.status().ToString();
  auto g = LlamaForward::Create(m.config, m.weights, ShardSpec{ParallelLayout{1, 6}, 0});
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("pipeline_parallel 6 exceeds num_hidden_layers 5"),
            std::string::npos)
      << g.status().ToString();
  auto h = LlamaForward::Create(m.config, m.weights, ShardSpec{ParallelLayout{2, 1}, 2});
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("rank 2 is outside"), std::string::npos)
      << h.status().ToString();
}

TEST(TpForwardTest, ShardMisuseIsAnErrorNotACrash) {
  const LoadedModel& m = testing::TinyModel("tiny-qwen2");
  const ShardSpec spec{ParallelLayout{2, 1}, 1};
  auto f = LlamaForward::Create(m.config, m.weights, spec);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  AlignedKvPoolAllocator alloc, alloc_full, alloc_local;
  auto kv = KvPool::Create(ShardKvLayout(m.config, spec, kBlockSize), 4, alloc);
  ASSERT_TRUE(kv.ok());
  const std::vector<uint32_t> tokens{5, 6, 7};
  const std::vector<uint32_t> blocks{0};
  SeqChunk c;
  c.tokens = tokens;
  c.block_table = blocks;
  c.num_logits = 1;
  // tp 2 without a communicator.
  Status st = (*f)->ForwardStage({&c, 1}, **kv, StageIo{}, nullptr, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("communicator"), std::string::npos) << st.ToString();
  // The whole-model entry point on a shard.
  std::vector<float> logits(m.config.vocab_size);
  st = (*f)->Forward({&c, 1}, **kv, logits, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  // A pool of the whole model's geometry on a rank holding half the KV heads.
  auto full = KvPool::Create(ShardKvLayout(m.config, ShardSpec{}, kBlockSize), 4, alloc_full);
  ASSERT_TRUE(full.ok());
  auto whole = LlamaForward::Create(m.config, m.weights, ShardSpec{ParallelLayout{1, 2}, 1});
  ASSERT_TRUE(whole.ok());
  std::vector<float> hidden(tokens.size() * m.config.hidden_size);
  st = (*whole)->ForwardStage({&c, 1}, **full, StageIo{hidden, {}, logits}, nullptr, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("KV pool geometry"), std::string::npos) << st.ToString();
  // Stage 1 of 2 without its input activations.
  auto local = KvPool::Create(ShardKvLayout(m.config, ShardSpec{ParallelLayout{1, 2}, 1},
                                            kBlockSize),
                              4, alloc_local);
  ASSERT_TRUE(local.ok());
  st = (*whole)->ForwardStage({&c, 1}, **local, StageIo{{}, {}, logits}, nullptr, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("hidden_in"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace tandem::engine
