// Internal helpers shared by the CPU kernels: 16-lane f32 vectors (GCC vector
// extensions: one zmm with AVX-512, two ymm with AVX2, four xmm otherwise)
// and fixed-order reductions. Every operation is lane-wise IEEE mul/add/sub
// (-ffp-contract=off keeps them unfused) or integer bit manipulation, so a
// result has the same bits whichever instruction set a caller was compiled
// for, and depends only on the reduction's length.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem::kernels::cpu::internal {

constexpr int kLanes = 16;
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t V16i __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

inline __attribute__((always_inline)) V16 Load(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline __attribute__((always_inline)) void Store(float* p, V16 v) { std::memcpy(p, &v, sizeof(v)); }
// First n (< 16) floats, the rest zero.
inline __attribute__((always_inline)) V16 LoadPartial(const float* p, int n) {
  V16 v = {};
  std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
  return v;
}
inline __attribute__((always_inline)) V16 Splat(float x) { return V16{} + x; }

// Fixed tree over 16 lanes: (l, l+8), then (l, l+4), (l, l+2), (l, l+1) —
// the order of _mm512_reduce_add_ps.
inline __attribute__((always_inline)) float Reduce(V16 v) {
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

// Reduce of 16 vectors at once: lane k of the result is Reduce(v[k]), bit
// for bit (the same additions of the same pairs, several keys per vector).
inline __attribute__((always_inline)) V16 Reduce16(const V16* v) {
  V16 u[8], w[4], y[2];
  for (int i = 0; i < 8; ++i) {  // (l, l+8): [key 2i | key 2i+1], 8 lanes each
    u[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // (l, l+4): keys 4i..4i+3, 4 lanes each
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // c0 = b0 + b2, c1 = b1 + b3: keys 8i..8i+7, 2 lanes each
    y[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  }
  // c0 + c1: keys 0..15.
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

// Scalar-array form of the same tree (for code that keeps lanes in arrays).
inline float ReduceLanes(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// sum_i a[i] * b[i]: lane l accumulates i = l, l+16, ... (mul, then add);
// the tail acts as if zero-padded to a multiple of 16; then Reduce.
inline __attribute__((always_inline)) float Dot(const float* a, const float* b, int n) {
  V16 acc = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += Load(a + i) * Load(b + i);
  if (i < n) acc += LoadPartial(a + i, n - i) * LoadPartial(b + i, n - i);
  return Reduce(acc);
}

// exp(x), ~2 ulp: Cephes' expf polynomial with plain mul/add and an
// exponent-bits scale; 0 below -87.3, exp(88) above 88. Lane-wise, so every
// vector width gives the same bits.
inline __attribute__((always_inline)) V16 Exp(V16 x) {
  const V16 lo = Splat(-87.3f), hi = Splat(88.0f);
  const V16i under = x < lo;
  x = under ? lo : x;
  x = x > hi ? hi : x;
  const V16 magic = Splat(12582912.0f);  // 1.5 * 2^23: add-and-subtract rounds to integer
  const V16 n = (x * 1.44269504088896341f + magic) - magic;
  V16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V16 p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const V16i ni = __builtin_convertvector(n, V16i);
  V16i bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += ni << 23;
  V16 y;
  std::memcpy(&y, &bits, sizeof(y));
  return under ? V16{} : y;
}
inline __attribute__((always_inline)) V16 ExpNonPositive(V16 x) { return Exp(x); }

// Store the first n (< 16) lanes.
inline __attribute__((always_inline)) void StorePartial(float* p, V16 v, int n) {
  std::memcpy(p, &v, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace tandem::kernels::cpu::internal
