// The Llama-family forward pass (Llama, Mistral, Qwen2 with q/k/v bias) over
// tandem's CPU kernels, on a flattened batch of tokens with attention per
// sequence over the paged KV pool:
//   embed → per layer: RmsNorm → q/k/v GEMM (+bias) → RoPE → WriteKv →
//   PagedAttention → o_proj → AddRmsNorm → gate/up → SiluMul → down →
//   residual; final norm on the rows that want logits → lm_head (or the
//   tied embedding).
//
// Model parallelism (issue 18, docs/parallelism.md "Layout and sharding"):
// one LlamaForward holds one rank's shard (ShardSpec) — Megatron style,
// q/k/v/gate/up column slices, o/down row slices + all-reduce, vocab-parallel
// embedding and LM head, the layers of its pipeline stage only. TP 1, 2 and 4
// give bit-identical logits: every row-parallel GEMM, in every
// configuration, reduces its K dimension as kTpReduceShards shard-sized
// partial GEMMs summed as the fixed tree ((p0 + p1) + (p2 + p3)) — a rank
// sums its own shards first, the communicator's AllReduceSum (same tree in
// rank order) sums the ranks.
//
// Thread-safety: Forward / ForwardStage are called by one thread at a time
// (the engine / rank thread); they drive `threads` (kernels' ThreadPool) and
// `tp_comm` from that thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "kernels/cpu/ops.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/communicator.h"
#include "parallel/parallel_layout.h"

namespace tandem::engine {

// Shard-sized partial GEMMs of every row-parallel GEMM (o_proj, down_proj):
// the largest CPU tensor-parallel degree whose logits are bit-identical to
// tp = 1. tp 1, 2, 4: a rank computes kTpReduceShards / tp shards. Any other
// tp (e.g. 8 on cuda): one partial per rank, summed by the communicator —
// correct, but not bit-identical to tp = 1.
inline constexpr uint32_t kTpReduceShards = 4;

// Which rank of which layout a LlamaForward holds.
struct ShardSpec {
  parallel::ParallelLayout layout;  // default tp = pp = 1: the whole model
  uint32_t rank = 0;                // 0 .. layout.world() - 1
};

// The dimensions a tensor/pipeline-parallel layout splits
// (parallel::CheckLayout), from the model's config.
parallel::ModelDims DimsOf(const model::ModelConfig& config);

// The KV pool geometry of `shard`'s rank: its stage's layers (local layer i
// = model layer StageLayers(...).begin + i) and its KV heads (TpKvHeads).
KvLayout ShardKvLayout(const model::ModelConfig& config, const ShardSpec& shard,
                       uint32_t block_size);

// Activations in and out of one pipeline stage's forward pass; T = tokens of
// the step, R = logit rows (sum of num_logits).
struct StageIo {
  // [T][hidden]: the residual stream entering the stage's first layer.
  // Empty on stage 0 (it embeds the tokens).
  std::span<const float> hidden_in;
  // [T][hidden]: the residual stream after the stage's last layer. Required
  // on non-last stages; unused on the last. May be the same memory as
  // hidden_in (read whole before anything is written).
  std::span<float> hidden_out;
  // [R][vocab] on the last stage: required on tensor rank 0 (the logits
  // all-gathered from every tensor rank); may be empty on the others (filled
  // too when large enough). Unused on other stages.
  std::span<float> logits;
};

class LlamaForward {
 public:
  // Checks shapes against the config and the layout (CheckLayout's message
  // for a layout that cannot split the model, GQA alignment of the rank's Q
  // heads onto its KV heads) and packs `shard`'s weights only. `consume`:
  // null, or `&weights` itself, whose tensors are then freed one by one as
  // they are copied (a load peaks near one copy of the model, not two);
  // after an error it may be partly freed.
  static Result<std::unique_ptr<LlamaForward>> Create(const model::ModelConfig& config,
                                                      const model::ModelWeights& weights,
                                                      ShardSpec shard = {},
                                                      model::ModelWeights* consume = nullptr);

  const model::ModelConfig& config() const { return config_; }
  const ShardSpec& shard() const { return shard_; }
  // Packed weights a step reads (the embedding table is not counted: a step
  // reads only its tokens' rows).
  size_t weight_bytes() const { return weight_bytes_; }
  // Model layers [begin, end) this shard holds.
  parallel::Range layers() const { return layers_range_; }

  // The whole model in one process (tp = pp = 1 only). `on_layer_done`
  // (optional) runs after each layer with the number of layers whose K/V
  // are written for every token of the batch.
  Status Forward(std::span<const SeqChunk> batch, const KvPool& kv, std::span<float> logits,
                 kernels::cpu::ThreadPool* threads,
                 const std::function<void(uint32_t)>& on_layer_done = {});

  // This rank's part of one step. `kv` has ShardKvLayout's geometry (block
  // ids are the same on every rank); `tp_comm` joins the stage's tensor
  // ranks in tensor-rank order (may be null when tp == 1); every tensor rank
  // of the stage calls ForwardStage with the same batch. `on_layer_done`
  // counts the stage's local layers.
  Status ForwardStage(std::span<const SeqChunk> batch, const KvPool& kv, StageIo io,
                      parallel::Communicator* tp_comm, kernels::cpu::ThreadPool* threads,
                      const std::function<void(uint32_t)>& on_layer_done = {});

 private:
  struct Layer {
    std::vector<float> input_norm, post_norm;  // [hidden]
    // q/k/v/gate/up: this rank's output rows; o/down: its input columns.
    kernels::cpu::PackedWeights q, k, v, o, gate, up, down;
    std::vector<float> q_bias, k_bias, v_bias;  // the rank's slice; empty without bias
    std::vector<float> o_bias;                  // [hidden], added after the all-reduce
  };
  LlamaForward() = default;
  Status CheckStage(std::span<const SeqChunk> batch, const KvPool& kv, const StageIo& io,
                    parallel::Communicator* tp_comm, size_t tokens) const;
  // Row-parallel GEMM + all-reduce + bias: out = x · w^T over the whole K.
  Status RowParallel(const float* x, const kernels::cpu::PackedWeights& w,
                     const std::vector<int>& k_bounds, const std::vector<float>& bias,
                     float* out, int T, parallel::Communicator* tp_comm,
                     kernels::cpu::ThreadPool* threads);

  model::ModelConfig config_;
  ShardSpec shard_;
  uint32_t tp_rank_ = 0, stage_ = 0;
  bool first_stage_ = true, last_stage_ = true;
  parallel::Range layers_range_, heads_, kv_heads_, vocab_;  // model indices
  uint32_t inter_ = 0;                                      // the rank's intermediate columns
  std::vector<int> o_bounds_, down_bounds_;  // local K bounds of the rank's shards

  std::vector<float> embed_;      // [vocab_.size()][hidden]; first stage only
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;  // [hidden]; last stage only
  kernels::cpu::PackedWeights lm_head_;  // [vocab_.size()][hidden]; last stage only
  std::vector<float> inv_freq_;    // [head_dim / 2]
  size_t weight_bytes_ = 0;

  // Scratch, grown as needed; T = tokens in the step, R = logit rows.
  std::vector<float> x_, h_, q_, k_, v_, attn_, o_;  // [T][...]
  std::vector<float> gate_, up_;                    // [T][inter_]
  std::vector<float> split_;                        // GemmSplitK partials
  std::vector<float> rows_;                         // [R][hidden]
  std::vector<float> part_logits_, gathered_;       // [R][vocab/tp], [tp][R][vocab/tp]
  std::vector<int32_t> positions_, slots_;          // [T]
  std::vector<int32_t> tables_;                     // concatenated block tables
  std::vector<kernels::AttentionSeq> seqs_;         // [num_seqs]
};

}  // namespace tandem::engine
