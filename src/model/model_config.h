// A Hugging Face Llama-family model's shape, read from config.json (and
// generation_config.json for end-of-sequence ids). Supports
// LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM; RoPE as written
// by transformers 4 (rope_theta, rope_scaling incl. "llama3") and
// transformers 5 (rope_parameters).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::model {

struct RopeConfig {
  double theta = 10000.0;
  // "default" | "linear" | "llama3" (others are refused at load time).
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  uint32_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  uint32_t vocab_size = 0;
  uint32_t hidden_size = 0;
  uint32_t intermediate_size = 0;
  uint32_t num_hidden_layers = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;  // GQA: divides num_attention_heads
  uint32_t head_dim = 0;             // explicit or hidden_size / num_attention_heads
  uint32_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v bias (Qwen2: always true)
  std::string torch_dtype;      // as stored: float32 | float16 | bfloat16
  std::vector<uint32_t> eos_token_ids;  // from generation_config.json, else config.json
  int64_t bos_token_id = -1;            // -1: none
  // Sliding-window attention width in tokens (Mistral, Qwen2 with
  // use_sliding_window); 0: full attention.
  uint32_t sliding_window = 0;
};

// Reads DIR/config.json and, when present, DIR/generation_config.json.
// Errors name the file and the key ("config.json: 'num_key_value_heads' (3)
// must divide 'num_attention_heads' (8)").
Result<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace tandem::model
