// The shape of a simulated model, read from a Hugging Face config.json
// (only sizes: no weights, no tokenizer). Counts parameters, weight bytes
// and KV bytes per token for the timing model.
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace tandem::sim {

struct ModelShape {
  std::string name;  // the file's folder name, e.g. "llama-3-8b"
  uint64_t hidden_size = 0;
  uint64_t intermediate_size = 0;
  uint64_t num_layers = 0;
  uint64_t num_heads = 0;
  uint64_t num_kv_heads = 0;
  uint64_t head_dim = 0;  // explicit, else hidden_size / num_heads
  uint64_t vocab_size = 0;
  uint64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  uint64_t weight_dtype_bytes = 2;  // bf16
  uint64_t kv_dtype_bytes = 2;      // bf16

  // Parameters of the per-layer matmuls (q, k, v, o, gate, up, down) over
  // all layers: each token costs 2 FLOPs per such parameter.
  uint64_t linear_params() const;
  // What one causal-attention (query, key) pair of a prefill costs in
  // tokens of linear-layer compute: its FLOPs (4 * layers * heads *
  // head_dim: QK^T and AV) over a token's (2 * linear_params). A prompt of
  // L tokens after C cached ones then costs (L - C) + cost * (L(L+1) -
  // C(C+1)) / 2 such tokens (the TTFT prediction, docs/router.md
  // "Attention in the TTFT prediction"); 0 for an empty shape.
  double prefill_pair_cost() const;
  // Every parameter (embedding, layers, LM head unless tied; norms).
  uint64_t total_params() const;
  // Bytes one forward step reads: the linear layers plus the LM head.
  uint64_t step_weight_bytes() const;
  // Bytes the weights occupy in device memory.
  uint64_t resident_weight_bytes() const { return total_params() * weight_dtype_bytes; }
  // K and V of every layer for one token.
  uint64_t kv_bytes_per_token() const {
    return 2 * num_layers * num_kv_heads * head_dim * kv_dtype_bytes;
  }
};

// Reads PATH (a config.json, or a folder holding one). Errors name the file
// and the missing or bad key.
Result<ModelShape> LoadModelShape(const std::string& path);
// Same, from JSON text; `name` is used for the shape's name and in errors.
Result<ModelShape> ParseModelShape(const std::string& json_text, const std::string& name);

}  // namespace tandem::sim
