// Secrets of the KV plane (docs/security.md, "KV plane"): the per-reservation
// capability a KV notice must carry, and random ids nobody can guess.
// Randomness comes from the kernel (getrandom(2)); comparisons of secrets
// take the same time whatever the bytes. Pure functions, any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::kvtransfer {

inline constexpr size_t kCapabilityBytes = 16;  // 128 bits

// `n` bytes from the kernel's CSPRNG; INTERNAL if it fails.
Result<std::string> RandomBytes(size_t n);
// A fresh reservation capability (kCapabilityBytes random bytes).
Result<std::string> NewCapability();
// A random 64-bit value that is never 0.
Result<uint64_t> RandomNonZeroU64();
// Equal length and equal bytes, in time independent of where they differ.
bool SecretEquals(std::string_view a, std::string_view b);

}  // namespace tandem::kvtransfer
