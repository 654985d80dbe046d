// Row-wise CPU kernels: norms, RoPE, SwiGLU, argmax, softmax. Each row is
// computed by the same code whatever m and whichever thread runs it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"

namespace tandem::kernels::cpu {
namespace {

using internal::Dot;

// Rows per task so that one task touches at least ~16 KiB.
int64_t RowGrain(int row_floats) { return std::max<int64_t>(1, 4096 / std::max(1, row_floats)); }

void NormRow(const float* x, const float* weight, float eps, float* out, int d) {
  const float ss = Dot(x, x, d);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int j = 0; j < d; ++j) out[j] = (x[j] * inv) * weight[j];
}

}  // namespace

void RmsNorm(const float* x, const float* weight, float eps, float* out, int m, int d,
             ThreadPool* pool) {
  ParallelFor(pool, m, RowGrain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      NormRow(x + i * d, weight, eps, out + i * d, d);
    }
  });
}

void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, float* out,
                int m, int d, ThreadPool* pool) {
  ParallelFor(pool, m, RowGrain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* r = residual + i * d;
      const float* xr = x + i * d;
      for (int j = 0; j < d; ++j) r[j] += xr[j];
      NormRow(r, weight, eps, out + i * d, d);
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
    std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
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
  const int64_t total = static_cast<int64_t>(m) * n;
  ParallelFor(pool, total, 8192, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
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

namespace {
// max and sum_j exp(x_j - max) of one row, sums in 16 fixed lanes.
void RowStats(const float* row, int n, float* mx, float* sum) {
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) m = std::max(m, row[j]);
  float acc[internal::kLanes] = {};
  int j = 0;
  for (; j + internal::kLanes <= n; j += internal::kLanes) {
    for (int l = 0; l < internal::kLanes; ++l) acc[l] += std::exp(row[j + l] - m);
  }
  for (int l = 0; j + l < n; ++l) acc[l] += std::exp(row[j + l] - m);
  *mx = m;
  *sum = internal::ReduceLanes(acc);
}
}  // namespace

void Softmax(const float* x, float* out, int m, int n, ThreadPool* pool) {
  ParallelFor(pool, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mx, sum;
      RowStats(x + i * n, n, &mx, &sum);
      const float inv = 1.0f / sum;
      for (int j = 0; j < n; ++j) out[i * n + j] = std::exp(x[i * n + j] - mx) * inv;
    }
  });
}

void LogSoftmax(const float* x, float* out, int m, int n, ThreadPool* pool) {
  ParallelFor(pool, m, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float mx, sum;
      RowStats(x + i * n, n, &mx, &sum);
      const float lse = mx + std::log(sum);
      for (int j = 0; j < n; ++j) out[i * n + j] = x[i * n + j] - lse;
    }
  });
}

}  // namespace tandem::kernels::cpu
