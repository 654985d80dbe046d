// KvChecksum (common/kv_checksum.h) is XXH3-64 with seed 0 whichever vector
// path this CPU gives it: the values are pinned from Python's `xxhash`
// package (its own copy of the C library), tools/block_hash_reference.py
// ("kv" lines), over every XXH3 length class and unaligned starts.
#include "common/kv_checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <vector>

namespace tandem {
namespace {

// Byte i of the pattern (the reference script's kv_pattern).
std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>((i * 167 + 13) ^ (i >> 7));
  return b;
}

struct Case {
  size_t bytes;
  size_t offset;
  uint64_t xxh3;
};

constexpr Case kCases[] = {
    {0, 0, 0x2d06800538d394c2ULL},     {3, 0, 0x5f1fa6d2a3aa5a3bULL},
    {8, 0, 0x67b8f67a80d308a6ULL},     {16, 0, 0xc0967fee676a5837ULL},
    {100, 0, 0xfc5f8401f6cbf3bfULL},   {240, 0, 0xace331d504fa4c3eULL},
    {241, 0, 0xdd417e20d9ea8747ULL},   {1023, 1, 0x913394406664a9a3ULL},
    {8192, 0, 0xf2147a88c1a6b981ULL},  {8192, 3, 0x8f25d6f0a4fb11d4ULL},
    {65541, 0, 0xdc78f8bb7c3dbb2fULL}, {2u << 20, 0, 0xeb090830cf6859cfULL},
};

TEST(KvChecksum, MatchesTheReferenceXxh3ForEveryLengthClass) {
  const std::vector<uint8_t> buf = Pattern((2u << 20) + 8);
  for (const Case& c : kCases) {
    EXPECT_EQ(KvChecksum(buf.data() + c.offset, c.bytes), c.xxh3)
        << KvChecksumImplementation() << ", " << c.bytes << " bytes at offset " << c.offset;
  }
}

// The library's compiled-in path (what a worker built without the dispatcher
// computes) agrees with this build's at every length up to two stripes'
// blocks and from every start within a cache line.
TEST(KvChecksum, AgreesWithTheLibrarysDefaultPath) {
  const std::vector<uint8_t> buf = Pattern(4096 + 64);
  for (size_t offset = 0; offset < 64; offset += 7) {
    for (size_t n = 0; n <= 4096; n += (n < 300 ? 1 : 61)) {
      ASSERT_EQ(KvChecksum(buf.data() + offset, n), XXH3_64bits(buf.data() + offset, n))
          << KvChecksumImplementation() << ", " << n << " bytes at offset " << offset;
    }
  }
}

TEST(KvChecksum, ChangesWithOneBitOfTheBlock) {
  std::vector<uint8_t> buf = Pattern(8192);
  const uint64_t before = KvChecksum(buf.data(), buf.size());
  buf[5000] ^= 0x10;
  EXPECT_NE(KvChecksum(buf.data(), buf.size()), before);
}

}  // namespace
}  // namespace tandem
