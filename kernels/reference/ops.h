// Plain-loop reference of every tandem kernel: the specification that the
// optimized kernels (kernels/cpu, kernels/cuda) are tested against.
//
// Conventions (shared with tandem::kernels::cpu):
// - Row-major f32 tensors, raw pointers, sizes in elements; a shape comment
//   on every parameter. Outputs never alias inputs unless stated ("in/out").
// - Reductions accumulate in double here (the reference aims at the exact
//   value); optimized kernels accumulate in f32 and are compared with a
//   stated per-op tolerance.
// - Infallible math returns void; callers check shapes (these functions
//   assume m, n, k >= 0 and valid pointers).
// - Any thread may call any function; calls on distinct outputs may run
//   concurrently.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/reference/kv_cache_view.h"

namespace tandem::kernels {

// One sequence's part of a batched attention call. Its q_len query rows are
// consecutive in q/out, following the previous sequence's rows; the query in
// row r of this sequence sits at position q_start + r and attends to keys
// 0 .. q_start + r (causal), which must already be in the cache.
struct AttentionSeq {
  const int32_t* block_table = nullptr;  // [ceil((q_start + q_len) / block_size)] block ids
  int q_start = 0;                       // position of the first query row
  int q_len = 0;                         // query rows (1 for a decode step)
};

// Llama-3 style frequency scaling (rope_scaling.rope_type == "llama3").
struct RopeLlama3Scaling {
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 8192;
};

namespace ref {

// y[i][j] = sum_k x[i][k] * w[j][k] + (bias ? bias[j] : 0)   (HF Linear layout)
void Gemm(const float* x,     // [m][k]
          const float* w,     // [n][k]
          const float* bias,  // [n] or nullptr
          float* y,           // [m][n]
          int m, int n, int k);

// out[i][j] = x[i][j] / sqrt(mean_j(x[i][j]^2) + eps) * weight[j]
void RmsNorm(const float* x,       // [m][d]
             const float* weight,  // [d]
             float eps,
             float* out,  // [m][d]
             int m, int d);

// residual += x, then out = RmsNorm(residual) (the pre-norm block's fused add).
void AddRmsNorm(float* residual,     // [m][d] in/out
                const float* x,      // [m][d]
                const float* weight, // [d]
                float eps,
                float* out,  // [m][d]
                int m, int d);

// inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim / 2; with llama3
// scaling when `llama3` is non-null; with linear scaling when linear_factor
// != 1 (divides every frequency). Matches transformers' rope init functions.
void RopeInvFreq(float* inv_freq,  // [head_dim / 2]
                 int head_dim, double theta, const RopeLlama3Scaling* llama3 = nullptr,
                 float linear_factor = 1.0f);

// Rotary embedding in place, HF "rotate_half" convention: for i < hd/2,
//   (a, b) = (v[i], v[i + hd/2]);  angle = float(position) * inv_freq[i]
//   v[i] = a*cos - b*sin;  v[i + hd/2] = b*cos + a*sin
// cos/sin are the f32-rounded values of the f32 angle (as transformers does).
void Rope(float* q,                 // [t][heads][head_dim] in/out
          float* k,                 // [t][kv_heads][head_dim] in/out
          const int32_t* positions, // [t]
          const float* inv_freq,    // [head_dim / 2]
          int t, int heads, int kv_heads, int head_dim);

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))   (SwiGLU)
void SiluMul(const float* gate,  // [m][n]
             const float* up,    // [m][n]
             float* out,         // [m][n] (may alias gate or up)
             int m, int n);

// Copy t tokens' K and V of one layer into their cache slots.
void WriteKv(const KvCacheView& view, int layer,
             const float* k,        // [t][kv_heads][head_dim]
             const float* v,        // [t][kv_heads][head_dim]
             const int32_t* slots,  // [t] block_id * block_size + offset
             int t);

// Causal paged attention with GQA (heads / kv_heads query heads share one
// kv head) for one sequence: row r of q is the query at position q_start + r
// and attends to keys 0 .. q_start + r.
//   out[r][h] = sum_j softmax_j(scale * q[r][h] . K[j][h / group]) * V[j][h / group]
void PagedAttention(const KvCacheView& view, int layer,
                    const float* q,            // [t][heads][head_dim]
                    float* out,                // [t][heads][head_dim]
                    const int32_t* block_table,// [ceil((q_start + t) / block_size)]
                    int q_start, int t, int heads, float scale);

// The same for several sequences in one call (mixed prefill chunks and
// decode steps); rows of q/out follow seqs in order.
void PagedAttentionBatch(const KvCacheView& view, int layer,
                         const float* q,            // [sum q_len][heads][head_dim]
                         float* out,                // [sum q_len][heads][head_dim]
                         const AttentionSeq* seqs,  // [num_seqs]
                         int num_seqs, int heads, float scale);

// out[i] = index of the largest logits[i][j]; the lowest index wins ties;
// NaN entries are never chosen (all-NaN rows give 0).
void Argmax(const float* logits,  // [m][vocab]
            int32_t* out,         // [m]
            int m, int vocab);

// out[i][j] = exp(x[i][j] - max_i) / sum_j exp(x[i][j] - max_i)
void Softmax(const float* x,  // [m][n]
             float* out,      // [m][n] (may alias x)
             int m, int n);

// out[i][j] = x[i][j] - max_i - log(sum_j exp(x[i][j] - max_i))
void LogSoftmax(const float* x,  // [m][n]
                float* out,      // [m][n] (may alias x)
                int m, int n);

}  // namespace ref
}  // namespace tandem::kernels
