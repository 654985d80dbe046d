// common/tls_record.h: the key schedule against OpenSSL's own TLS13-KDF,
// records sealed and opened (10,000 of them against a fresh EVP context
// per record), and records that must not open. Wire compatibility with
// OpenSSL's TLS stack is frame_tls_records_test's.
#include "common/tls_record.h"

#include <gtest/gtest.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>

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
  for (auto [label, n] :
       {std::pair{"key", 16}, std::pair{"iv", 12}, std::pair{"traffic upd", 32}}) {
    std::vector<uint8_t> ours(static_cast<size_t>(n));
    ASSERT_TRUE(HkdfExpandLabelSha256(secret, label, ours).ok());
    EXPECT_EQ(ours, OpenSslExpandLabel(secret, label, static_cast<size_t>(n))) << label;
  }
}

struct Pair {
  TlsRecordCipher seal, open;
  Pair() {
    std::vector<uint8_t> secret(32, 0x5a);
    seal = std::move(
        TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kSeal).value());
    open = std::move(
        TlsRecordCipher::FromTrafficSecret(secret, TlsRecordCipher::Direction::kOpen).value());
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

// The record AES-128-GCM of a fresh EVP context keyed for this one record
// (nothing re-used): header || Enc(content || type || padding) || tag.
std::vector<uint8_t> EvpRecord(const std::vector<uint8_t>& key, const std::vector<uint8_t>& iv,
                               uint64_t seq, const std::vector<uint8_t>& content, uint8_t type,
                               size_t padding) {
  std::vector<uint8_t> inner = content;
  inner.push_back(type);
  inner.resize(inner.size() + padding, 0);
  const size_t body = inner.size() + kTlsRecordTagBytes;
  std::vector<uint8_t> rec(kTlsRecordHeaderBytes + body);
  rec[0] = 0x17;
  rec[1] = rec[2] = 0x03;
  rec[3] = static_cast<uint8_t>(body >> 8);
  rec[4] = static_cast<uint8_t>(body);
  uint8_t nonce[12];
  std::copy(iv.begin(), iv.end(), nonce);
  for (int i = 0; i < 8; ++i) nonce[11 - i] ^= static_cast<uint8_t>(seq >> (8 * i));
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int n = 0, m = 0, f = 0;
  EXPECT_EQ(EVP_EncryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key.data(), nonce), 1);
  EXPECT_EQ(EVP_EncryptUpdate(ctx, nullptr, &n, rec.data(), kTlsRecordHeaderBytes), 1);
  EXPECT_EQ(EVP_EncryptUpdate(ctx, rec.data() + kTlsRecordHeaderBytes, &m, inner.data(),
                              static_cast<int>(inner.size())),
            1);
  EXPECT_EQ(EVP_EncryptFinal_ex(ctx, rec.data() + kTlsRecordHeaderBytes + m, &f), 1);
  EXPECT_EQ(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, kTlsRecordTagBytes,
                                rec.data() + kTlsRecordHeaderBytes + inner.size()),
            1);
  EVP_CIPHER_CTX_free(ctx);
  return rec;
}

TEST(TlsRecordTest, TenThousandRecordsOfVaryingLengthMatchOpenSslsAesGcm) {
  // One sealing and one opening cipher, each keyed once, over 10,000
  // records of 0 to 2^14 bytes (many short ones, every cut of the 16-byte
  // blocks): each sealed record is byte for byte what a fresh EVP context
  // makes of it, and each EVP record (with 0-3 bytes of padding) opens to
  // its content.
  const std::vector<uint8_t> key = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const std::vector<uint8_t> iv = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
  auto seal = TlsRecordCipher::FromKeyIv(key, iv, TlsRecordCipher::Direction::kSeal);
  auto open = TlsRecordCipher::FromKeyIv(key, iv, TlsRecordCipher::Direction::kOpen);
  ASSERT_TRUE(seal.ok() && open.ok());
  uint32_t x = 7;
  for (uint64_t seq = 0; seq < 10'000; ++seq) {
    x = x * 1103515245u + 12345u;
    const size_t size = seq < 64       ? seq  // 0..63: every cut of the first blocks
                        : seq % 3 == 0 ? (x >> 8) % (kTlsMaxPlaintextBytes + 1)
                                       : (x >> 8) % 1100;
    std::vector<uint8_t> content(size);
    for (size_t i = 0; i < size; ++i) content[i] = static_cast<uint8_t>(i * 13 + seq);
    std::vector<uint8_t> ours(TlsRecordBytes(size));
    ASSERT_TRUE(seal->Seal(content, TlsContentType::kApplicationData, ours.data()).ok()) << seq;
    ASSERT_EQ(ours, EvpRecord(key, iv, seq, content, 23, 0))
        << "record " << seq << ", " << size << " bytes";
    std::vector<uint8_t> theirs = EvpRecord(key, iv, seq, content, 23, seq % 4);
    size_t n = 0;
    TlsContentType type{};
    ASSERT_TRUE(open->Open(theirs, &n, &type).ok()) << "record " << seq << ", " << size << " bytes";
    ASSERT_EQ(type, TlsContentType::kApplicationData);
    ASSERT_EQ(n, size);
    ASSERT_TRUE(std::equal(content.begin(), content.end(), theirs.begin() + kTlsRecordHeaderBytes))
        << seq;
  }
  EXPECT_EQ(seal->sequence(), 10'000u);
  EXPECT_EQ(open->sequence(), 10'000u);
}

TEST(TlsRecordTest, AnInnerPlaintextOver2To14Plus1BytesIsRefused) {
  // RFC 8446 5.4: content, type and padding together at most 2^14 + 1
  // bytes; 5.2's limit of 2^14 + 256 on the body is for every AEAD, so an
  // AES-GCM body can pass it and still decrypt to too much.
  const std::vector<uint8_t> key(16, 3), iv(12, 4);
  auto open = TlsRecordCipher::FromKeyIv(key, iv, TlsRecordCipher::Direction::kOpen);
  ASSERT_TRUE(open.ok());
  uint64_t seq = 0;
  size_t n = 0;
  TlsContentType type{};
  const std::vector<uint8_t> full(kTlsMaxPlaintextBytes, 'a');
  // At the limit: 2^14 of content, and 2^14 of padding after no content.
  std::vector<uint8_t> rec = EvpRecord(key, iv, seq++, full, 23, 0);
  ASSERT_TRUE(open->Open(rec, &n, &type).ok());
  EXPECT_EQ(n, kTlsMaxPlaintextBytes);
  rec = EvpRecord(key, iv, seq++, {}, 23, kTlsMaxPlaintextBytes);
  ASSERT_TRUE(open->Open(rec, &n, &type).ok());
  EXPECT_EQ(n, 0u);
  // One byte past it, by content or by padding; and 5.2's largest body.
  const std::vector<uint8_t> over(kTlsMaxPlaintextBytes + 1, 'b');
  for (const auto& bad :
       {EvpRecord(key, iv, seq, over, 23, 0), EvpRecord(key, iv, seq, full, 23, 1),
        EvpRecord(key, iv, seq, over, 23, 238)}) {
    ASSERT_LE(bad.size() - kTlsRecordHeaderBytes, kTlsMaxCiphertextBytes);
    std::vector<uint8_t> r = bad;
    const Status st = open->Open(r, &n, &type);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << bad.size();
    EXPECT_NE(st.message().find("the limit is 16385 bytes"), std::string::npos) << st.ToString();
  }
  // Refused records leave the sequence where it was.
  rec = EvpRecord(key, iv, seq, {'o', 'k'}, 23, 0);
  ASSERT_TRUE(open->Open(rec, &n, &type).ok());
  EXPECT_EQ(n, 2u);
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
