// The roofline timing model of the simulated GPU (docs/sim.md has the
// formulas with a worked example). One engine step over a batch that mixes
// prefill chunks and decode tokens costs
//   FLOPs = 2 * linear_params * new_tokens                       (matmuls)
//         + 4 * layers * heads * head_dim * sum_i (n_i * c_i + n_i (n_i + 1) / 2)
//                                                                 (causal attention over
//                                                                  the cached prefix c_i)
//         + 2 * hidden * vocab * logit_rows                       (LM head)
//   bytes = step_weight_bytes + kv_bytes_per_token * sum_i (c_i + n_i)
//                                                                 (weights once; every
//                                                                  sequence's KV read,
//                                                                  new KV written)
//   seconds = max(FLOPs / (peak_flops * compute_efficiency),
//                 bytes / (memory_bw * memory_efficiency)) + step_overhead
// so a long prefill is compute-bound and a decode step is bandwidth-bound.
//
// A worker of tensor_parallel (tp) x pipeline_parallel (pp) simulated GPUs
// (issue 18; one process all the same): each rank computes and reads its
// stage's layers (parallel::StageLayers) and 1/tp of their heads, MLP
// columns and LM head (KV heads replicated when kv_heads < tp); each layer
// adds 2 ring all-reduces of [tokens][hidden] over the TP link, the last
// stage an all-gather of the logits, each stage boundary an activation send
// over the PP link. Ranks sit on nodes of gpus_per_node GPUs in rank order;
// a TP group or stage boundary that crosses nodes uses the inter-node link.
// With pp > 1 a step is split into m = min(pp, sequences) micro-batches; a
// decode-only step keeps them in flight (pp slots: the round trip of one
// micro-batch), a step carrying a prefill chunk pays fill and drain
// ((m + pp - 1) slots). link_model.h has the link formulas.
//
// Thread-safety: immutable after construction; any thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>
#include <string>

#include "common/status.h"
#include "sim/hardware_profile.h"
#include "sim/link_model.h"
#include "sim/model_shape.h"

namespace tandem::sim {

struct TimingParams {
  HardwareProfile hardware;
  ModelShape shape;
  uint32_t tensor_parallel = 1;        // GPUs per pipeline stage
  uint32_t pipeline_parallel = 1;      // pipeline stages per worker
  uint32_t gpus_per_node = 8;          // ranks fill nodes in rank order
  LinkClass intra_node_link = LinkClass::kNvlink;
  LinkClass inter_node_link = LinkClass::kRdma;
  double compute_efficiency = 0.5;     // achieved / peak FLOP/s (prefill MFU)
  double memory_efficiency = 0.8;      // achieved / peak memory bandwidth (decode)
  double gpu_memory_utilization = 0.9; // share of device memory for weights + KV (vLLM's)
  double step_overhead_s = 0.0;        // fixed cost per step (kernel launches, scheduling)
};

// One sequence's part of a step.
struct SeqWork {
  uint64_t new_tokens = 0;     // n: tokens computed this step
  uint64_t cached_tokens = 0;  // c: tokens already in the KV cache before them
  uint32_t logit_rows = 0;     // rows of the LM head (1 when the step samples)
};

struct StepCost {
  double flops = 0;            // the whole model's (all ranks together)
  double bytes = 0;
  // One rank's share of the whole batch at its roofs, summed over the
  // stages (with tp = pp = 1: FLOPs and bytes at the roofs).
  double compute_seconds = 0;
  double memory_seconds = 0;
  double seconds = 0;          // the step: roofs, communication, pipeline + overhead
  // Parallel workers (0 / 1 otherwise): TP all-reduces, the logits'
  // all-gather and PP sends inside one pipeline slot; the slot; micro-batches.
  double comm_seconds = 0;
  double slot_seconds = 0;
  uint32_t microbatches = 1;
  bool compute_bound() const { return compute_seconds >= memory_seconds; }
};

// A network link between a prefiller and a decoder.
struct LinkParams {
  double bits_per_s = 100e9;  // 0: infinitely fast
  double latency_s = 10e-6;   // per transfer
};

class TimingModel {
 public:
  // Checks the parameters (efficiencies in (0, 1], the layout against the
  // shape, and that each rank's weights fit its device's memory); errors
  // name the quantity and limit.
  static Result<TimingModel> Create(TimingParams params);

  const TimingParams& params() const { return p_; }

  StepCost Step(std::span<const SeqWork> batch) const;
  // A prompt alone: `prompt_tokens` computed in one step after `cached_tokens`.
  StepCost Prefill(uint64_t prompt_tokens, uint64_t cached_tokens = 0) const;
  // A decode step of `batch` sequences, each with `context_tokens` in its cache.
  StepCost Decode(uint64_t batch, uint64_t context_tokens) const;
  // The same for a fractional (mean) batch, >= 1: the planner's queueing
  // arithmetic. Equals Decode(b, c).seconds for whole b.
  double DecodeSeconds(double batch, uint64_t context_tokens) const;

  uint32_t world() const { return p_.tensor_parallel * p_.pipeline_parallel; }
  // Nodes the worker's ranks occupy, and the links its TP groups and stage
  // boundaries use (the slowest over the stages).
  uint32_t nodes() const;
  const LinkSpec& tp_link() const;
  const LinkSpec& pp_link() const;
  // Bytes of weights on the fullest rank.
  double MaxRankWeightBytes() const;

  // Device memory left for KV after the weights, in tokens and in blocks.
  uint64_t KvCapacityTokens() const;
  uint64_t KvCapacityBlocks(uint32_t block_size) const { return KvCapacityTokens() / block_size; }
  // KV capacity is the fullest rank's: tokens whose KV slice fits every rank.
  // Unscaled KV bytes of `tokens` tokens (what a real fleet would move).
  double KvBytes(uint64_t tokens) const {
    return static_cast<double>(tokens) * static_cast<double>(p_.shape.kv_bytes_per_token());
  }
  // Time to move `tokens` tokens' KV over `link` (latency + bytes / bandwidth).
  double TransferSeconds(uint64_t tokens, const LinkParams& link) const;

  // "H100 x1, llama-3-8b (8.0B params), compute eff 0.50, memory eff 0.80"
  std::string Describe() const;

 private:
  // Aggregated work of a group of sequences (a micro-batch).
  struct Work {
    double seqs = 0, new_tokens = 0, attn_pairs = 0, logits = 0, kv_tokens = 0;
    void Add(const Work& w);
  };
  struct StageTime {
    double compute = 0, memory = 0, comm = 0;
    double total() const;
  };
  explicit TimingModel(TimingParams p) : p_(std::move(p)) {}
  void Init();
  // One rank of `stage` running `w`: its roofs, and its all-reduces,
  // logits all-gather and (non-last stages) activation send.
  StageTime Stage(const Work& w, uint32_t stage) const;
  // A step over micro-batches `groups` (one group when pp == 1).
  StepCost FromGroups(const std::vector<Work>& groups, bool decode_only) const;
  double RankWeightBytes(uint32_t stage) const;
  double RankKvBytesPerToken(uint32_t stage) const;

  TimingParams p_;
  // Per stage: layers, TP nodes spanned, whether its send crosses nodes.
  std::vector<uint32_t> stage_layers_;
  std::vector<uint32_t> tp_nodes_;
  std::vector<bool> send_crosses_;
  uint32_t kv_heads_per_rank_ = 0;
};

}  // namespace tandem::sim
