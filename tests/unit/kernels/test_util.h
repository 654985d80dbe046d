// Helpers for the kernel tests: random data, guarded output buffers and
// normalized-error comparison (reference vs optimized, zero mismatches).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace tandem::kernels::testing {

inline std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// An output buffer with canaries on both sides to catch overruns.
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  explicit Guarded(size_t n, float fill = std::numeric_limits<float>::quiet_NaN())
      : n_(n), buf_(n + 2 * kGuard, fill) {
    for (size_t i = 0; i < kGuard; ++i) {
      buf_[i] = kCanary;
      buf_[kGuard + n + i] = kCanary;
    }
  }
  float* data() { return buf_.data() + kGuard; }
  const float* data() const { return buf_.data() + kGuard; }
  size_t size() const { return n_; }
  float operator[](size_t i) const { return data()[i]; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (std::memcmp(&buf_[i], &kCanary, 4) != 0) return false;
      if (std::memcmp(&buf_[kGuard + n_ + i], &kCanary, 4) != 0) return false;
    }
    return true;
  }

 private:
  static constexpr float kCanary = -1234.5678f;
  size_t n_;
  std::vector<float> buf_;
};

// Counts elements with |got - want| > tol * max(|want|, floor), or NaN/inf in
// got; records the largest normalized error seen.
struct ErrStats {
  size_t mismatches = 0;
  size_t nans = 0;
  double max_err = 0.0;
  std::string first;
};
inline ErrStats Compare(const float* got, const float* want, size_t n, double tol, double floor) {
  ErrStats s;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) {
      ++s.nans;
      if (s.first.empty()) s.first = "non-finite at " + std::to_string(i);
      continue;
    }
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                       std::max(std::fabs(static_cast<double>(want[i])), floor);
    s.max_err = std::max(s.max_err, err);
    if (err > tol) {
      if (s.first.empty()) {
        s.first = "at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
                  std::to_string(want[i]);
      }
      ++s.mismatches;
    }
  }
  return s;
}

inline bool BitEqual(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace tandem::kernels::testing
