// kvtransfer::KvCipher (transport.encrypt) and the KV secrets: a sealed
// block opens only with the same key, reservation, position, bytes and tag.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <random>
#include <vector>

#include "kvtransfer/kv_cipher.h"
#include "kvtransfer/kv_secret.h"

namespace tandem::kvtransfer {
namespace {

std::vector<std::byte> Block(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> b(n);
  for (auto& x : b) x = static_cast<std::byte>(rng());
  return b;
}

struct Sealed {
  std::vector<std::byte> data;
  std::array<std::byte, kKvTagBytes> tag;
};

Sealed SealOne(const std::string& key, uint64_t reservation, uint32_t position,
               const std::vector<std::byte>& plain) {
  auto c = KvCipher::Create(key, reservation);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  Sealed s;
  s.data.resize(plain.size());
  EXPECT_TRUE(c->Seal(position, plain.data(), s.data.data(), plain.size(), s.tag.data()).ok());
  return s;
}

class KvCipherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto k = NewKvKey();
    ASSERT_TRUE(k.ok());
    key_ = *k;
    plain_ = Block(4096 + 7, 1);  // not a multiple of the AES block
  }
  Status Open(const std::string& key, uint64_t reservation, uint32_t position, Sealed s) {
    auto c = KvCipher::Create(key, reservation);
    EXPECT_TRUE(c.ok());
    return c->Open(position, s.data.data(), s.data.size(), s.tag.data());
  }
  std::string key_;
  std::vector<std::byte> plain_;
};

TEST_F(KvCipherTest, SealedBlockOpensInPlaceToThePlaintext) {
  Sealed s = SealOne(key_, 77, 3, plain_);
  EXPECT_NE(s.data, plain_);  // really encrypted
  auto c = KvCipher::Create(key_, 77);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Open(3, s.data.data(), s.data.size(), s.tag.data()).ok());
  EXPECT_EQ(s.data, plain_);
  // In place on the sealing side too (out == in), and a reused cipher.
  std::vector<std::byte> inplace = plain_;
  std::array<std::byte, kKvTagBytes> tag;
  ASSERT_TRUE(c->Seal(4, inplace.data(), inplace.data(), inplace.size(), tag.data()).ok());
  ASSERT_TRUE(c->Open(4, inplace.data(), inplace.size(), tag.data()).ok());
  EXPECT_EQ(inplace, plain_);
}

TEST_F(KvCipherTest, TamperedMisplacedOrForeignBlocksAreRefusedAsDataLoss) {
  const Sealed good = SealOne(key_, 77, 3, plain_);
  Sealed flipped = good;
  flipped.data[100] ^= std::byte{1};
  EXPECT_EQ(Open(key_, 77, 3, flipped).code(), StatusCode::kDataLoss);
  Sealed last = good;
  last.data.back() ^= std::byte{0x80};
  EXPECT_EQ(Open(key_, 77, 3, last).code(), StatusCode::kDataLoss);
  Sealed bad_tag = good;
  bad_tag.tag[0] ^= std::byte{1};
  EXPECT_EQ(Open(key_, 77, 3, bad_tag).code(), StatusCode::kDataLoss);
  EXPECT_EQ(Open(key_, 77, 4, good).code(), StatusCode::kDataLoss);   // another slot position
  EXPECT_EQ(Open(key_, 78, 3, good).code(), StatusCode::kDataLoss);   // another reservation
  auto other = NewKvKey();
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(Open(*other, 77, 3, good).code(), StatusCode::kDataLoss);  // another key
  EXPECT_TRUE(Open(key_, 77, 3, good).ok());
}

TEST_F(KvCipherTest, KeyOfTheWrongSizeIsRefused) {
  auto c = KvCipher::Create(std::string(16, 'k'), 1);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("32"), std::string::npos) << c.status().message();
}

TEST(KvSecret, CapabilitiesAreRandomAndCompareExactly) {
  auto a = NewCapability();
  auto b = NewCapability();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), kCapabilityBytes);
  EXPECT_NE(*a, *b);
  EXPECT_TRUE(SecretEquals(*a, *a));
  EXPECT_FALSE(SecretEquals(*a, *b));
  EXPECT_FALSE(SecretEquals(*a, a->substr(0, 15)));
  EXPECT_FALSE(SecretEquals(*a, ""));
  std::string c = *a;
  c[15] = static_cast<char>(c[15] ^ 1);
  EXPECT_FALSE(SecretEquals(*a, c));
}

}  // namespace
}  // namespace tandem::kvtransfer
