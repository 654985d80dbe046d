// Random corruptions of a serialized message, for the tests that hold the
// proxy's hand-written wire readers (proxy/wire_scan.h) to protobuf's
// parse of the same bytes.
#pragma once

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

}  // namespace tandem::proxy::wire_test
