// Model weights, converted once to f32 (or, for the cuda backend, the
// matrices to bf16) from the safetensors file(s) of a Hugging Face
// directory (model.safetensors, or model.safetensors.index.json with
// shards). f32, f16 and bf16 tensors are accepted. Every malformed
// file (truncated, overlapping or out-of-range offsets, missing tensor,
// wrong shape) gives an error naming the file and the tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/model_config.h"

namespace tandem::model {

// Row-major matrix in Hugging Face nn.Linear layout: [rows = out_features]
// [cols = in_features]; y = x * W^T.
struct Matrix {
  std::vector<float> data;  // [rows * cols]; empty when loaded as bf16
  uint32_t rows = 0;
  uint32_t cols = 0;
  // [rows * cols] bfloat16 bits when loaded with WeightFormat::kBf16 (then
  // `data` is empty): half the host memory of f32 for the cuda backend.
  std::vector<uint16_t> bf16;
};

// How LoadWeights stores matrices. kBf16: every Matrix in `bf16`, rounded
// to nearest even once from the stored dtype (bf16 files are copied bit for
// bit); vectors (norms, biases) stay f32 either way. Only the cuda backend
// takes kBf16 weights; the cpu backend refuses them (its packs need f32).
enum class WeightFormat { kF32, kBf16 };

struct LayerWeights {
  std::vector<float> input_layernorm;  // [hidden]
  Matrix q_proj;                       // [heads * head_dim][hidden]
  Matrix k_proj;                       // [kv_heads * head_dim][hidden]
  Matrix v_proj;                       // [kv_heads * head_dim][hidden]
  std::vector<float> q_bias;           // [heads * head_dim], empty without bias
  std::vector<float> k_bias;           // [kv_heads * head_dim], empty without bias
  std::vector<float> v_bias;           // [kv_heads * head_dim], empty without bias
  Matrix o_proj;                       // [hidden][heads * head_dim]
  // [hidden]; only Llama with attention_bias = true has it (Qwen2's o_proj
  // has no bias); empty otherwise.
  std::vector<float> o_bias;
  std::vector<float> post_attention_layernorm;  // [hidden]
  Matrix gate_proj;                    // [intermediate][hidden]
  Matrix up_proj;                      // [intermediate][hidden]
  Matrix down_proj;                    // [hidden][intermediate]
};

struct ModelWeights {
  Matrix embed_tokens;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> norm;  // [hidden]
  Matrix lm_head;           // [vocab][hidden]; empty (rows == 0) when tied to embed_tokens
};

// Tensor names follow transformers: model.embed_tokens.weight,
// model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias),
// model.layers.{i}.mlp.{gate,up,down}_proj.weight,
// model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight,
// lm_head.weight (absent or ignored when tied).
Result<ModelWeights> LoadWeights(const std::string& dir, const ModelConfig& config,
                                 WeightFormat format = WeightFormat::kF32);

// Host bytes the loaded tensors hold (matrices and vectors).
uint64_t HostBytes(const ModelWeights& w);

// Frees every tensor of `w` (it is left empty) and hands the freed heap
// pages back to the kernel (malloc_trim): once a backend holds its own copy
// (the cpu backend's packs, the cuda backend's device buffers), the loaded
// one is the model's size again in resident memory for nothing.
void ReleaseHostWeights(ModelWeights& w);

}  // namespace tandem::model
