// tandem's optimized CPU kernels: vectorized (AVX-512 / AVX2+FMA with a
// portable fallback, picked at run time) and multi-threaded over a
// ThreadPool. Same math and parameter conventions as the reference in
// kernels/reference/ops.h (the specification); every function takes an
// optional pool last (nullptr: the calling thread only).
//
// Batch invariance (DESIGN.md section 6), guaranteed bit for bit:
// - every output element is computed by one fixed sequence of f32
//   operations that depends only on the op's "reduction" sizes (k for GEMM;
//   d for norms; head_dim and the query's position for attention; vocab for
//   softmax) — never on m, a row's position, the number of sequences in a
//   batch, how a prompt is chunked (q_start, t), the thread count, the tile
//   choice or the instruction set in use;
// - GEMM: y[i][j] = fma-chain over k = 0, 1, ..., k-1 in order, starting from
//   0, then + bias[j]. The AVX-512, AVX2 and portable paths give the same bits.
// - Attention: for query position p and head h, scores s_j (j = 0..p) are
//   dot products in a fixed 16-lane order; the softmax uses the max over j,
//   an exp-sum in 16 fixed lanes (key j in lane j % 16) and a weighted V sum
//   in 4 fixed parts (key j in part j % 4, in key order within a part) — an
//   order that depends on p alone, never on t, q_start or the batch.
// - Row ops (norms, softmax): per-row reductions in 16 fixed lanes.
// Tolerances against the reference are stated in tests/unit/kernels.
//
// Threading: as for the reference; a ThreadPool is driven by one thread at a
// time (see thread_pool.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cpu/thread_pool.h"
#include "kernels/reference/kv_cache_view.h"
#include "kernels/reference/ops.h"  // AttentionSeq, RopeLlama3Scaling

namespace tandem::kernels::cpu {

// Instruction set of the vector paths. The best one the CPU supports is
// chosen at start-up; all give bit-identical results.
enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
Isa BestIsa();
Isa ActiveIsa();
// For tests and benchmarks: use `isa` (clamped to BestIsa()). Not safe while
// kernels run on other threads.
void SetIsa(Isa isa);
const char* IsaName(Isa isa);

// Memory that is read whole and in order, again and again (packed weights,
// a benchmark's read probe): from 2 MiB up it starts on a 2 MiB boundary and
// is advised for transparent huge pages before it is written, so the first
// touch maps huge pages where the kernel has them; smaller blocks (0 bytes
// included) are at least 64 bytes, 64-byte aligned. The advice is best
// effort (THP off, or no huge page free: the same bytes on small pages).
// nullptr when out of memory; release with std::free.
void* AllocateStreamed(size_t bytes);

// GEMM weights in HF Linear layout [n][k], packed once at load time into
// 16-column panels: panel p holds columns 16p .. 16p+15 as [k][16] (columns
// past n are zero). Move-only; owns 64-byte aligned memory.
class PackedWeights {
 public:
  static constexpr int kPanel = 16;
  PackedWeights() = default;
  int n() const { return n_; }
  int k() const { return k_; }
  int panels() const { return (n_ + kPanel - 1) / kPanel; }
  const float* data() const { return data_.get(); }  // [panels][k][16]
  size_t bytes() const { return static_cast<size_t>(panels()) * k_ * kPanel * sizeof(float); }

 private:
  friend PackedWeights PackWeights(const float* w, int n, int k);
  struct Free {
    void operator()(float* p) const;
  };
  int n_ = 0;
  int k_ = 0;
  std::unique_ptr<float[], Free> data_;
};

PackedWeights PackWeights(const float* w,  // [n][k]
                          int n, int k);

// y[i][j] = sum_k x[i][k] * w[j][k] + (bias ? bias[j] : 0); see the
// invariance contract above.
void Gemm(const float* x,           // [m][w.k()]
          const PackedWeights& w,   // [w.n()][w.k()] packed
          const float* bias,        // [w.n()] or nullptr
          float* y,                 // [m][w.n()]
          int m, ThreadPool* pool = nullptr);

// Row-parallel GEMM of tensor parallelism (issue 18, docs/parallelism.md):
// K split into `shards` contiguous ranges [k_bounds[s], k_bounds[s + 1])
// (k_bounds[0] = 0, k_bounds[shards] = w.k()). Shard s's partial p_s[i][j]
// is Gemm's fma chain over its k range alone, starting from +0; y is their
// sum as a fixed balanced tree in shard order (2: p0 + p1; 4: (p0 + p1) +
// (p2 + p3); 8: ((p0+p1)+(p2+p3)) + ((p4+p5)+(p6+p7))), the same order the
// communicators' AllReduceSum uses between ranks. No bias (the caller adds
// it once after the reduction). Batch-invariant as Gemm.
void GemmSplitK(const float* x,          // [m][w.k()]
                const PackedWeights& w,  // [w.n()][w.k()] packed
                const int* k_bounds,     // [shards + 1]
                int shards,  // 1, 2, 4 or 8
                float* y,        // [m][w.n()]
                float* scratch,  // [(shards - 1) * m * w.n()] (unused when m < 4)
                int m, ThreadPool* pool = nullptr);

// Unpacked convenience (packs on every call: tests, one-off shapes). Same bits.
void Gemm(const float* x,     // [m][k]
          const float* w,     // [n][k]
          const float* bias,  // [n] or nullptr
          float* y,           // [m][n]
          int m, int n, int k, ThreadPool* pool = nullptr);

void RmsNorm(const float* x,       // [m][d]
             const float* weight,  // [d]
             float eps,
             float* out,  // [m][d]
             int m, int d, ThreadPool* pool = nullptr);

// residual += x, then out = RmsNorm(residual).
void AddRmsNorm(float* residual,      // [m][d] in/out
                const float* x,       // [m][d]
                const float* weight,  // [d]
                float eps,
                float* out,  // [m][d]
                int m, int d, ThreadPool* pool = nullptr);

// In-place rotary embedding, HF rotate_half convention (see ref::Rope).
void Rope(float* q,                  // [t][heads][head_dim] in/out
          float* k,                  // [t][kv_heads][head_dim] in/out
          const int32_t* positions,  // [t]
          const float* inv_freq,     // [head_dim / 2] (ref::RopeInvFreq)
          int t, int heads, int kv_heads, int head_dim, ThreadPool* pool = nullptr);

// out = silu(gate) * up.
void SiluMul(const float* gate,  // [m][n]
             const float* up,    // [m][n]
             float* out,         // [m][n] (may alias gate or up)
             int m, int n, ThreadPool* pool = nullptr);

void WriteKv(const KvCacheView& view, int layer,
             const float* k,        // [t][kv_heads][head_dim]
             const float* v,        // [t][kv_heads][head_dim]
             const int32_t* slots,  // [t] block_id * block_size + offset
             int t);

// Causal paged attention with GQA for one sequence (see ref::PagedAttention).
void PagedAttention(const KvCacheView& view, int layer,
                    const float* q,              // [t][heads][head_dim]
                    float* out,                  // [t][heads][head_dim]
                    const int32_t* block_table,  // [ceil((q_start + t) / block_size)]
                    int q_start, int t, int heads, float scale, ThreadPool* pool = nullptr);

// Several sequences (prefill chunks and decode steps mixed) in one call,
// threaded over (query row, head); rows of q/out follow seqs in order.
void PagedAttentionBatch(const KvCacheView& view, int layer,
                         const float* q,            // [sum q_len][heads][head_dim]
                         float* out,                // [sum q_len][heads][head_dim]
                         const AttentionSeq* seqs,  // [num_seqs]
                         int num_seqs, int heads, float scale, ThreadPool* pool = nullptr);

// Lowest index of the maximum; NaN never chosen (all-NaN rows give 0).
void Argmax(const float* logits,  // [m][vocab]
            int32_t* out,         // [m]
            int m, int vocab, ThreadPool* pool = nullptr);

void Softmax(const float* x,  // [m][n]
             float* out,      // [m][n] (may alias x)
             int m, int n, ThreadPool* pool = nullptr);

void LogSoftmax(const float* x,  // [m][n]
                float* out,      // [m][n] (may alias x)
                int m, int n, ThreadPool* pool = nullptr);

}  // namespace tandem::kernels::cpu
