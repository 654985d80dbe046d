// Paged causal attention with GQA, batch- and chunk-invariant: for a query at
// position p the scores over keys 0..p, their max, the exp-sum and the
// weighted V sum are computed in key order 0, 1, ..., p by the same code,
// whatever the sequence's other rows, other sequences, threads or instruction
// set. Two passes over the keys (scores, then V) keep the softmax exact (no
// online rescaling); the exp-sum runs in 16 fixed lanes (key j in lane j % 16)
// and the V sum in 4 fixed parts (key j in part j % 4), so the order depends
// only on the query's position.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace tandem::kernels::cpu {
namespace {

using internal::V16;

struct Scratch {
  std::vector<float> scores;  // [group][keys rounded up to 16]
  std::vector<float> acc;     // [group][hd rounded up to 16]
};

constexpr int kVParts = 4;

// V row of key j as vector chunk c (zero past head_dim).
inline __attribute__((always_inline)) V16 VChunk(const float* vr, int c, int hd) {
  const int d = c * internal::kLanes;
  return d + internal::kLanes <= hd ? internal::Load(vr + d) : internal::LoadPartial(vr + d, hd - d);
}

// acc[0 .. NC*16) = sum over keys of w[j] * V[j], accumulators in registers
// (head_dim == NC * 16).
template <int NC>
inline __attribute__((always_inline)) void WeightedVSum(const KvCacheView& view, int layer, int kvh,
                                                        const int32_t* block_table, int keys,
                                                        const float* w, float* acc) {
  const int hd = view.head_dim, bs = view.block_size;
  static_assert(kVParts == 4);
  V16 p0[NC] = {}, p1[NC] = {}, p2[NC] = {}, p3[NC] = {};
#define TANDEM_ADD_KEY(P, J, VR)                                       \
  do {                                                                 \
    const V16 wj = internal::Splat(w[J]);                              \
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) P[c] += wj * internal::Load(VR + c * internal::kLanes); \
  } while (0)
  for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
    const float* vb = view.V(block_table[b], layer, kvh, 0);
    const int n = std::min(bs, keys - j0);
    int t = 0;
    while (t < n) {
      const int j = j0 + t;
      const float* vr = vb + static_cast<size_t>(t) * hd;
      if (j % 4 == 0 && t + 4 <= n) {  // four keys, one per part (registers stay put)
        TANDEM_ADD_KEY(p0, j, vr);
        TANDEM_ADD_KEY(p1, j + 1, vr + hd);
        TANDEM_ADD_KEY(p2, j + 2, vr + 2 * hd);
        TANDEM_ADD_KEY(p3, j + 3, vr + 3 * hd);
        t += 4;
        continue;
      }
      switch (j % 4) {
        case 0: TANDEM_ADD_KEY(p0, j, vr); break;
        case 1: TANDEM_ADD_KEY(p1, j, vr); break;
        case 2: TANDEM_ADD_KEY(p2, j, vr); break;
        default: TANDEM_ADD_KEY(p3, j, vr); break;
      }
      ++t;
    }
  }
#undef TANDEM_ADD_KEY
  for (int c = 0; c < NC; ++c) {
    internal::Store(acc + c * internal::kLanes, (p0[c] + p1[c]) + (p2[c] + p3[c]));
  }
}

// Any head_dim: the same arithmetic with accumulators in memory.
inline __attribute__((always_inline)) void WeightedVSumAny(const KvCacheView& view, int layer,
                                                           int kvh, const int32_t* block_table,
                                                           int keys, const float* w, float* acc) {
  const int hd = view.head_dim, bs = view.block_size;
  const int nc = (hd + internal::kLanes - 1) / internal::kLanes;
  // Float storage with Load/Store (a std::vector<V16> would not keep the
  // vector type's 64-byte alignment).
  thread_local std::vector<float> part;
  const size_t part_floats = static_cast<size_t>(nc) * internal::kLanes;
  part.assign(kVParts * part_floats, 0.0f);
  for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
    const float* vb = view.V(block_table[b], layer, kvh, 0);
    const int n = std::min(bs, keys - j0);
    for (int t = 0; t < n; ++t) {
      const int j = j0 + t;
      const V16 wj = internal::Splat(w[j]);
      const float* vr = vb + static_cast<size_t>(t) * hd;
      float* p = part.data() + static_cast<size_t>(j % kVParts) * part_floats;
      for (int c = 0; c < nc; ++c) {
        float* pc = p + c * internal::kLanes;
        internal::Store(pc, internal::Load(pc) + wj * VChunk(vr, c, hd));
      }
    }
  }
  for (int c = 0; c < nc; ++c) {
    const float* p = part.data() + c * internal::kLanes;
    internal::Store(acc + c * internal::kLanes,
                    (internal::Load(p) + internal::Load(p + part_floats)) +
                        (internal::Load(p + 2 * part_floats) + internal::Load(p + 3 * part_floats)));
  }
}

// s[j] = Dot(q, K[j], NC * 16) * scale for j < keys: internal::Dot's exact
// operations with q held in registers.
template <int NC>
inline __attribute__((always_inline)) void Scores(const KvCacheView& view, int layer, int kvh,
                                                  const int32_t* block_table, int keys,
                                                  const float* q, float scale, float* s) {
  const int hd = view.head_dim, bs = view.block_size;
  V16 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = internal::Load(q + c * internal::kLanes);
  for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
    const float* kb = view.K(block_table[b], layer, kvh, 0);
    const int n = std::min(bs, keys - j0);
    int t = 0;
    // 16 keys at a time: the same dot products, their 16 horizontal sums
    // done together (internal::Reduce16 gives Reduce's bits per key).
    for (; t + internal::kLanes <= n; t += internal::kLanes) {
      V16 acc[internal::kLanes];
      for (int k = 0; k < internal::kLanes; ++k) {
        const float* kr = kb + static_cast<size_t>(t + k) * hd;
        acc[k] = V16{};
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) acc[k] += qv[c] * internal::Load(kr + c * internal::kLanes);
      }
      internal::Store(s + j0 + t, internal::Reduce16(acc) * scale);
    }
    for (; t < n; ++t) {
      const float* kr = kb + static_cast<size_t>(t) * hd;
      V16 acc = {};
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc += qv[c] * internal::Load(kr + c * internal::kLanes);
      s[j0 + t] = internal::Reduce(acc) * scale;
    }
  }
}

// One query row, all heads of kv head `kvh`'s group. Inlined into one
// wrapper per instruction set; the bits do not depend on which.
inline __attribute__((always_inline)) void AttendGroupBody(
    const KvCacheView& view, int layer, const float* q,  // [group][hd]
    float* out,                                           // [group][hd]
    const int32_t* block_table, int pos, int kvh, int group, float scale, Scratch& sc) {
  using internal::kLanes;
  const int hd = view.head_dim;
  const int bs = view.block_size;
  const int keys = pos + 1;
  const int keys_padded = (keys + kLanes - 1) / kLanes * kLanes;
  const int hd_padded = (hd + kLanes - 1) / kLanes * kLanes;
  if (sc.scores.size() < static_cast<size_t>(group) * keys_padded) {
    sc.scores.resize(static_cast<size_t>(group) * keys_padded);
  }
  if (sc.acc.size() < static_cast<size_t>(group) * hd_padded) {
    sc.acc.resize(static_cast<size_t>(group) * hd_padded);
  }
  // Pass 1: scores, block by block.
  for (int g = 0; g < group; ++g) {
    const float* qg = q + static_cast<size_t>(g) * hd;
    float* sg = sc.scores.data() + static_cast<size_t>(g) * keys_padded;
    switch (hd % kLanes == 0 ? hd / kLanes : 0) {
      case 1: Scores<1>(view, layer, kvh, block_table, keys, qg, scale, sg); break;
      case 2: Scores<2>(view, layer, kvh, block_table, keys, qg, scale, sg); break;
      case 4: Scores<4>(view, layer, kvh, block_table, keys, qg, scale, sg); break;
      case 8: Scores<8>(view, layer, kvh, block_table, keys, qg, scale, sg); break;
      default:
        for (int j0 = 0, b = 0; j0 < keys; j0 += bs, ++b) {
          const float* kb = view.K(block_table[b], layer, kvh, 0);
          const int n = std::min(bs, keys - j0);
          for (int t = 0; t < n; ++t) {
            sg[j0 + t] = internal::Dot(qg, kb + static_cast<size_t>(t) * hd, hd) * scale;
          }
        }
    }
  }
  // Softmax weights: max, exp, and the sum in 16 fixed lanes (key j in lane
  // j % 16, padding keys weigh 0), then the fixed tree.
  float sums[64];
  std::vector<float> sums_big;
  float* sum = sums;
  if (group > 64) {
    sums_big.resize(static_cast<size_t>(group));
    sum = sums_big.data();
  }
  for (int g = 0; g < group; ++g) {
    float* s = sc.scores.data() + static_cast<size_t>(g) * keys_padded;
    // The max is exact in any order.
    V16 vmax = internal::Splat(-std::numeric_limits<float>::infinity());
    int jm = 0;
    for (; jm + kLanes <= keys; jm += kLanes) {
      const V16 v = internal::Load(s + jm);
      vmax = v > vmax ? v : vmax;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < kLanes; ++l) mx = vmax[l] > mx ? vmax[l] : mx;
    for (; jm < keys; ++jm) mx = s[jm] > mx ? s[jm] : mx;
    const V16 vmx = internal::Splat(mx);
    V16 total = {};
    int j = 0;
    for (; j + kLanes <= keys; j += kLanes) {
      const V16 e = internal::ExpNonPositive(internal::Load(s + j) - vmx);
      internal::Store(s + j, e);
      total += e;
    }
    if (j < keys) {
      V16 e = internal::ExpNonPositive(internal::LoadPartial(s + j, keys - j) - vmx);
      for (int l = keys - j; l < kLanes; ++l) e[l] = 0.0f;
      internal::Store(s + j, e);
      total += e;
    }
    sum[g] = internal::Reduce(total);
  }
  // Pass 2: weighted V sum, key j into part j % kVParts, parts combined as
  // (p0 + p1) + (p2 + p3): an order fixed by the key count alone.
  for (int g = 0; g < group; ++g) {
    const float* w = sc.scores.data() + static_cast<size_t>(g) * keys_padded;
    float* a = sc.acc.data() + static_cast<size_t>(g) * hd_padded;
    switch (hd % kLanes == 0 ? hd / kLanes : 0) {
      case 1: WeightedVSum<1>(view, layer, kvh, block_table, keys, w, a); break;
      case 2: WeightedVSum<2>(view, layer, kvh, block_table, keys, w, a); break;
      case 4: WeightedVSum<4>(view, layer, kvh, block_table, keys, w, a); break;
      case 8: WeightedVSum<8>(view, layer, kvh, block_table, keys, w, a); break;
      default: WeightedVSumAny(view, layer, kvh, block_table, keys, w, a); break;
    }
    float* o = out + static_cast<size_t>(g) * hd;
    for (int d = 0; d < hd; ++d) o[d] = a[d] / sum[g];
  }
}

#define TANDEM_ATTEND_ARGS                                                                 \
  const KvCacheView &view, int layer, const float *q, float *out, const int32_t *block_table, \
      int pos, int kvh, int group, float scale, Scratch &sc
__attribute__((target("avx512f"))) void AttendGroupAvx512(TANDEM_ATTEND_ARGS) {
  AttendGroupBody(view, layer, q, out, block_table, pos, kvh, group, scale, sc);
}
__attribute__((target("avx2"))) void AttendGroupAvx2(TANDEM_ATTEND_ARGS) {
  AttendGroupBody(view, layer, q, out, block_table, pos, kvh, group, scale, sc);
}
void AttendGroupPortable(TANDEM_ATTEND_ARGS) {
  AttendGroupBody(view, layer, q, out, block_table, pos, kvh, group, scale, sc);
}
#undef TANDEM_ATTEND_ARGS

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
  const Isa isa = ActiveIsa();
  auto* attend = isa == Isa::kAvx512 ? &AttendGroupAvx512
                 : isa == Isa::kAvx2 ? &AttendGroupAvx2
                                     : &AttendGroupPortable;
  // Rows late in a causal prompt cost more than early ones: small chunks,
  // claimed one by one, balance the threads (each task is computed whole by
  // one thread, so the cut does not change any bits).
  ParallelForChunked(pool, tasks, std::max<int64_t>(1, tasks / 64), [&](int64_t b, int64_t e) {
    thread_local Scratch scratch;
    for (int64_t task = b; task < e; ++task) {
      const int64_t row = task / kvh;
      const int h = static_cast<int>(task % kvh);
      const size_t off = static_cast<size_t>(row) * row_floats + static_cast<size_t>(h) * group * hd;
      attend(view, layer, q + off, out + off, seqs[row_seq[row]].block_table, row_pos[row], h,
             group, scale, scratch);
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
