// common/tls_record.h: the key schedule against OpenSSL's own TLS13-KDF,
// records sealed and opened, and records that must not open. Wire
// compatibility with OpenSSL's TLS stack is frame_tls_direct_test's.
#include "common/tls_record.h"

#include <gtest/gtest.h>
#include <openssl/core_names.h>
#include <openssl/kdf.h>

#include <limits>
#include <string>
#include <vector>

namespace tandem {
namespace {

std::vector<uint8_t> OpenSslExpandLabel(const std::vector<uint8_t>& secret, const char* label,
                                        size_t n) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "TLS13-KDF", nullptr);
  EVP_KDF_CTX* ctx = EVP_KDF_CTX_new(kdf);
  int mode = EVP_KDF_HKDF_MODE_EXPAND_ONLY;
  char digest[] = "SHA256";
  char prefix[] = "tls13 ";
  std::string l = label;
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_int(OSSL_KDF_PARAM_MODE, &mode),
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(secret.data()),
                                        secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_PREFIX, prefix, 6),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_LABEL, l.data(), l.size()),
      OSSL_PARAM_construct_end()};
  std::vector<uint8_t> out(n);
  EXPECT_EQ(EVP_KDF_derive(ctx, out.data(), n, params), 1);
  EVP_KDF_CTX_free(ctx);
  EVP_KDF_free(kdf);
  return out;
}

TEST(TlsRecordTest, HkdfExpandLabelMatchesOpenSslsTls13Kdf) {
  std::vector<uint8_t> secret(32);
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(i * 7 + 3);
  for (auto [label, n] : {std::pair{"key", 16}, std::pair{"iv", 12}, std::pair{"traffic upd", 32}}) {
    std::vector<uint8_t> ours(static_cast<size_t>(n));
    ASSERT_TRUE(HkdfExpandLabelSha256(secret, label, ours).ok());
    EXPECT_EQ(ours, OpenSslExpandLabel(secret, label, static_cast<size_t>(n))) << label;
  }
}

struct Pair {
  TlsRecordCipher seal, open;
  Pair() {
    std::vector<uint8_t> secret(32, 0x5a);
    seal = std::move(TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kSeal).value());
    open = std::move(TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kOpen).value());
  }
};

TEST(TlsRecordTest, RecordsOpenInOrderWithTheirContentAndType) {
  Pair p;
  for (size_t size : {size_t{0}, size_t{1}, size_t{512}, kTlsMaxPlaintextBytes}) {
    std::vector<uint8_t> msg(size);
    for (size_t i = 0; i < size; ++i) msg[i] = static_cast<uint8_t>(i * 31 + size);
    std::vector<uint8_t> rec(TlsRecordBytes(size));
    ASSERT_TRUE(p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data()).ok());
    EXPECT_EQ(rec[0], 0x17);
    EXPECT_EQ(rec[1], 0x03);
    EXPECT_EQ(rec[2], 0x03);
    EXPECT_EQ(size_t{rec[3]} << 8 | rec[4], size + 1 + kTlsRecordTagBytes);
    size_t n = 0;
    TlsContentType type{};
    ASSERT_TRUE(p.open.Open(rec, &n, &type).ok()) << size;
    EXPECT_EQ(type, TlsContentType::kApplicationData);
    ASSERT_EQ(n, size);
    EXPECT_TRUE(std::equal(msg.begin(), msg.end(), rec.begin() + kTlsRecordHeaderBytes));
  }
  EXPECT_EQ(p.seal.sequence(), 4u);
  EXPECT_EQ(p.open.sequence(), 4u);
}

TEST(TlsRecordTest, AFlippedByteOrAReplayedRecordFailsAuthentication) {
  Pair p;
  std::vector<uint8_t> msg(100, 'a');
  std::vector<uint8_t> rec(TlsRecordBytes(msg.size()));
  for (size_t at : {size_t{4}, size_t{5}, size_t{60}, rec.size() - 1}) {  // header, body, tag
    ASSERT_TRUE(p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data()).ok());
    std::vector<uint8_t> bad = rec;
    bad[at] ^= 0x01;
    size_t n = 0;
    TlsContentType type{};
    Status st = p.open.Open(bad, &n, &type);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << at;
    EXPECT_NE(st.message().find("authentication"), std::string::npos) << st.ToString();
    // Not opened: the sequence stays, so the intact record opens next.
    ASSERT_TRUE(p.open.Open(rec, &n, &type).ok()) << at;
    // The same record again (sequence moved on) does not.
    std::vector<uint8_t> again = rec;
    ASSERT_TRUE(p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data()).ok());
    EXPECT_FALSE(p.open.Open(again, &n, &type).ok());
    ASSERT_TRUE(p.open.Open(rec, &n, &type).ok());
  }
}

TEST(TlsRecordTest, TheInnerTypeIsReadPastThePadding) {
  // Seal appends the type byte it is given: sealing "hi" 21 0 with type 0
  // makes the inner plaintext "hi" 21 0 0, i.e. content "hi" of type alert
  // (21) and two bytes of padding.
  Pair p;
  const std::vector<uint8_t> inner = {'h', 'i', 21, 0};
  std::vector<uint8_t> rec(TlsRecordBytes(inner.size()));
  ASSERT_TRUE(p.seal.Seal(inner, static_cast<TlsContentType>(0), rec.data()).ok());
  size_t n = 0;
  TlsContentType type{};
  ASSERT_TRUE(p.open.Open(rec, &n, &type).ok());
  EXPECT_EQ(type, TlsContentType::kAlert);
  EXPECT_EQ(n, 2u);
}

TEST(TlsRecordTest, TooMuchForOneRecordIsRefused) {
  Pair p;
  std::vector<uint8_t> msg(kTlsMaxPlaintextBytes + 1);
  std::vector<uint8_t> rec(TlsRecordBytes(msg.size()));
  Status st = p.seal.Seal(msg, TlsContentType::kApplicationData, rec.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("16384"), std::string::npos) << st.ToString();
}

TEST(TlsRecordTest, TheSequenceNumberNeverWraps) {
  const std::vector<uint8_t> key(16, 1), iv(12, 2);
  constexpr uint64_t kLast = std::numeric_limits<uint64_t>::max() - 1;  // the last one used
  auto seal = TlsRecordCipher::FromKeyIv(key, iv, TlsRecordCipher::Direction::kSeal, kLast);
  auto open = TlsRecordCipher::FromKeyIv(key, iv, TlsRecordCipher::Direction::kOpen, kLast);
  ASSERT_TRUE(seal.ok() && open.ok());
  std::vector<uint8_t> msg(10, 'z');
  std::vector<uint8_t> rec(TlsRecordBytes(msg.size()));
  ASSERT_TRUE(seal->Seal(msg, TlsContentType::kApplicationData, rec.data()).ok());
  size_t n = 0;
  TlsContentType type{};
  ASSERT_TRUE(open->Open(rec, &n, &type).ok());
  EXPECT_EQ(n, msg.size());
  // Both directions are now at 2^64 - 1: no further record either way.
  Status st = seal->Seal(msg, TlsContentType::kApplicationData, rec.data());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("would wrap"), std::string::npos) << st.ToString();
  st = open->Open(rec, &n, &type);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("would wrap"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace tandem
