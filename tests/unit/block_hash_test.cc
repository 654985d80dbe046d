// Pinned values were computed independently with Python's `xxhash` package
// (xxh3_64_intdigest) over the byte layout documented in block_hash.h; see
// tools/block_hash_reference.py.
#include "common/block_hash.h"

#include <gtest/gtest.h>

#include <numeric>

namespace tandem {
namespace {

HashContext Ctx() {
  HashContext c;
  c.model_id = "tandem-kjv";
  c.block_size = 16;
  c.kv_dtype = "f32";
  return c;
}

TEST(BlockHash, RootValuePinned) { EXPECT_EQ(RootHash(Ctx()), 0x13658e9937f2638cULL); }

TEST(BlockHash, RootFoldsSaltAndBlockSize) {
  auto salted = Ctx();
  salted.fleet_salt = "secret";
  EXPECT_EQ(RootHash(salted), 0xda653155e5bd8448ULL);
  auto bs32 = Ctx();
  bs32.block_size = 32;
  EXPECT_EQ(RootHash(bs32), 0x618a1f7e9270f187ULL);
  auto tenant = Ctx();
  tenant.tenant_salt = "tenant-a";
  EXPECT_NE(RootHash(tenant), RootHash(Ctx()));
}

TEST(BlockHash, FleetSaltFingerprintHidesTheSalt) {
  const std::string fp = FleetSaltFingerprint("pepper");
  EXPECT_EQ(fp.size(), 32u);
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos) << fp;
  EXPECT_EQ(fp, FleetSaltFingerprint("pepper"));
  EXPECT_NE(fp, FleetSaltFingerprint("peppers"));
  EXPECT_NE(FleetSaltFingerprint(""), FleetSaltFingerprint("x"));
  // Pinned: SHA-256("tandem.fleet-salt.v1" "pepper"), first 16 bytes
  // (python3 -c "import hashlib;print(hashlib.sha256(b'tandem.fleet-salt.v1pepper').hexdigest()[:32])").
  EXPECT_EQ(fp, "5eea54f34f6e7af6fb35122f2e1b80bd");
}

TEST(BlockHash, ChainValuesPinned) {
  std::vector<uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 1u);
  const auto h = HashBlocks(RootHash(Ctx()), tokens, 16);
  ASSERT_EQ(h.size(), 2u);  // 40 tokens: two full blocks, the partial one is not hashed
  EXPECT_EQ(h[0], 0x38677f01ed0f5994ULL);
  EXPECT_EQ(h[1], 0x9d4bc3f57e2b52efULL);
}

TEST(BlockHash, TokensAreLittleEndianU32) {
  const uint32_t t[] = {0, 1, 0xffffffffu, 70000};
  EXPECT_EQ(HashBlock(0, t), 0x54eac96c555941b9ULL);
}

TEST(BlockHash, ChainDependsOnEveryEarlierBlock) {
  std::vector<uint32_t> a(64, 7), b(64, 7);
  b[3] = 8;  // differs in block 0 only
  const auto ha = HashBlocks(1, a, 16), hb = HashBlocks(1, b, 16);
  ASSERT_EQ(ha.size(), 4u);
  for (size_t i = 0; i < ha.size(); ++i) EXPECT_NE(ha[i], hb[i]) << "block " << i;
  // Same content, same chain.
  EXPECT_EQ(HashBlocks(1, a, 16), ha);
  // A prefix hashes to a prefix of the chain.
  const auto prefix = HashBlocks(1, std::span<const uint32_t>(a).first(32), 16);
  ASSERT_EQ(prefix.size(), 2u);
  EXPECT_EQ(prefix[0], ha[0]);
  EXPECT_EQ(prefix[1], ha[1]);
}

TEST(BlockHash, ShortPromptHasNoBlocks) {
  std::vector<uint32_t> t(15, 1);
  EXPECT_TRUE(HashBlocks(1, t, 16).empty());
}

}  // namespace
}  // namespace tandem
