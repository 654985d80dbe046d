// The sim backend inside a real engine: KV geometry and capacity from the
// simulated device, deterministic tokens (alone, batched, chunked, with
// prefix hits), eos drawn from the hash at sim.eos_probability, a prefill
// -> copy KV -> decode hand-off that continues only with the right bytes,
// and steps that last the modelled time.
#include "engine/sim_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "common/splitmix.h"
#include "engine/engine.h"
#include "model/model_config.h"

namespace tandem::engine {
namespace {

const std::string kShapes = std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/";

model::ModelConfig Tokenizer() {
  auto mc = model::LoadModelConfig(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  EXPECT_TRUE(mc.ok()) << mc.status().ToString();
  return *mc;
}

SimSetup MakeSetup(uint32_t kv_scale = 256) {
  SimConfig c;
  c.present = true;
  c.model_shape = kShapes + "llama-3-8b/config.json";
  c.kv_scale = kv_scale;
  auto s = PrepareSim(c, Tokenizer(), 16);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

// A device so fast that steps take no time: tests of outputs only.
sim::TimingModel Instant() {
  sim::TimingParams p;
  p.hardware = sim::HardwareProfile{"FAST", "test", 1e30, 1e30, 1e12, "test"};
  p.shape = *sim::LoadModelShape(kShapes + "llama-3-8b");
  return *sim::TimingModel::Create(p);
}

struct Outcome {
  std::vector<uint32_t> tokens;
  RequestOutput last;
};

GenerateRequest Req(const std::string& id, std::vector<uint32_t> prompt, uint32_t max_tokens,
                    std::map<std::string, Outcome>* runs, float temperature = 0) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = 11;
  r.on_output = [runs, id](const RequestOutput& o) {
    auto& run = (*runs)[id];
    run.tokens.insert(run.tokens.end(), o.token_ids.begin(), o.token_ids.end());
    run.last = o;
  };
  return r;
}

EngineOptions SimOptions(const sim::TimingModel* timing, uint32_t max_batched_tokens = 2048,
                         uint32_t blocks = 512, double eos_probability = 0) {
  EngineOptions o;
  o.backend = "sim";
  o.sim_timing = timing;
  o.num_blocks = blocks;
  o.scheduler.max_batched_tokens = max_batched_tokens;
  o.sim_eos_probability = eos_probability;
  return o;
}

std::unique_ptr<Engine> MakeSimEngine(const SimSetup& s, const sim::TimingModel* timing,
                                      uint32_t max_batched_tokens = 2048, uint32_t blocks = 512,
                                      double eos_probability = 0) {
  auto e = Engine::Create(s.storage_config, model::ModelWeights{},
                          SimOptions(timing, max_batched_tokens, blocks, eos_probability));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(e).value();
}

std::vector<uint32_t> Prompt(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> p(n);
  for (uint32_t i = 0; i < n; ++i) p[i] = 5 + (seed * 7919 + i * 104729) % 4000;
  return p;
}

TEST(SimSetup, GeometryAndCapacityFromTheSimulatedDevice) {
  const SimSetup s = MakeSetup();
  // 131,072 real bytes per token / 256 = 512 stored: one layer, one head,
  // head_dim 64 floats for K and 64 for V.
  EXPECT_EQ(s.real_kv_bytes_per_token, 131072u);
  EXPECT_EQ(s.stored_kv_bytes_per_token, 512u);
  EXPECT_DOUBLE_EQ(s.kv_scale, 256.0);
  EXPECT_EQ(s.storage_config.num_hidden_layers, 1u);
  EXPECT_EQ(s.storage_config.head_dim, 64u);
  EXPECT_EQ(s.storage_config.vocab_size, 4096u);  // the tokenizer's vocabulary
  EXPECT_EQ(s.storage_config.max_position_embeddings, 8192u);  // the simulated model's context
  EXPECT_EQ(s.num_blocks, 426784u / 16);  // H100: 426,784 tokens of KV (timing_model_test)
  EXPECT_NE(s.summary.find("SIMULATED"), std::string::npos);
  EXPECT_NE(s.summary.find("1/256"), std::string::npos);
  // A 70B model on one H100 is refused with the reason.
  SimConfig big;
  big.model_shape = kShapes + "llama-3-70b";
  auto r = PrepareSim(big, Tokenizer(), 16);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor_parallel"), std::string::npos);
  big.tensor_parallel = 2;
  big.profile = "H200";
  EXPECT_TRUE(PrepareSim(big, Tokenizer(), 16).ok());
}

// The ids the sim may draw from the hash: the vocabulary less eos and bos,
// ascending.
std::vector<uint32_t> AllowedIds(const model::ModelConfig& mc) {
  std::vector<uint32_t> allowed;
  for (uint32_t id = 0; id < mc.vocab_size; ++id) {
    const bool eos = std::find(mc.eos_token_ids.begin(), mc.eos_token_ids.end(), id) !=
                     mc.eos_token_ids.end();
    const bool bos = mc.bos_token_id >= 0 && id == static_cast<uint32_t>(mc.bos_token_id);
    if (!eos && !bos) allowed.push_back(id);
  }
  return allowed;
}

void ExpectTokensFollowTheRunningHash(const SimSetup& s, uint32_t head_dim) {
  ASSERT_EQ(s.storage_config.head_dim, head_dim);
  const sim::TimingModel fast = Instant();
  const model::ModelConfig& mc = s.storage_config;
  const std::vector<uint32_t> allowed = AllowedIds(mc);
  ASSERT_LT(allowed.size(), mc.vocab_size);  // some ids are excluded
  std::map<std::string, Outcome> runs;
  auto e = MakeSimEngine(s, &fast);
  for (uint32_t r = 0; r < 4; ++r) {
    const std::vector<uint32_t> prompt = Prompt(17 + 9 * r, 100 + r);
    const std::string id = "p" + std::to_string(r);
    ASSERT_TRUE(e->Submit(Req(id, prompt, 40, &runs)).ok());
    e->RunUntilIdle();
    uint64_t h = kSimHashSeed;
    uint32_t pos = 0;
    for (uint32_t t : prompt) h = SimHashStep(h, t, pos++);
    std::vector<uint32_t> want;
    for (uint32_t k = 0; k < 40; ++k) {
      const uint32_t t = allowed[SplitMix64(h) % allowed.size()];
      want.push_back(t);
      h = SimHashStep(h, t, pos++);
    }
    EXPECT_EQ(runs[id].tokens, want) << id;
  }
}

// The tokens are pinned to the sim's definition: token = the allowed ids
// (the vocabulary less eos and bos, ascending) indexed by SplitMix64 of the
// running hash modulo their count; the running hash chains over the prompt
// and every output token. Computed here from that definition alone. Also
// with an odd head_dim (kv_scale 3500: 38 stored bytes, head_dim 5), where
// every other position's words are only 4-byte aligned in the KV block
// (the sim copies them; under the asan preset's UBSan a uint64_t load there
// is a misaligned-load report: tools/asan_unit.sh).
TEST(SimBackend, TokensFollowTheRunningHashDefinition) {
  for (const uint32_t kv_scale : {256u, 3500u}) {
    SCOPED_TRACE(kv_scale);
    ExpectTokensFollowTheRunningHash(MakeSetup(kv_scale), kv_scale == 3500 ? 5u : 64u);
  }
}

// sim.eos_probability (session 28): an output token is the model's first
// eos id when SplitMix64(hash ^ kSimEosSalt) < p x 2^64, else the token as
// without it; the request ends there (kStop) unless it ignores eos (then it
// runs to max_tokens, eos among its tokens). Computed here from that
// definition for 32 requests at p = 1/8, where some end early and some run
// to max_tokens; p = 1 ends every request at its first token; a model with
// no eos id is refused.
TEST(SimBackend, EosProbabilityEndsRequestsAtTheHashesDraw) {
  const SimSetup s = MakeSetup();
  const sim::TimingModel fast = Instant();
  const model::ModelConfig& mc = s.storage_config;
  ASSERT_FALSE(mc.eos_token_ids.empty());
  const uint32_t eos = mc.eos_token_ids[0];
  const std::vector<uint32_t> allowed = AllowedIds(mc);
  constexpr uint32_t kMax = 24;
  auto e = MakeSimEngine(s, &fast, 2048, 512, 1.0 / 8);
  std::map<std::string, Outcome> runs;
  uint32_t ended_early = 0, ran_out = 0;
  for (uint32_t r = 0; r < 32; ++r) {
    const std::vector<uint32_t> prompt = Prompt(20 + r, 300 + r);
    for (const bool ignore : {false, true}) {
      std::string id = ignore ? "i" : "p";
      id += std::to_string(r);
      GenerateRequest req = Req(id, prompt, kMax, &runs);
      req.sampling.ignore_eos = ignore;
      ASSERT_TRUE(e->Submit(std::move(req)).ok());
      e->RunUntilIdle();
      uint64_t h = kSimHashSeed;
      uint32_t pos = 0;
      for (uint32_t t : prompt) h = SimHashStep(h, t, pos++);
      std::vector<uint32_t> want;
      while (want.size() < kMax) {
        const bool is_eos = SplitMix64(h ^ kSimEosSalt) < (uint64_t{1} << 61);  // 2^64 / 8
        const uint32_t t = is_eos ? eos : allowed[SplitMix64(h) % allowed.size()];
        want.push_back(t);
        if (is_eos && !ignore) break;
        h = SimHashStep(h, t, pos++);
      }
      EXPECT_EQ(runs[id].tokens, want) << id;
      const bool early = want.back() == eos && !ignore;
      EXPECT_EQ(runs[id].last.finish_reason, early ? FinishReason::kStop : FinishReason::kLength)
          << id;
      if (!ignore) (early ? ended_early : ran_out) += 1;
    }
  }
  EXPECT_GT(ended_early, 0u);
  EXPECT_GT(ran_out, 0u);
  auto always = MakeSimEngine(s, &fast, 2048, 512, 1.0);
  ASSERT_TRUE(always->Submit(Req("a", Prompt(30, 1), kMax, &runs)).ok());
  always->RunUntilIdle();
  EXPECT_EQ(runs["a"].tokens, std::vector<uint32_t>{eos});
  model::ModelConfig no_eos = s.storage_config;
  no_eos.eos_token_ids.clear();
  auto refused = Engine::Create(no_eos, model::ModelWeights{}, SimOptions(&fast, 2048, 64, 0.1));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("sim.eos_probability 0.1: the model"),
            std::string::npos)
      << refused.status().ToString();
}

TEST(SimBackend, SameRequestSameTokensAloneBatchedChunkedCached) {
  const SimSetup s = MakeSetup();
  const sim::TimingModel fast = Instant();
  const auto eos = s.storage_config.eos_token_ids;
  std::map<std::string, Outcome> alone, together;
  {
    auto e = MakeSimEngine(s, &fast);
    for (uint32_t i = 0; i < 6; ++i) {
      ASSERT_TRUE(e->Submit(Req("r" + std::to_string(i), Prompt(40 + 13 * i, i), 24, &alone)).ok());
      e->RunUntilIdle();
    }
    // The same prompt again: served from the prefix cache, same tokens.
    ASSERT_TRUE(e->Submit(Req("again", Prompt(40 + 13 * 5, 5), 24, &alone)).ok());
    e->RunUntilIdle();
    EXPECT_GT(alone["again"].last.cached_prompt_tokens, 0u);
    EXPECT_EQ(alone["again"].tokens, alone["r5"].tokens);
  }
  {
    auto e = MakeSimEngine(s, &fast, /*max_batched_tokens=*/32);  // chunked, all at once
    for (uint32_t i = 0; i < 6; ++i) {
      ASSERT_TRUE(e->Submit(Req("r" + std::to_string(i), Prompt(40 + 13 * i, i), 24, &together,
                                /*temperature=*/0.8f)).ok());
    }
    e->RunUntilIdle();
  }
  for (uint32_t i = 0; i < 6; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_EQ(alone[id].tokens.size(), 24u) << id;  // never eos: runs to max_tokens
    EXPECT_EQ(alone[id].tokens, together[id].tokens) << id;
    EXPECT_EQ(alone[id].last.finish_reason, FinishReason::kLength);
    for (uint32_t t : alone[id].tokens) {
      EXPECT_LT(t, 4096u);
      EXPECT_EQ(std::count(eos.begin(), eos.end(), t), 0);
    }
  }
  EXPECT_NE(alone["r0"].tokens, alone["r1"].tokens);  // different prompts, different tokens
}

TEST(SimBackend, DecoderContinuesFromTheTransferredKvBytes) {
  const SimSetup s = MakeSetup();
  const sim::TimingModel fast = Instant();
  const auto prompt = Prompt(70, 3);  // 4 full blocks + 6 tokens
  std::map<std::string, Outcome> ref, pre, dec;
  {
    auto e = MakeSimEngine(s, &fast);
    ASSERT_TRUE(e->Submit(Req("x", prompt, 16, &ref)).ok());
    e->RunUntilIdle();
  }
  for (bool corrupt : {false, true}) {
    auto prefiller = MakeSimEngine(s, &fast);
    auto decoder = MakeSimEngine(s, &fast);
    pre.clear();
    dec.clear();
    GenerateRequest pr = Req("x", prompt, 16, &pre);
    pr.prefill_only = true;
    ASSERT_TRUE(prefiller->Submit(pr).ok());
    prefiller->RunUntilIdle();
    ASSERT_EQ(pre["x"].last.finish_reason, FinishReason::kPrefillDone);
    auto res = decoder->Reserve("x", prompt);
    ASSERT_TRUE(res.ok());
    // What the transport does: copy every prompt block's bytes.
    const auto& src = pre["x"].last.block_ids;
    for (size_t b = 0; b < res->block_ids.size(); ++b) {
      auto from = prefiller->pool().block_bytes(src[b]);
      auto to = decoder->pool().block_bytes(res->block_ids[b]);
      std::memcpy(to.data(), from.data(), from.size());
    }
    if (corrupt) {  // one flipped byte in the last prompt token's slot
      auto last = decoder->pool().block_bytes(res->block_ids.back());
      last[(prompt.size() - 1) % 16 * 64 * 4] ^= std::byte{1};
    }
    ASSERT_TRUE(prefiller->ReleasePrefill("x").ok());
    const uint32_t first = pre["x"].tokens.at(0);
    ASSERT_TRUE(decoder->AddPrefilled(res->reservation_id, Req("x", prompt, 16, &dec), first).ok());
    decoder->RunUntilIdle();
    ASSERT_EQ(dec["x"].tokens.size(), 16u);
    if (corrupt) {
      EXPECT_NE(dec["x"].tokens, ref["x"].tokens) << "the decoder ignored the KV bytes";
    } else {
      EXPECT_EQ(dec["x"].tokens, ref["x"].tokens);
    }
  }
}

TEST(SimBackend, StepsLastTheModelledTime) {
  const SimSetup s = MakeSetup();
  std::vector<double> step_seconds;
  EngineOptions o;
  o.backend = "sim";
  o.sim_timing = s.timing.get();
  o.num_blocks = 512;
  o.scheduler.max_batched_tokens = 2048;
  o.on_step = [&](const StepStats& st) { step_seconds.push_back(st.seconds); };
  auto e = Engine::Create(s.storage_config, model::ModelWeights{}, o);
  ASSERT_TRUE(e.ok());
  std::map<std::string, Outcome> runs;
  ASSERT_TRUE((*e)->Submit(Req("p", Prompt(2048, 1), 3, &runs)).ok());
  (*e)->RunUntilIdle();
  // Step 1 computes the 2048-token prompt (it fits the budget), steps 2 and
  // 3 decode one token each after it.
  ASSERT_GE(step_seconds.size(), 3u);
  const double prefill = s.timing->Prefill(2048, 0).seconds;  // ~60 ms on an H100
  EXPECT_GT(prefill, 0.04);
  EXPECT_GE(step_seconds[0], prefill);  // lower bound only: the host may be slow
  const double decode = s.timing->Decode(1, 2048).seconds;  // ~5.7 ms
  EXPECT_GE(step_seconds[1], decode);
  EXPECT_LT(decode, prefill / 5);
}

// KV tiers on the sim backend: a prefix onboarded from the host tier gives
// the same tokens as computing it (the sim's tokens follow the KV bytes),
// and a step that onboards lasts at least the modelled PCIe copy.
TEST(SimBackend, HostTierPrefixGivesTheSameTokensAndChargesTheCopy) {
  const SimSetup s = MakeSetup();
  const sim::TimingModel fast = Instant();
  EngineOptions o;
  o.backend = "sim";
  o.sim_timing = &fast;
  o.num_blocks = 40;  // one 512-token prompt (33 blocks) at a time
  o.host_tier_blocks = 64;
  o.sim_host_bytes_per_s = 50e9;
  o.sim_kv_scale = s.kv_scale;
  auto e = Engine::Create(s.storage_config, model::ModelWeights{}, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  std::map<std::string, Outcome> runs;
  ASSERT_TRUE((*e)->Submit(Req("a", Prompt(512, 1), 4, &runs)).ok());
  (*e)->RunUntilIdle();
  ASSERT_TRUE((*e)->Submit(Req("b", Prompt(512, 2), 4, &runs)).ok());  // pushes a's blocks to host
  (*e)->RunUntilIdle();
  ASSERT_TRUE((*e)->Submit(Req("a2", Prompt(512, 1), 4, &runs)).ok());
  (*e)->RunUntilIdle();
  EXPECT_EQ(runs["a2"].tokens, runs["a"].tokens);
  EXPECT_EQ(runs["a2"].last.cached_prompt_tokens, 496u);  // 31 full blocks of 16, the last token computed
  const EngineStats st = (*e)->stats();
  // a's head stayed on the device, its tail (evicted first) came from host.
  EXPECT_GT(st.tier_hit_tokens[static_cast<size_t>(KvTier::kHost)], 0u);
  EXPECT_EQ(st.tier_hit_tokens[static_cast<size_t>(KvTier::kHost)] +
                st.tier_hit_tokens[static_cast<size_t>(KvTier::kDevice)],
            496u);
  EXPECT_GT(st.tier_evictions[static_cast<size_t>(KvTier::kDevice)], 0u);

  // The copy time alone: 1000 host blocks of the real size over 50 GB/s.
  KvLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = 1;
  layout.head_dim = s.storage_config.head_dim;
  layout.block_size = 16;
  AlignedKvPoolAllocator alloc;
  auto pool = KvPool::Create(layout, 4, alloc);
  ASSERT_TRUE(pool.ok());
  SimBackend b(s.storage_config, fast, pool->get());
  b.set_sleep(false);
  const double real_block = static_cast<double>(layout.block_bytes()) * s.kv_scale;
  b.set_tier_links(50e9, 7e9, real_block);
  const std::vector<uint32_t> tok = {7};
  const std::vector<uint32_t> table = {0};
  SeqChunk c;
  c.tokens = tok;
  c.block_table = table;
  c.num_logits = 1;
  c.onboarded_host_blocks = 1000;
  c.onboarded_disk_blocks = 10;
  std::vector<float> logits(s.storage_config.vocab_size);
  ASSERT_TRUE(b.Forward(std::span<const SeqChunk>(&c, 1), logits).ok());
  EXPECT_NEAR(b.last_step_seconds(), 1000 * real_block / 50e9 + 10 * real_block / 7e9, 1e-9);
  EXPECT_NEAR(real_block, 16.0 * 128 * 1024, 16.0 * 128 * 1024 * 0.01);  // Llama-3-8B: 2 MiB a block
}


// The engine takes the sim's hot tokens without logits rows when every
// sampled sequence's settings make the pick certain, and fills the rows
// otherwise (engine/backend.h one_hot_logits): both paths give the same
// tokens. A request at an absurd temperature in the batch forces the rows
// for every step it is in; the others' tokens do not change.
TEST(SimBackend, HotTokensAndFilledLogitsGiveTheSameTokens) {
  const SimSetup s = MakeSetup();
  const sim::TimingModel fast = Instant();
  std::map<std::string, Outcome> hot_only, with_rows;
  {
    auto e = MakeSimEngine(s, &fast);
    for (uint32_t i = 0; i < 4; ++i) {
      ASSERT_TRUE(e->Submit(Req("r" + std::to_string(i), Prompt(30 + 7 * i, i), 20, &hot_only,
                                /*temperature=*/i % 2 == 0 ? 0.0f : 0.7f)).ok());
    }
    e->RunUntilIdle();
  }
  {
    auto e = MakeSimEngine(s, &fast);
    GenerateRequest wild = Req("wild", Prompt(50, 9), 40, &with_rows, /*temperature=*/3e38f);
    ASSERT_TRUE(e->Submit(wild).ok());
    for (uint32_t i = 0; i < 4; ++i) {
      ASSERT_TRUE(e->Submit(Req("r" + std::to_string(i), Prompt(30 + 7 * i, i), 20, &with_rows,
                                /*temperature=*/i % 2 == 0 ? 0.0f : 0.7f)).ok());
    }
    e->RunUntilIdle();
  }
  for (uint32_t i = 0; i < 4; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_EQ(hot_only[id].tokens.size(), 20u) << id;
    EXPECT_EQ(hot_only[id].tokens, with_rows[id].tokens) << id;
  }
  // The wild request was sampled from the filled rows: at that temperature
  // every id is about equally likely, so its tokens are not the hot ones
  // a greedy run of its prompt gives.
  std::map<std::string, Outcome> greedy;
  {
    auto e = MakeSimEngine(s, &fast);
    ASSERT_TRUE(e->Submit(Req("wild", Prompt(50, 9), 40, &greedy)).ok());
    e->RunUntilIdle();
  }
  ASSERT_EQ(with_rows["wild"].tokens.size(), 40u);
  EXPECT_NE(with_rows["wild"].tokens, greedy["wild"].tokens);
}

}  // namespace
}  // namespace tandem::engine
