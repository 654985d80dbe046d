// Temporary: non-GEMM kernels forward to the reference until the vector
// versions land.
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {

void RmsNorm(const float* x, const float* weight, float eps, float* out, int m, int d,
             ThreadPool*) {
  ref::RmsNorm(x, weight, eps, out, m, d);
}
void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, float* out,
                int m, int d, ThreadPool*) {
  ref::AddRmsNorm(residual, x, weight, eps, out, m, d);
}
void Rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int t, int heads,
          int kv_heads, int head_dim, ThreadPool*) {
  ref::Rope(q, k, positions, inv_freq, t, heads, kv_heads, head_dim);
}
void SiluMul(const float* gate, const float* up, float* out, int m, int n, ThreadPool*) {
  ref::SiluMul(gate, up, out, m, n);
}
void WriteKv(const KvCacheView& view, int layer, const float* k, const float* v,
             const int32_t* slots, int t) {
  ref::WriteKv(view, layer, k, v, slots, t);
}
void PagedAttention(const KvCacheView& view, int layer, const float* q, float* out,
                    const int32_t* block_table, int q_start, int t, int heads, float scale,
                    ThreadPool*) {
  ref::PagedAttention(view, layer, q, out, block_table, q_start, t, heads, scale);
}
void PagedAttentionBatch(const KvCacheView& view, int layer, const float* q, float* out,
                         const AttentionSeq* seqs, int num_seqs, int heads, float scale,
                         ThreadPool*) {
  ref::PagedAttentionBatch(view, layer, q, out, seqs, num_seqs, heads, scale);
}
void Argmax(const float* logits, int32_t* out, int m, int vocab, ThreadPool*) {
  ref::Argmax(logits, out, m, vocab);
}
void Softmax(const float* x, float* out, int m, int n, ThreadPool*) { ref::Softmax(x, out, m, n); }
void LogSoftmax(const float* x, float* out, int m, int n, ThreadPool*) {
  ref::LogSoftmax(x, out, m, n);
}

}  // namespace tandem::kernels::cpu
