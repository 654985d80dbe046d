// The roofline timing model against numbers computed by hand (the comments
// show the arithmetic), the shipped shapes' parameter counts, the hardware
// table and the errors.
#include <gtest/gtest.h>

#include <span>
#include <utility>
#include <vector>

#include "common/config.h"
#include "sim/hardware_profile.h"
#include "sim/model_shape.h"
#include "sim/timing_model.h"

namespace tandem::sim {
namespace {

// hidden 4, intermediate 8, 2 layers, 2 heads of dim 2, 1 KV head, vocab 10.
// Per layer: q 4*2*2=16, k+v 2*4*1*2=16, o 2*2*4=16, mlp 3*4*8=96 -> 144;
// linear_params = 288. LM head 4*10 = 40. KV per token: 2*2 layers*1*2*2 B = 16.
ModelShape Toy() {
  auto s = ParseModelShape(R"({"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
      "max_position_embeddings": 64})", "toy");
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return *s;
}

HardwareProfile ToyHardware() {
  return HardwareProfile{"TOY", "toy", /*flops*/ 1000, /*B/s*/ 100, /*bytes*/ 1e6, "test"};
}

TimingModel ToyModel(double compute_eff = 1.0, double memory_eff = 1.0, uint32_t tp = 1) {
  TimingParams p;
  p.hardware = ToyHardware();
  p.shape = Toy();
  p.compute_efficiency = compute_eff;
  p.memory_efficiency = memory_eff;
  p.tensor_parallel = tp;
  auto m = TimingModel::Create(p);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

TEST(ModelShape, ToyCounts) {
  const ModelShape s = Toy();
  EXPECT_EQ(s.head_dim, 2u);
  EXPECT_EQ(s.linear_params(), 288u);
  EXPECT_EQ(s.step_weight_bytes(), (288u + 40u) * 2u);
  // 288 + embed 40 + LM head 40 + norms (2 layers * 2 * 4 + 4 = 20) = 388.
  EXPECT_EQ(s.total_params(), 388u);
  EXPECT_EQ(s.kv_bytes_per_token(), 16u);
}

TEST(ModelShape, ShippedShapes) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/";
  auto l8 = LoadModelShape(dir + "llama-3-8b/config.json");
  ASSERT_TRUE(l8.ok()) << l8.status().ToString();
  EXPECT_EQ(l8->name, "llama-3-8b");
  // 32 * (4096*4096*2 + 2*4096*1024 + 3*4096*14336) = 6,979,321,856
  EXPECT_EQ(l8->linear_params(), 6979321856ull);
  // + 2 * 128256 * 4096 (embedding, LM head) + 32*2*4096 + 4096 (norms) = 8,030,261,248
  EXPECT_EQ(l8->total_params(), 8030261248ull);
  EXPECT_EQ(l8->kv_bytes_per_token(), 131072u);  // 128 KiB, as DESIGN.md says
  auto l70 = LoadModelShape(dir + "llama-3-70b");  // a folder works too
  ASSERT_TRUE(l70.ok()) << l70.status().ToString();
  EXPECT_NEAR(static_cast<double>(l70->total_params()), 70.55e9, 0.01e9);
  EXPECT_EQ(l70->kv_bytes_per_token(), 327680u);
  auto q = LoadModelShape(dir + "qwen3-32b-like/config.json");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_NEAR(static_cast<double>(q->total_params()), 32.8e9, 0.1e9);
  EXPECT_EQ(q->kv_bytes_per_token(), 262144u);
}

TEST(ModelShape, ErrorsNameTheKey) {
  auto s = ParseModelShape(R"({"hidden_size": 4})", "x.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("x.json: missing key 'num_hidden_layers'"), std::string::npos)
      << s.status().message();
  s = ParseModelShape(R"({"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2,
      "num_attention_heads": 3, "num_key_value_heads": 2, "vocab_size": 10,
      "max_position_embeddings": 64})", "y.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("must divide"), std::string::npos);
  EXPECT_FALSE(LoadModelShape("/nonexistent/config.json").ok());
}

TEST(TimingModel, PrefillByHand) {
  const TimingModel m = ToyModel();
  // 3 new tokens, nothing cached, 1 logit row:
  //   matmuls 2*288*3 = 1728; attention 4*2*2*2 = 32 per pair * (0 + 3*4/2 = 6) = 192;
  //   LM head 2*4*10 = 80 -> 2000 FLOPs -> 2 s at 1000 FLOP/s.
  //   bytes: weights 656 + KV 16 * (0 + 3) = 704 -> 7.04 s at 100 B/s.
  const StepCost c = m.Prefill(3, 0);
  EXPECT_DOUBLE_EQ(c.flops, 2000);
  EXPECT_DOUBLE_EQ(c.bytes, 704);
  EXPECT_DOUBLE_EQ(c.compute_seconds, 2.0);
  EXPECT_DOUBLE_EQ(c.memory_seconds, 7.04);
  EXPECT_DOUBLE_EQ(c.seconds, 7.04);
  EXPECT_FALSE(c.compute_bound());
  // With 5 cached tokens: attention pairs 3*5 + 6 = 21 -> 672; 1728 + 672 + 80 = 2480.
  // bytes 656 + 16 * 8 = 784.
  const StepCost d = m.Prefill(3, 5);
  EXPECT_DOUBLE_EQ(d.flops, 2480);
  EXPECT_DOUBLE_EQ(d.bytes, 784);
}

// The pair cost the workers report for the TTFT prediction (docs/router.md,
// "Attention in the TTFT prediction") is what the timing model charges: a
// prefill chunk's FLOPs without the LM head = 2 * linear_params * (n +
// cost * pairs), pairs = n*c + n(n+1)/2.
TEST(ModelShape, PrefillPairCostIsTheTimingModelsAttentionShare) {
  const ModelShape toy = Toy();
  EXPECT_DOUBLE_EQ(toy.prefill_pair_cost(), 32.0 / 576);  // 4*2*2*2 / (2*288)
  const TimingModel m = ToyModel();
  for (const auto& [n, c] : std::vector<std::pair<uint64_t, uint64_t>>{{3, 0}, {3, 5}, {40, 17}}) {
    const SeqWork w{n, c, /*logit_rows=*/0};
    const double pairs = static_cast<double>(n * c + n * (n + 1) / 2);
    EXPECT_NEAR(m.Step(std::span(&w, 1)).flops,
                2.0 * 288 * (static_cast<double>(n) + toy.prefill_pair_cost() * pairs), 1e-6)
        << n << " after " << c;
  }
  // llama-3-8b: 4*32*32*128 / (2 * 6,979,321,856): a 32k-token prompt's
  // mean context (16k) adds 0.6 of its tokens' linear compute.
  auto l8 = LoadModelShape(std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/llama-3-8b");
  ASSERT_TRUE(l8.ok()) << l8.status().ToString();
  EXPECT_NEAR(l8->prefill_pair_cost(), 524288.0 / 13958643712.0, 1e-15);
  EXPECT_NEAR(l8->prefill_pair_cost() * 16384, 0.615, 0.001);
  EXPECT_EQ(ModelShape{}.prefill_pair_cost(), 0);
}

TEST(TimingModel, EfficiencyAndTensorParallelScaleTheRoofs) {
  const TimingModel half = ToyModel(0.5, 0.25, 1);
  const StepCost c = half.Prefill(3, 0);
  EXPECT_DOUBLE_EQ(c.compute_seconds, 4.0);    // 2000 / (1000 * 0.5)
  EXPECT_DOUBLE_EQ(c.memory_seconds, 28.16);   // 704 / (100 * 0.25)
  // tp 2: each rank reads half the weights ((144 + 20) * 2 = 328 B) and, the
  // one KV head being replicated, all the KV (48 B): 376 / 100 (the
  // all-reduces: parallel_model_test.cc).
  const TimingModel tp2 = ToyModel(1.0, 1.0, 2);
  EXPECT_DOUBLE_EQ(tp2.Prefill(3, 0).memory_seconds, 3.76);
}

TEST(TimingModel, DecodeBatchByHand) {
  const TimingModel m = ToyModel();
  // 2 sequences, 5 cached tokens each, 1 new token each:
  //   FLOPs 2*288*2 = 1152 + 32 * 2 * (5 + 1) = 384 + LM 2*80 = 160 -> 1696
  //   bytes 656 + 16 * 2 * 6 = 848
  const StepCost c = m.Decode(2, 5);
  EXPECT_DOUBLE_EQ(c.flops, 1696);
  EXPECT_DOUBLE_EQ(c.bytes, 848);
  EXPECT_DOUBLE_EQ(c.seconds, 8.48);
  // A mixed step is the sum of its parts' FLOPs and bytes, weights counted once.
  std::vector<SeqWork> mixed = {{3, 0, 1}, {1, 5, 1}, {1, 5, 1}};
  const StepCost x = m.Step(mixed);
  EXPECT_DOUBLE_EQ(x.flops, 2000 + 1696);
  EXPECT_DOUBLE_EQ(x.bytes, 656 + 48 + 192);
  EXPECT_DOUBLE_EQ(m.Step({}).seconds, 0.0);
}

TEST(TimingModel, KvCapacityAndTransfer) {
  const TimingModel m = ToyModel();
  // 1e6 B * 0.9 - 388 params * 2 B = 899,224 B / 16 B per token = 56,201 tokens.
  EXPECT_EQ(m.KvCapacityTokens(), 56201u);
  EXPECT_EQ(m.KvCapacityBlocks(16), 56201u / 16);
  // 1000 tokens * 16 B = 16,000 B = 128,000 bits at 1e6 bit/s = 0.128 s, + 0.5 s latency.
  EXPECT_DOUBLE_EQ(m.TransferSeconds(1000, LinkParams{1e6, 0.5}), 0.628);
  EXPECT_DOUBLE_EQ(m.TransferSeconds(0, LinkParams{1e6, 0.5}), 0.0);
}

TEST(TimingModel, Llama3_8bOnH100IsPlausible) {
  TimingParams p;
  p.hardware = *FindHardwareProfile("h100");
  p.shape = *LoadModelShape(std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/llama-3-8b");
  auto m = TimingModel::Create(p);
  ASSERT_TRUE(m.ok());
  // Decode, batch 1, 1000 cached tokens: bandwidth-bound.
  // bytes = (6,979,321,856 + 525,336,576) * 2 + 131,072 * 1001 = 15,140,518,336
  // / (3.35e12 * 0.8) = 5.649 ms
  const StepCost d = m->Decode(1, 1000);
  EXPECT_FALSE(d.compute_bound());
  EXPECT_NEAR(d.seconds, 15140519936.0 / 2.68e12, 1e-9);
  // Prefill of 2048 tokens: compute-bound, ~60 ms at 50 % of 989 TFLOP/s.
  const StepCost pf = m->Prefill(2048, 0);
  EXPECT_TRUE(pf.compute_bound());
  const double flops = 2.0 * 6979321856.0 * 2048 + 4.0 * 32 * 32 * 128 * (2048.0 * 2049 / 2) +
                       2.0 * 4096 * 128256;
  EXPECT_DOUBLE_EQ(pf.flops, flops);
  EXPECT_NEAR(pf.seconds, flops / (989e12 * 0.5), 1e-12);
  // KV: 80e9 * 0.9 - 8,030,261,248 * 2 B = 55,939,477,504 B / 131,072 = 426,784 tokens.
  EXPECT_EQ(m->KvCapacityTokens(), 426784u);
}

TEST(TimingModel, ErrorsNameTheLimit) {
  TimingParams p;
  p.hardware = ToyHardware();
  p.shape = Toy();
  p.compute_efficiency = 0;
  auto m = TimingModel::Create(p);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("compute_efficiency must be in (0, 1]"), std::string::npos);
  // Llama-3-70B (141 GB of bf16 weights) does not fit one H100.
  p.compute_efficiency = 0.5;
  p.hardware = *FindHardwareProfile("H100");
  p.shape = *LoadModelShape(std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/llama-3-70b");
  m = TimingModel::Create(p);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("raise tensor_parallel"), std::string::npos)
      << m.status().message();
  p.tensor_parallel = 4;
  EXPECT_TRUE(TimingModel::Create(p).ok());
}

TEST(HardwareProfile, DatasheetNumbersAndNames) {
  auto h100 = FindHardwareProfile("H100");
  ASSERT_TRUE(h100.ok());
  EXPECT_DOUBLE_EQ(h100->peak_flops, 989e12);
  EXPECT_DOUBLE_EQ(h100->memory_bytes_per_s, 3.35e12);
  EXPECT_DOUBLE_EQ(FindHardwareProfile("H200")->memory_bytes, 141e9);
  EXPECT_DOUBLE_EQ(FindHardwareProfile("a100")->peak_flops, 312e12);
  EXPECT_DOUBLE_EQ(FindHardwareProfile("L40S")->memory_bytes_per_s, 864e9);
  auto bad = FindHardwareProfile("B200");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("H100, H200, A100, L40S"), std::string::npos);
  // The config loader's list (src/common/config.cc) is the same.
  for (const auto& p : HardwareProfiles()) {
    auto cfg = ParseFleetConfig("model: {path: m, backend: sim}\nsim: {model_shape: s.json, profile: " +
                                    p.name + "}\nboth: {replicas: 1}\n",
                                "t.yaml", "/tmp");
    EXPECT_TRUE(cfg.ok()) << p.name << ": " << cfg.status().ToString();
  }
  EXPECT_EQ(HardwareProfiles().size(), 4u);
}

TEST(SimConfig, KeysAndErrors) {
  auto cfg = ParseFleetConfig(
      "model: {path: m, backend: sim, name: x}\n"
      "sim: {model_shape: shapes/a.json, profile: H200, tensor_parallel: 2, kv_scale: 64, "
      "link_gbps: 25, link_latency_us: 5, compute_efficiency: 0.4, memory_efficiency: 0.7}\n"
      "both: {replicas: 1}\n",
      "t.yaml", "/base");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EXPECT_EQ(cfg->sim.model_shape, "/base/shapes/a.json");
  EXPECT_EQ(cfg->sim.profile, "H200");
  EXPECT_EQ(cfg->sim.tensor_parallel, 2u);
  EXPECT_EQ(cfg->sim.kv_scale, 64u);
  EXPECT_DOUBLE_EQ(cfg->sim.link_gbps, 25);
  EXPECT_EQ(cfg->model.name, "x-simulated");  // every output of a sim fleet says so
  auto bad = ParseFleetConfig("model: {path: m, backend: sim}\nsim: {model_shape: a, kv_scale: 0, "
                              "profile: B200}\nboth: {replicas: 1}\n", "t.yaml", "/");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sim.kv_scale"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("sim.profile"), std::string::npos);
  auto missing = ParseFleetConfig("model: {path: m, backend: sim}\nboth: {replicas: 1}\n", "t.yaml", "/");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("needs a 'sim' section"), std::string::npos);
  auto stray = ParseFleetConfig("model: {path: m}\nsim: {model_shape: a}\nboth: {replicas: 1}\n",
                                "t.yaml", "/");
  ASSERT_FALSE(stray.ok());
  EXPECT_NE(stray.status().message().find("only read with model.backend 'sim'"), std::string::npos);
}

}  // namespace
}  // namespace tandem::sim
