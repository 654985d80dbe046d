// The Llama-family forward pass (Llama, Mistral, Qwen2 with q/k/v bias) over
// tandem's CPU kernels, on a flattened batch of tokens with attention per
// sequence over the paged KV pool:
//   embed → per layer: RmsNorm → q/k/v GEMM (+bias) → RoPE → WriteKv →
//   PagedAttention → o_proj → AddRmsNorm → gate/up → SiluMul → down →
//   residual; final norm on the rows that want logits → lm_head (or the
//   tied embedding).
//
// Thread-safety: Forward is called by one thread at a time (the engine
// thread); it drives `pool` (kernels' ThreadPool) from that thread.
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

namespace tandem::engine {

class LlamaForward {
 public:
  // Checks shapes against the config and packs the weights.
  static Result<std::unique_ptr<LlamaForward>> Create(const model::ModelConfig& config,
                                                      const model::ModelWeights& weights);

  const model::ModelConfig& config() const { return config_; }
  size_t weight_bytes() const { return weight_bytes_; }

  // `on_layer_done` (optional) runs after each layer with the number of
  // layers whose K/V are written for every token of the batch.
  Status Forward(std::span<const SeqChunk> batch, const KvPool& kv, std::span<float> logits,
                 kernels::cpu::ThreadPool* threads,
                 const std::function<void(uint32_t)>& on_layer_done = {});

 private:
  struct Layer {
    std::vector<float> input_norm, post_norm;  // [hidden]
    kernels::cpu::PackedWeights q, k, v, o, gate, up, down;
    std::vector<float> q_bias, k_bias, v_bias, o_bias;  // empty without bias
  };
  LlamaForward() = default;

  model::ModelConfig config_;
  std::vector<float> embed_;      // [vocab][hidden]
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;  // [hidden]
  kernels::cpu::PackedWeights lm_head_;  // [vocab][hidden]
  std::vector<float> inv_freq_;    // [head_dim / 2]
  size_t weight_bytes_ = 0;

  // Scratch, grown as needed; T = tokens in the step, R = logit rows.
  std::vector<float> x_, h_, q_, k_, v_, attn_, o_;  // [T][...]
  std::vector<float> gate_, up_;                    // [T][intermediate]
  std::vector<float> rows_;                         // [R][hidden]
  std::vector<int32_t> positions_, slots_;          // [T]
  std::vector<int32_t> tables_;                     // concatenated block tables
  std::vector<kernels::AttentionSeq> seqs_;         // [num_seqs]
};

}  // namespace tandem::engine
