// SplitMix64 (Steele, Lea, Flood 2014; the finalizer of Java's
// SplittableRandom): one 64-bit mix, the counter-based randomness of the
// sampler's draws, the sim backend's tokens and the load generator's
// workloads. Values must not change: fixtures and recorded runs depend on
// them.
#pragma once

#include <cstdint>

namespace tandem {

// The stream's increment (the golden gamma).
inline constexpr uint64_t kSplitMix64Gamma = 0x9E3779B97F4A7C15ull;

// The mix of x + golden gamma (stateless form).
constexpr uint64_t SplitMix64(uint64_t x) {
  x += kSplitMix64Gamma;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The stream form: advances `state` by the gamma and returns the next value
// (SplitMix64Next(s) == SplitMix64(s_before)).
inline uint64_t SplitMix64Next(uint64_t& state) {
  const uint64_t out = SplitMix64(state);
  state += kSplitMix64Gamma;
  return out;
}

}  // namespace tandem
