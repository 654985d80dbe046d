// Paged causal attention with GQA, batch- and chunk-invariant: for a query at
// position p the scores over keys 0..p, their max, the exp-sum and the
// weighted V sum are computed in key order 0, 1, ..., p by the same code,
// whatever the sequence's other rows, other sequences or threads. Two passes
// over the keys (scores, then V) keep the softmax exact (no rescaling).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace tandem::kernels::cpu {
namespace {

// One query row, all heads of kv head `kvh`'s group.
void AttendGroup(const KvCacheView& view, int layer, const float* q,  // [group][hd]
                 float* out,                                           // [group][hd]
                 const int32_t* block_table, int pos, int kvh, int group, float scale,
                 std::vector<float>& scores, std::vector<float>& acc) {
  const int hd = view.head_dim;
  const int bs = view.block_size;
  const int keys = pos + 1;
  scores.resize(static_cast<size_t>(group) * keys);
  acc.resize(static_cast<size_t>(group) * hd);
  // Pass 1: scores, block by block (each K row is read once for the group).
  for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
    const float* kb = view.K(block_table[b], layer, kvh, 0);
    const int n = std::min(bs, keys - j0);
    for (int t = 0; t < n; ++t) {
      const float* kr = kb + static_cast<size_t>(t) * hd;
      for (int g = 0; g < group; ++g) {
        scores[static_cast<size_t>(g) * keys + j0 + t] =
            internal::Dot(q + static_cast<size_t>(g) * hd, kr, hd) * scale;
      }
    }
  }
  // Softmax weights, in key order.
  float sums[64];
  std::vector<float> sums_big;
  float* sum = sums;
  if (group > 64) {
    sums_big.resize(static_cast<size_t>(group));
    sum = sums_big.data();
  }
  for (int g = 0; g < group; ++g) {
    float* s = scores.data() + static_cast<size_t>(g) * keys;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < keys; ++j) mx = std::max(mx, s[j]);
    float total = 0.0f;
    for (int j = 0; j < keys; ++j) {
      s[j] = std::exp(s[j] - mx);
      total += s[j];
    }
    sum[g] = total;
  }
  // Pass 2: weighted V sum, key order.
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
    const float* vb = view.V(block_table[b], layer, kvh, 0);
    const int n = std::min(bs, keys - j0);
    for (int t = 0; t < n; ++t) {
      const float* vr = vb + static_cast<size_t>(t) * hd;
      for (int g = 0; g < group; ++g) {
        const float w = scores[static_cast<size_t>(g) * keys + j0 + t];
        float* a = acc.data() + static_cast<size_t>(g) * hd;
        for (int d = 0; d < hd; ++d) a[d] += w * vr[d];
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const float* a = acc.data() + static_cast<size_t>(g) * hd;
    float* o = out + static_cast<size_t>(g) * hd;
    for (int d = 0; d < hd; ++d) o[d] = a[d] / sum[g];
  }
}

}  // namespace

void PagedAttentionBatch(const KvCacheView& view, int layer, const float* q, float* out,
                         const AttentionSeq* seqs, int num_seqs, int heads, float scale,
                         ThreadPool* pool) {
  const int hd = view.head_dim;
  const int kvh = view.kv_heads;
  const int group = heads / kvh;
  // Flatten (row, kv head) tasks; row_seq maps a row to its sequence.
  std::vector<int> row_seq;
  std::vector<int> row_pos;
  for (int s = 0; s < num_seqs; ++s) {
    for (int r = 0; r < seqs[s].q_len; ++r) {
      row_seq.push_back(s);
      row_pos.push_back(seqs[s].q_start + r);
    }
  }
  const int64_t tasks = static_cast<int64_t>(row_seq.size()) * kvh;
  const size_t row_floats = static_cast<size_t>(heads) * hd;
  ParallelFor(pool, tasks, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> scores, acc;
    for (int64_t task = b; task < e; ++task) {
      const int64_t row = task / kvh;
      const int h = static_cast<int>(task % kvh);
      const size_t off = static_cast<size_t>(row) * row_floats + static_cast<size_t>(h) * group * hd;
      AttendGroup(view, layer, q + off, out + off, seqs[row_seq[row]].block_table,
                  row_pos[row], h, group, scale, scores, acc);
    }
  });
}

void PagedAttention(const KvCacheView& view, int layer, const float* q, float* out,
                    const int32_t* block_table, int q_start, int t, int heads, float scale,
                    ThreadPool* pool) {
  const AttentionSeq seq{block_table, q_start, t};
  PagedAttentionBatch(view, layer, q, out, &seq, 1, heads, scale, pool);
}

}  // namespace tandem::kernels::cpu
