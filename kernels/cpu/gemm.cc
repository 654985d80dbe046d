// GEMM, y = x * w^T (+ bias), batch-invariant: every y[i][j] is the fma chain
// over k in order 0..k-1 starting from +0, then + bias[j], whatever the path.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {

void PackedWeights::Free::operator()(float* p) const { std::free(p); }

PackedWeights PackWeights(const float* w, int n, int k) {
  PackedWeights out;
  out.n_ = n;
  out.k_ = k;
  const size_t floats = static_cast<size_t>(out.panels()) * k * PackedWeights::kPanel;
  const size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
  out.data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes == 0 ? 64 : bytes)));
  float* dst = out.data_.get();
  for (int p = 0; p < out.panels(); ++p) {
    for (int kk = 0; kk < k; ++kk) {
      for (int c = 0; c < PackedWeights::kPanel; ++c) {
        const int col = p * PackedWeights::kPanel + c;
        *dst++ = col < n ? w[static_cast<size_t>(col) * k + kk] : 0.0f;
      }
    }
  }
  return out;
}

namespace {

// Portable path: scalar fma chains, same bits as the vector paths.
void GemmPanelsPortable(const float* x, const float* packed, const float* bias, float* y, int m,
                        int n, int k, int panel_begin, int panel_end) {
  constexpr int kP = PackedWeights::kPanel;
  for (int i = 0; i < m; ++i) {
    const float* xr = x + static_cast<size_t>(i) * k;
    for (int p = panel_begin; p < panel_end; ++p) {
      const float* wp = packed + static_cast<size_t>(p) * k * kP;
      float acc[kP] = {};
      for (int kk = 0; kk < k; ++kk) {
        for (int c = 0; c < kP; ++c) acc[c] = std::fma(xr[kk], wp[kk * kP + c], acc[c]);
      }
      for (int c = 0; c < kP && p * kP + c < n; ++c) {
        const int col = p * kP + c;
        y[static_cast<size_t>(i) * n + col] = bias != nullptr ? acc[c] + bias[col] : acc[c];
      }
    }
  }
}

}  // namespace

void Gemm(const float* x, const PackedWeights& w, const float* bias, float* y, int m,
          ThreadPool* pool) {
  const int n = w.n(), k = w.k();
  if (m <= 0 || n <= 0) return;
  ParallelFor(pool, w.panels(), 1, [&](int64_t b, int64_t e) {
    GemmPanelsPortable(x, w.data(), bias, y, m, n, k, static_cast<int>(b), static_cast<int>(e));
  });
}

void Gemm(const float* x, const float* w, const float* bias, float* y, int m, int n, int k,
          ThreadPool* pool) {
  const PackedWeights packed = PackWeights(w, n, k);
  Gemm(x, packed, bias, y, m, pool);
}

}  // namespace tandem::kernels::cpu
