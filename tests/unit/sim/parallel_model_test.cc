// The sim's tensor- and pipeline-parallel model (issue 18) against numbers
// computed by hand from the documented formulas (docs/sim.md, "Tensor and
// pipeline parallelism"; link_model.h): ring all-reduce and all-gather per
// link class, the pipeline bubble, rank placement, per-rank roofs and KV
// capacity, and the config keys.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/config.h"
#include "engine/sim_backend.h"
#include "model/model_config.h"
#include "sim/link_model.h"
#include "sim/timing_model.h"

namespace tandem::sim {
namespace {

const std::string kShapes = std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/";

// hidden 4, intermediate 8, 2 layers, 2 heads of dim 2, 1 KV head, vocab 10
// (timing_model_test.cc: linear_params 288, LM head 40, 16 B of KV a token).
ModelShape Toy() {
  return *ParseModelShape(R"({"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
      "max_position_embeddings": 64})", "toy");
}

TimingModel ToyModel(uint32_t tp, uint32_t pp) {
  TimingParams p;
  p.hardware = HardwareProfile{"TOY", "toy", /*flops*/ 1000, /*B/s*/ 100, /*bytes*/ 1e6, "test"};
  p.shape = Toy();
  p.compute_efficiency = 1.0;
  p.memory_efficiency = 1.0;
  p.tensor_parallel = tp;
  p.pipeline_parallel = pp;
  auto m = TimingModel::Create(p);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

Result<TimingModel> Llama70b(uint32_t tp, uint32_t pp, uint32_t gpus_per_node, LinkClass inter) {
  TimingParams p;
  p.hardware = *FindHardwareProfile("H100");
  p.shape = *LoadModelShape(kShapes + "llama-3-70b");
  p.tensor_parallel = tp;
  p.pipeline_parallel = pp;
  p.gpus_per_node = gpus_per_node;
  p.inter_node_link = inter;
  return TimingModel::Create(p);
}

const LinkSpec& Nv() { return LinkSpecFor(LinkClass::kNvlink); }
const LinkSpec& Rdma() { return LinkSpecFor(LinkClass::kRdma); }
const LinkSpec& Eth() { return LinkSpecFor(LinkClass::kEthernet); }

TEST(LinkModel, PublishedNumbers) {
  EXPECT_DOUBLE_EQ(Nv().bytes_per_s, 450e9);  // NVLink 4: 900 GB/s both ways
  EXPECT_DOUBLE_EQ(LinkSpecFor(LinkClass::kPcie).bytes_per_s, 64e9);  // PCIe 5.0 x16
  EXPECT_DOUBLE_EQ(Rdma().bytes_per_s, 50e9);  // 400 Gb/s
  EXPECT_DOUBLE_EQ(Eth().bytes_per_s, 12.5e9);  // 100 GbE
  EXPECT_DOUBLE_EQ(Nv().hop_latency_s, 1.9e-6);
  EXPECT_DOUBLE_EQ(Rdma().hop_latency_s, 4.0e-6);
  EXPECT_EQ(*ParseLinkClass("RDMA", "x"), LinkClass::kRdma);
  EXPECT_EQ(*ParseLinkClass("ethernet", "x"), LinkClass::kEthernet);
  auto bad = ParseLinkClass("infiniband", "sim.inter_node_link");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sim.inter_node_link: unknown link class 'infiniband' "
                                        "(known: nvlink, pcie, rdma, ethernet)"),
            std::string::npos)
      << bad.status().message();
}

TEST(LinkModel, RingAllReduceByHand) {
  EXPECT_DOUBLE_EQ(RingAllReduceSeconds(1e6, 1, 1, Nv(), Rdma()), 0.0);
  // 8 ranks in one node over NVLink, 1 MB: 2*7 hops * 1.9 us + 2*7/8 * 1e6 / 450e9.
  EXPECT_NEAR(RingAllReduceSeconds(1e6, 8, 1, Nv(), Rdma()), 14 * 1.9e-6 + 1.75e6 / 450e9, 1e-15);
  // 8 ranks on 2 nodes: 2*(8-2) NVLink hops + 2*(2-1) network hops; the
  // network's bandwidth: RDMA 12*1.9 + 2*4 = 30.8 us + 1.75e6 / 50e9 = 35 us.
  EXPECT_NEAR(RingAllReduceSeconds(1e6, 8, 2, Nv(), Rdma()), 30.8e-6 + 35e-6, 1e-12);
  // Ethernet: 12*1.9 + 2*10 = 42.8 us + 1.75e6 / 12.5e9 = 140 us.
  EXPECT_NEAR(RingAllReduceSeconds(1e6, 8, 2, Nv(), Eth()), 42.8e-6 + 140e-6, 1e-12);
  // All-gather: half the steps. 4 ranks, 1 node, 4e5 B in all: 3 * 1.9 us + 3/4 * 4e5 / 450e9.
  EXPECT_NEAR(RingAllGatherSeconds(4e5, 4, 1, Nv(), Rdma()), 5.7e-6 + 3e5 / 450e9, 1e-15);
  EXPECT_NEAR(SendSeconds(1e6, Eth()), 10e-6 + 80e-6, 1e-15);
}

TEST(LinkModel, AllReduceIsMonotonicInLinkSpeed) {
  double last = 1e9;
  for (double gbps : {10.0, 100.0, 400.0, 1600.0, 7200.0}) {
    LinkSpec link{LinkClass::kRdma, "x", gbps * 1e9 / 8, 4e-6, "test"};
    const double t = RingAllReduceSeconds(2e6, 8, 2, Nv(), link);
    EXPECT_LT(t, last) << gbps;
    last = t;
  }
  // The four classes, slowest first, for cross-node and in-node rings.
  EXPECT_GT(RingAllReduceSeconds(1e6, 8, 2, Nv(), Eth()), RingAllReduceSeconds(1e6, 8, 2, Nv(), Rdma()));
  EXPECT_GT(RingAllReduceSeconds(1e6, 8, 2, Nv(), Rdma()), RingAllReduceSeconds(1e6, 8, 1, Nv(), Rdma()));
  EXPECT_GT(RingAllReduceSeconds(1e6, 8, 1, LinkSpecFor(LinkClass::kPcie), Rdma()),
            RingAllReduceSeconds(1e6, 8, 1, Nv(), Rdma()));
}

TEST(LinkModel, PipelineBubbleAndPlacement) {
  EXPECT_DOUBLE_EQ(PipelineSeconds(1.5, 4, 2), 7.5);  // (4 + 2 - 1) * 1.5
  EXPECT_DOUBLE_EQ(PipelineSeconds(2.0, 1, 4), 8.0);  // one micro-batch: all 4 stages in turn
  EXPECT_DOUBLE_EQ(PipelineSeconds(2.0, 0, 4), 0.0);
  EXPECT_EQ(NodesSpanned(0, 8, 8), 1u);
  EXPECT_EQ(NodesSpanned(0, 8, 4), 2u);
  EXPECT_EQ(NodesSpanned(4, 4, 4), 1u);
  EXPECT_EQ(NodesSpanned(2, 4, 4), 2u);
  EXPECT_EQ(NodesSpanned(0, 16, 8), 2u);
}

TEST(ParallelTiming, TensorParallelPrefillByHand) {
  const TimingModel m = ToyModel(2, 1);
  // Per rank, 3 new tokens: matmuls 2*288/2*3 = 864, attention 4*2*(2*2)/2 * 6 pairs = 96,
  // LM head 2*40/2 = 40 -> 1000 FLOPs = 1 s. Bytes: weights (144 + 20) * 2 = 328, KV: the one
  // KV head replicated -> 16 B * 3 = 48 -> 376 B = 3.76 s.
  // Comm: 2 layers * 2 all-reduces of 3*4*2 = 24 B over 2 NVLink ranks (2 hops * 1.9 us +
  // 24 / 450e9), the logits' all-gather of 10*2 = 20 B (1.9 us + 10 / 450e9).
  const double comm = 4 * (3.8e-6 + 24 / 450e9) + (1.9e-6 + 10 / 450e9);
  const StepCost c = m.Prefill(3, 0);
  EXPECT_DOUBLE_EQ(c.compute_seconds, 1.0);
  EXPECT_DOUBLE_EQ(c.memory_seconds, 3.76);
  EXPECT_NEAR(c.comm_seconds, comm, 1e-15);
  EXPECT_NEAR(c.seconds, 3.76 + comm, 1e-12);
  EXPECT_DOUBLE_EQ(c.flops, 2000);  // the model's total is unchanged
  // Memory per rank: 144 + norms 16 + embed 20 + final norm 4 + head 20 = 204 params = 408 B;
  // (1e6 * 0.9 - 408) / 16 B per token = 56,224 tokens.
  EXPECT_EQ(m.KvCapacityTokens(), 56224u);
  EXPECT_DOUBLE_EQ(m.MaxRankWeightBytes(), 408);
}

TEST(ParallelTiming, PipelineDecodeKeepsMicroBatchesInFlight) {
  const TimingModel m = ToyModel(1, 2);
  // 2 sequences, 5 cached: 2 micro-batches of 1. Stage 1 (last, the LM head) is the slowest:
  // FLOPs 2*144 + 4*1*4*6 + 2*40 = 464 -> 0.464 s; bytes 144*2 + 40*2 + 8 B * 6 = 416 -> 4.16 s.
  // Stage 0: 288 + 48 = 336 B -> 3.36 s + a send of 1*4*2 B (1.9 us + 8 / 450e9) < 4.16 s.
  const StepCost d = m.Decode(2, 5);
  EXPECT_EQ(d.microbatches, 2u);
  EXPECT_DOUBLE_EQ(d.slot_seconds, 4.16);
  EXPECT_DOUBLE_EQ(d.seconds, 2 * 4.16);  // pp slots: one micro-batch's round trip, no bubble
  EXPECT_DOUBLE_EQ(m.DecodeSeconds(2, 5), d.seconds);
  // One sequence: 1 micro-batch, the other stage idles (the bubble): 2 slots of 1 sequence.
  EXPECT_EQ(m.Decode(1, 5).microbatches, 1u);
  // A prompt of 3 (m = 1) fills and drains: stage 1: FLOPs 864 + 96 + 80, bytes 288 + 80 + 24
  // = 392 -> 3.92 s; (1 + 2 - 1) slots = 7.84 s.
  const StepCost p = m.Prefill(3, 0);
  EXPECT_DOUBLE_EQ(p.slot_seconds, 3.92);
  EXPECT_DOUBLE_EQ(p.seconds, 7.84);
  // A step mixing the prompt with 2 decodes: 2 micro-batches ({prompt}, {2 decodes}), fill and
  // drain: (2 + 2 - 1) slots.
  std::vector<SeqWork> mixed = {{1, 5, 1}, {3, 0, 1}, {1, 5, 1}};
  const StepCost x = m.Step(mixed);
  EXPECT_EQ(x.microbatches, 2u);
  EXPECT_DOUBLE_EQ(x.seconds, PipelineSeconds(x.slot_seconds, 2, 2));
  // KV per rank: its stage's 1 layer -> 8 B a token. Stage 1 holds 144 + 8 + 4 + 40 = 196
  // params = 392 B: (900,000 - 392) / 8 = 112,451 tokens.
  EXPECT_EQ(m.KvCapacityTokens(), 112451u);
}

TEST(ParallelTiming, Llama70bCrossNodeTensorParallelNeedsRdma) {
  // Decode of 32 sequences at 2,000 tokens of context on 8 H100s.
  auto in_node = Llama70b(8, 1, 8, LinkClass::kRdma);
  auto rdma = Llama70b(8, 1, 4, LinkClass::kRdma);
  auto eth = Llama70b(8, 1, 4, LinkClass::kEthernet);
  auto tp4pp2 = Llama70b(4, 2, 4, LinkClass::kEthernet);
  ASSERT_TRUE(in_node.ok() && rdma.ok() && eth.ok() && tp4pp2.ok()) << in_node.status().ToString();
  EXPECT_EQ(in_node->tp_link().name, "nvlink");
  EXPECT_EQ(rdma->tp_link().name, "rdma");
  EXPECT_EQ(eth->tp_link().name, "ethernet");
  EXPECT_EQ(eth->nodes(), 2u);
  EXPECT_EQ(tp4pp2->tp_link().name, "nvlink");
  EXPECT_EQ(tp4pp2->pp_link().name, "ethernet");
  // Same roofs, so the links decide: 160 all-reduces of 32 * 8192 * 2 = 524,288 B and one
  // all-gather of 32 * 128,256 * 2 B of logits per step.
  const double base = in_node->Decode(32, 2000).seconds;
  const double extra = 160 * (RingAllReduceSeconds(524288, 8, 2, Nv(), Eth()) -
                              RingAllReduceSeconds(524288, 8, 1, Nv(), Eth())) +
                       RingAllGatherSeconds(32 * 128256 * 2.0, 8, 2, Nv(), Eth()) -
                       RingAllGatherSeconds(32 * 128256 * 2.0, 8, 1, Nv(), Eth());
  EXPECT_NEAR(eth->Decode(32, 2000).seconds - base, extra, 1e-9);
  EXPECT_LT(base, rdma->Decode(32, 2000).seconds);
  EXPECT_LT(rdma->Decode(32, 2000).seconds, eth->Decode(32, 2000).seconds);
  // Memory decides the KV room: 8 ranks hold the same weights whether TP 8 or TP 4 x PP 2.
  EXPECT_NEAR(static_cast<double>(tp4pp2->KvCapacityTokens()),
              static_cast<double>(in_node->KvCapacityTokens()), 0.01 * in_node->KvCapacityTokens());
  // TP 4 alone holds the weights on half the GPUs: less than half the KV room.
  auto tp4 = Llama70b(4, 1, 8, LinkClass::kRdma);
  ASSERT_TRUE(tp4.ok());
  EXPECT_LT(2 * tp4->KvCapacityTokens(), in_node->KvCapacityTokens());
}

TEST(ParallelTiming, LayoutAndMemoryErrorsNameTheDimension) {
  TimingParams p;
  p.hardware = HardwareProfile{"TOY", "toy", 1000, 100, 1e6, "test"};
  p.shape = Toy();
  p.tensor_parallel = 3;
  auto m = TimingModel::Create(p);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("tensor_parallel 3 does not divide num_attention_heads 2"),
            std::string::npos)
      << m.status().message();
  auto one = Llama70b(1, 1, 8, LinkClass::kRdma);
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("raise tensor_parallel or pipeline_parallel"),
            std::string::npos)
      << one.status().message();
  EXPECT_TRUE(Llama70b(1, 4, 8, LinkClass::kRdma).ok());  // 35 GB a stage fits
}

TEST(ParallelConfig, RoleAndSimKeys) {
  auto cfg = ParseFleetConfig(
      "model: {path: m, backend: sim}\n"
      "sim: {model_shape: a.json, gpus_per_node: 4, intra_node_link: pcie, "
      "inter_node_link: ethernet}\n"
      "prefill: {replicas: 1, tensor_parallel: 8}\n"
      "decode: {replicas: 1, tensor_parallel: 4, pipeline_parallel: 2}\n",
      "t.yaml", "/base");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EXPECT_EQ(cfg->sim.gpus_per_node, 4u);
  EXPECT_EQ(cfg->sim.intra_node_link, "pcie");
  EXPECT_EQ(cfg->sim.inter_node_link, "ethernet");
  EXPECT_EQ(cfg->prefill.tensor_parallel, 8u);
  EXPECT_EQ(cfg->prefill.pipeline_parallel, 1u);
  EXPECT_EQ(cfg->decode.tensor_parallel, 4u);
  EXPECT_EQ(cfg->decode.pipeline_parallel, 2u);
  auto bad = ParseFleetConfig(
      "model: {path: m, backend: sim}\nsim: {model_shape: a, inter_node_link: ib}\n"
      "both: {replicas: 1, tensor_parallel: 0}\n",
      "t.yaml", "/");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sim.inter_node_link"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("both.tensor_parallel"), std::string::npos)
      << bad.status().message();
}

// The shipped fleets of the TP/PP experiment (configs/sim/llama-3-70b-*.yaml,
// bench/results/sim_tp_pp.md) load, and a sim worker built from each
// (PrepareSim with its role's keys) models the layout and links they name.
TEST(ParallelConfig, ShippedTpPpFleets) {
  struct Want {
    const char* file;
    uint32_t world;
    const char* describe;
  };
  const Want wants[] = {
      {"llama-3-70b-tp8", 8, "tp 8 x pp 1 on 1 node: TP over nvlink"},
      {"llama-3-70b-tp4pp2-2nodes", 8, "tp 4 x pp 2 on 2 nodes: TP over nvlink, PP over ethernet"},
      {"llama-3-70b-tp8-2nodes-ethernet", 8, "tp 8 x pp 1 on 2 nodes: TP over ethernet"},
      {"llama-3-70b-tp8-2nodes-rdma", 8, "tp 8 x pp 1 on 2 nodes: TP over rdma"},
  };
  uint64_t tp8_blocks = 0;
  for (const Want& w : wants) {
    auto cfg = LoadFleetConfig(std::string(TANDEM_SOURCE_DIR) + "/configs/sim/" + w.file + ".yaml");
    ASSERT_TRUE(cfg.ok()) << w.file << ": " << cfg.status().ToString();
    auto tokenizer = model::LoadModelConfig(cfg->model.path);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    auto setup = engine::PrepareSim(cfg->sim, *tokenizer, cfg->cache.block_size,
                                    cfg->both.tensor_parallel, cfg->both.pipeline_parallel);
    ASSERT_TRUE(setup.ok()) << w.file << ": " << setup.status().ToString();
    EXPECT_EQ(setup->timing->world(), w.world);
    EXPECT_NE(setup->summary.find(w.describe), std::string::npos) << setup->summary;
    // 8 GPUs hold the weights once whatever the split: the KV room is within 1 %.
    if (tp8_blocks == 0) tp8_blocks = setup->num_blocks;
    EXPECT_NEAR(static_cast<double>(setup->num_blocks), static_cast<double>(tp8_blocks),
                0.01 * static_cast<double>(tp8_blocks));
  }
  // The fleet-wide sim.tensor_parallel and a role's disagree: refused, naming both.
  auto cfg = LoadFleetConfig(std::string(TANDEM_SOURCE_DIR) + "/configs/sim/llama-3-70b-tp8.yaml");
  ASSERT_TRUE(cfg.ok());
  cfg->sim.tensor_parallel = 4;
  auto tokenizer = model::LoadModelConfig(cfg->model.path);
  auto bad = engine::PrepareSim(cfg->sim, *tokenizer, 16, 8, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sim.tensor_parallel (4) and the role's tensor_parallel (8)"),
            std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace tandem::sim
