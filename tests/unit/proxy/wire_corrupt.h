// Random corruptions of a serialized message, and overlong varints, for the
// tests that hold the proxy's hand-written wire readers (proxy/wire_scan.h)
// to protobuf's parse of the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

namespace tandem::proxy::wire_test {

// `valid` with 1-3 edits: a byte changed, the rest cut off, a byte inserted.
inline std::string Corrupt(const std::string& valid, std::mt19937& rng) {
  std::string s = valid;
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = rng() % s.size();
    switch (rng() % 3) {
      case 0: s[at] = static_cast<char>(rng()); break;
      case 1: s.resize(at); break;
      default: s.insert(at, 1, static_cast<char>(rng())); break;
    }
  }
  return s;
}

// `value` (below 128) as a varint of `bytes` bytes, zero-padded past the
// first: protobuf reads a tag or a length of at most 5 bytes, a value of 10.
inline std::string PaddedVarint(uint8_t value, size_t bytes) {
  std::string s(1, static_cast<char>(bytes == 1 ? value : value | 0x80));
  if (bytes > 1) s += std::string(bytes - 2, '\x80') + std::string(1, '\0');
  return s;
}

}  // namespace tandem::proxy::wire_test
