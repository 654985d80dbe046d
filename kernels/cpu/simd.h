// Internal helpers shared by the CPU kernels: fixed-order f32 reductions.
// Every reduction here has one order that depends only on its length, so a
// result never depends on the batch, the thread or the instruction set the
// compiler vectorized it for (lanes are independent; -ffp-contract=off keeps
// mul and add separate).
#pragma once

#include <cstddef>

namespace tandem::kernels::cpu::internal {

constexpr int kLanes = 16;

// Fixed tree over 16 lanes: (l, l+8), then (l, l+4), (l, l+2), (l, l+1).
inline float ReduceLanes(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// sum_i a[i] * b[i]: lane l accumulates i = l, l+16, ... (mul, then add);
// the tail acts as if zero-padded to a multiple of 16.
inline float Dot(const float* a, const float* b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  return ReduceLanes(acc);
}

}  // namespace tandem::kernels::cpu::internal
