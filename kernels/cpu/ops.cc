// Row-wise CPU kernels: norms, RoPE, SwiGLU, argmax, softmax. Each row is
// computed by the same code whatever m and whichever thread runs it; the
// vector bodies are compiled once per instruction set (AVX-512, AVX2,
// baseline) and give the same bits on each (see simd.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace tandem::kernels::cpu {
namespace {

using internal::kLanes;
using internal::V16;

// Rows per task so that one task touches at least ~16 KiB.
int64_t RowGrain(int row_floats) { return std::max<int64_t>(1, 4096 / std::max(1, row_floats)); }

// ---- bodies (inlined into one wrapper per instruction set) ----

// out = (x * inv_rms) * weight; with `residual`, x = residual += add first.
inline __attribute__((always_inline)) void NormRowBody(float* residual, const float* add,
                                                       const float* x, const float* weight,
                                                       float eps, float* out, int d) {
  if (residual != nullptr) {
    int j = 0;
    for (; j + kLanes <= d; j += kLanes) {
      internal::Store(residual + j, internal::Load(residual + j) + internal::Load(add + j));
    }
    if (j < d) {
      internal::StorePartial(residual + j,
                             internal::LoadPartial(residual + j, d - j) +
                                 internal::LoadPartial(add + j, d - j),
                             d - j);
    }
    x = residual;
  }
  const float ss = internal::Dot(x, x, d);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  const V16 vinv = internal::Splat(inv);
  int j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    internal::Store(out + j, (internal::Load(x + j) * vinv) * internal::Load(weight + j));
  }
  if (j < d) {
    internal::StorePartial(
        out + j, (internal::LoadPartial(x + j, d - j) * vinv) * internal::LoadPartial(weight + j, d - j),
        d - j);
  }
}

inline __attribute__((always_inline)) V16 Silu(V16 g, V16 u) {
  return g / (internal::Splat(1.0f) + internal::Exp(-g)) * u;
}
inline __attribute__((always_inline)) void SiluMulBody(const float* gate, const float* up,
                                                       float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    internal::Store(out + i, Silu(internal::Load(gate + i), internal::Load(up + i)));
  }
  if (i < n) {
    const int r = static_cast<int>(n - i);
    internal::StorePartial(out + i, Silu(internal::LoadPartial(gate + i, r),
                                         internal::LoadPartial(up + i, r)), r);
  }
}

// max and sum_j exp(x_j - max) of one row; the sum in 16 fixed lanes.
inline __attribute__((always_inline)) void RowStatsBody(const float* row, int n, float* mx_out,
                                                        float* sum_out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) mx = row[j] > mx ? row[j] : mx;
  const V16 vmx = internal::Splat(mx);
  V16 acc = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) acc += internal::Exp(internal::Load(row + j) - vmx);
  if (j < n) {
    V16 e = internal::Exp(internal::LoadPartial(row + j, n - j) - vmx);
    for (int l = n - j; l < kLanes; ++l) e[l] = 0.0f;
    acc += e;
  }
  *mx_out = mx;
  *sum_out = internal::Reduce(acc);
}

// out = exp(x - mx) * inv
inline __attribute__((always_inline)) void ScaleExpBody(const float* x, float mx, float inv,
                                                        float* out, int n) {
  const V16 vmx = internal::Splat(mx), vinv = internal::Splat(inv);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    internal::Store(out + j, internal::Exp(internal::Load(x + j) - vmx) * vinv);
  }
  if (j < n) {
    internal::StorePartial(out + j, internal::Exp(internal::LoadPartial(x + j, n - j) - vmx) * vinv,
                           n - j);
  }
}

// ---- one wrapper per instruction set ----
#define TANDEM_WRAP(ret, name, params, args)                                  \
  __attribute__((target("avx512f"))) ret name##Avx512 params { return name##Body args; } \
  __attribute__((target("avx2"))) ret name##Avx2 params { return name##Body args; }      \
  ret name##Portable params { return name##Body args; }                                   \
  auto* Pick##name() {                                                         \
    switch (ActiveIsa()) {                                                     \
      case Isa::kAvx512: return &name##Avx512;                                 \
      case Isa::kAvx2: return &name##Avx2;                                     \
      default: return &name##Portable;                                         \
    }                                                                          \
  }

TANDEM_WRAP(void, NormRow,
            (float* residual, const float* add, const float* x, const float* weight, float eps,
             float* out, int d),
            (residual, add, x, weight, eps, out, d))
TANDEM_WRAP(void, SiluMul, (const float* gate, const float* up, float* out, int64_t n),
            (gate, up, out, n))
TANDEM_WRAP(void, RowStats, (const float* row, int n, float* mx, float* sum), (row, n, mx, sum))
TANDEM_WRAP(void, ScaleExp, (const float* x, float mx, float inv, float* out, int n),
            (x, mx, inv, out, n))
#undef TANDEM_WRAP

}  // namespace

void RmsNorm(const float* x, const float* weight, float eps, float* out, int m, int d,
             ThreadPool* pool) {
  auto* norm = PickNormRow();
  ParallelFor(pool, m, RowGrain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm(nullptr, nullptr, x + i * d, weight, eps, out + i * d, d);
  });
}

void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, float* out,
                int m, int d, ThreadPool* pool) {
  auto* norm = PickNormRow();
  ParallelFor(pool, m, RowGrain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      norm(residual + i * d, x + i * d, nullptr, weight, eps, out + i * d, d);
    }
  });
}

namespace {
void RopeHeads(float* v, int rows, int head_dim, const float* cos_t, const float* sin_t) {
  const int half = head_dim / 2;
  for (int r = 0; r < rows; ++r) {
    float* a = v + static_cast<size_t>(r) * head_dim;
    float* b = a + half;
    for (int i = 0; i < half; ++i) {
      const float x0 = a[i], x1 = b[i];
      a[i] = x0 * cos_t[i] - x1 * sin_t[i];
      b[i] = x1 * cos_t[i] + x0 * sin_t[i];
    }
  }
}
}  // namespace

void Rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int t, int heads,
          int kv_heads, int head_dim, ThreadPool* pool) {
  const int half = head_dim / 2;
  ParallelFor(pool, t, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> cos_t, sin_t;
    cos_t.resize(static_cast<size_t>(half));
    sin_t.resize(static_cast<size_t>(half));
    for (int64_t i = b; i < e; ++i) {
      for (int f = 0; f < half; ++f) {
        // f32 angle, then the correctly rounded f32 cos/sin (as transformers).
        const float angle = static_cast<float>(positions[i]) * inv_freq[f];
        cos_t[f] = static_cast<float>(std::cos(static_cast<double>(angle)));
        sin_t[f] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
      RopeHeads(q + i * heads * head_dim, heads, head_dim, cos_t.data(), sin_t.data());
      RopeHeads(k + i * kv_heads * head_dim, kv_heads, head_dim, cos_t.data(), sin_t.data());
    }
  });
}

void SiluMul(const float* gate, const float* up, float* out, int m, int n, ThreadPool* pool) {
  auto* silu = PickSiluMul();
  const int64_t total = static_cast<int64_t>(m) * n;
  // Chunks are multiples of 16 elements apart from the last; every element
  // gets the same lane-wise operations wherever its chunk starts.
  const int64_t chunks = (total + 4095) / 4096;
  ParallelFor(pool, chunks, 1, [&](int64_t b, int64_t e) {
    const int64_t begin = b * 4096, end = std::min(total, e * 4096);
    silu(gate + begin, up + begin, out + begin, end - begin);
  });
}

void WriteKv(const KvCacheView& view, int layer, const float* k, const float* v,
             const int32_t* slots, int t) {
  const size_t row_bytes = static_cast<size_t>(view.head_dim) * sizeof(float);
  for (int i = 0; i < t; ++i) {
    const int32_t block = slots[i] / view.block_size;
    const int offset = slots[i] % view.block_size;
    for (int h = 0; h < view.kv_heads; ++h) {
      const size_t src = (static_cast<size_t>(i) * view.kv_heads + h) * view.head_dim;
      std::memcpy(view.K(block, layer, h, offset), k + src, row_bytes);
      std::memcpy(view.V(block, layer, h, offset), v + src, row_bytes);
    }
  }
}

void Argmax(const float* logits, int32_t* out, int m, int vocab, ThreadPool* pool) {
  ParallelFor(pool, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* row = logits + i * vocab;
      int best = -1;
      float best_v = 0.0f;
      for (int j = 0; j < vocab; ++j) {
        const float x = row[j];
        if (x != x) continue;  // NaN
        if (best < 0 || x > best_v) {
          best = j;
          best_v = x;
        }
      }
      out[i] = best < 0 ? 0 : best;
    }
  });
}

void Softmax(const float* x, float* out, int m, int n, ThreadPool* pool) {
  auto* stats = PickRowStats();
  auto* scale_exp = PickScaleExp();
  ParallelFor(pool, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mx, sum;
      stats(x + i * n, n, &mx, &sum);
      scale_exp(x + i * n, mx, 1.0f / sum, out + i * n, n);
    }
  });
}

void LogSoftmax(const float* x, float* out, int m, int n, ThreadPool* pool) {
  auto* stats = PickRowStats();
  ParallelFor(pool, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mx, sum;
      stats(x + i * n, n, &mx, &sum);
      const float lse = mx + std::log(sum);
      for (int j = 0; j < n; ++j) out[i * n + j] = x[i * n + j] - lse;
    }
  });
}

}  // namespace tandem::kernels::cpu
