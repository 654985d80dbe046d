// libFuzzer target: the TLS 1.3 record layer of the framed connections after
// their handshake (common/frame_tls_records.h, common/tls_record.h; the bytes
// any peer that completed a handshake can send). The input is a script that
// builds a byte stream of records with a sealer of its own (OpenSSL's EVP
// AES-128-GCM, keyed per record, written from RFC 8446 5.2): records of
// any length, inner type and padding, unprotected or malformed headers, a
// flipped byte, a skipped sequence number, another legacy version. The
// stream is read by FrameTlsRecords::Open whole, in reads cut by the
// input's bytes and, when short, one byte per read; every way must deliver
// what an RFC reader of the same bytes delivers (the content of the
// application records before the first bad one, in order) and end the same
// way (none, or the reader's kind of error). The script's other op seals
// bytes with FrameTlsRecords::Seal, which the EVP reader must open back.
#include <openssl/evp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/frame_tls_records.h"
#include "common/tls_record.h"
#include "fuzz_util.h"

namespace {

using tandem::FrameTlsRecords;
using tandem::TlsRecordCipher;

constexpr uint8_t kPeerKey[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
constexpr uint8_t kPeerIv[12] = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
constexpr uint8_t kOwnKey[16] = {41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56};
constexpr uint8_t kOwnIv[12] = {61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72};
constexpr size_t kHeader = 5, kTag = 16;
constexpr uint64_t kLastSeq = std::numeric_limits<uint64_t>::max();

void Nonce(const uint8_t iv[12], uint64_t seq, uint8_t out[12]) {
  std::copy(iv, iv + 12, out);
  for (int i = 0; i < 8; ++i) out[11 - i] ^= static_cast<uint8_t>(seq >> (8 * i));
}

// header (type 23, `version`, length) || AES-128-GCM(inner) || tag.
void SealRecord(const uint8_t key[16], const uint8_t iv[12], uint64_t seq, uint16_t version,
                const std::string& inner, std::string* out) {
  const size_t body = inner.size() + kTag;
  std::string rec(kHeader + body, '\0');
  auto* r = reinterpret_cast<uint8_t*>(rec.data());
  r[0] = 23;
  r[1] = static_cast<uint8_t>(version >> 8);
  r[2] = static_cast<uint8_t>(version);
  r[3] = static_cast<uint8_t>(body >> 8);
  r[4] = static_cast<uint8_t>(body);
  uint8_t nonce[12];
  Nonce(iv, seq, nonce);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int n = 0, m = 0, f = 0;
  const bool ok =
      EVP_EncryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key, nonce) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &n, r, kHeader) == 1 &&
      EVP_EncryptUpdate(ctx, r + kHeader, &m, reinterpret_cast<const uint8_t*>(inner.data()),
                        static_cast<int>(inner.size())) == 1 &&
      EVP_EncryptFinal_ex(ctx, r + kHeader + m, &f) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, kTag, r + kHeader + inner.size()) == 1;
  EVP_CIPHER_CTX_free(ctx);
  if (!ok) __builtin_trap();
  out->append(rec);
}

// Decrypts the record `rec` (header and body) with `seq`; false when its
// tag fails.
bool OpenRecord(const uint8_t key[16], const uint8_t iv[12], uint64_t seq, std::string_view rec,
                std::string* inner) {
  const size_t clen = rec.size() - kHeader - kTag;
  const auto* r = reinterpret_cast<const uint8_t*>(rec.data());
  uint8_t nonce[12];
  Nonce(iv, seq, nonce);
  inner->assign(clen, '\0');
  uint8_t tag[kTag];
  std::copy(r + kHeader + clen, r + kHeader + clen + kTag, tag);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int n = 0, m = 0, f = 0;
  uint8_t last[16];
  const bool ok = EVP_DecryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key, nonce) == 1 &&
                  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, kTag, tag) == 1 &&
                  EVP_DecryptUpdate(ctx, nullptr, &n, r, kHeader) == 1 &&
                  EVP_DecryptUpdate(ctx, reinterpret_cast<uint8_t*>(inner->data()), &m, r + kHeader,
                                    static_cast<int>(clen)) == 1 &&
                  EVP_DecryptFinal_ex(ctx, last, &f) == 1;
  EVP_CIPHER_CTX_free(ctx);
  return ok;
}

// How reading a stream ends.
enum class End {
  kNone,         // every whole record was application data; a partial one waits
  kUnprotected,  // an outer type other than application data (23)
  kTooLong,      // a body over 2^14 + 256 (RFC 8446 5.2)
  kRefused,      // too short, the sequence spent, inner plaintext over 2^14 + 1 (5.4), a
                 // failed tag, all padding
  kClosed,       // an alert close_notify
  kAlert,        // another alert
  kHandshake,    // a handshake message
  kOtherType,    // any other inner type (or an alert or handshake too short to name)
};

struct Reading {
  std::string content;
  End end = End::kNone;
};

// RFC 8446 5.2 / 5.4 / 6 as a reader of `s`: what FrameTlsRecords must
// deliver and how it must end. The sequence number is never used at 2^64 - 1
// (frame_tls_records.h: the connection closes before it would wrap).
Reading ReadLikeTheRfc(std::string_view s, uint64_t seq) {
  Reading out;
  size_t o = 0;
  std::string inner;
  while (s.size() - o >= kHeader) {
    const auto* h = reinterpret_cast<const uint8_t*>(s.data() + o);
    const size_t body = size_t{h[3]} << 8 | h[4];
    if (h[0] != 23) return out.end = End::kUnprotected, out;
    if (body > (size_t{1} << 14) + 256) return out.end = End::kTooLong, out;
    if (s.size() - o < kHeader + body) break;
    if (body < 1 + kTag || seq == kLastSeq || body - kTag > (size_t{1} << 14) + 1 ||
        !OpenRecord(kPeerKey, kPeerIv, seq, s.substr(o, kHeader + body), &inner)) {
      return out.end = End::kRefused, out;
    }
    ++seq;
    o += kHeader + body;
    const size_t last = inner.find_last_not_of('\0');
    if (last == std::string::npos) return out.end = End::kRefused, out;
    const auto type = static_cast<uint8_t>(inner[last]);
    inner.resize(last);
    if (type == 23) {
      out.content += inner;
    } else if (type == 21 && inner.size() >= 2) {
      return out.end = inner[1] == 0 ? End::kClosed : End::kAlert, out;
    } else if (type == 22 && !inner.empty()) {
      return out.end = End::kHandshake, out;
    } else {
      return out.end = End::kOtherType, out;
    }
  }
  return out;
}

// The kind of FrameTlsRecords' error, from its message.
End KindOf(const tandem::Status& st) {
  if (st.ok()) return End::kNone;
  const std::string& m = st.message();
  auto has = [&](std::string_view x) { return m.find(x) != std::string::npos; };
  if (has("sent an unprotected TLS record")) return End::kUnprotected;
  if (has("the limit is 16640 bytes")) return End::kTooLong;
  if (has("was refused")) return End::kRefused;
  if (has("closed the connection")) return End::kClosed;
  if (has("sent TLS alert")) return End::kAlert;
  if (has("(handshake type")) return End::kHandshake;
  if (has("only application data is taken")) return End::kOtherType;
  __builtin_trap();  // an error of no kind the header names
}

std::unique_ptr<FrameTlsRecords> Layer(uint64_t first_seq) {
  auto seal =
      TlsRecordCipher::FromKeyIv(kOwnKey, kOwnIv, TlsRecordCipher::Direction::kSeal, first_seq);
  auto open =
      TlsRecordCipher::FromKeyIv(kPeerKey, kPeerIv, TlsRecordCipher::Direction::kOpen, first_seq);
  if (!seal.ok() || !open.ok()) __builtin_trap();
  return FrameTlsRecords::FromCiphers(std::move(*seal), std::move(*open), "peer");
}

// Reads `s` into a fresh layer in reads of the sizes `cut` gives, as
// FrameConn does (unread bytes kept at the front of the buffer).
template <typename Cut>
Reading ReadInPieces(std::string_view s, uint64_t first_seq, Cut cut) {
  auto layer = Layer(first_seq);
  std::vector<uint8_t> raw;
  size_t raw_off = 0;
  std::string in;
  size_t in_len = 0;
  Reading got;
  for (size_t i = 0, k = 0; i < s.size(); ++k) {
    const size_t n = std::min(s.size() - i, cut(k));
    raw.erase(raw.begin(), raw.begin() + static_cast<ptrdiff_t>(raw_off));
    raw_off = 0;
    raw.insert(raw.end(), s.begin() + static_cast<ptrdiff_t>(i),
               s.begin() + static_cast<ptrdiff_t>(i + n));
    i += n;
    const tandem::Status st = layer->Open(raw.data(), &raw_off, raw.size(), &in, &in_len);
    if (raw_off > raw.size() || in_len > in.size()) __builtin_trap();
    if (!st.ok()) {
      got.end = KindOf(st);
      break;
    }
  }
  got.content.assign(in.data(), in_len);
  return got;
}

// Seals `plain` with FrameTlsRecords::Seal after `earlier` records and
// checks the records against the EVP reader: records of at most 2^14 bytes
// of content, each whole, in order, opening to `plain`; refused exactly when
// one would need the sequence number 2^64 - 1.
void SealBack(uint64_t first_seq, size_t earlier, const std::string& plain) {
  auto layer = Layer(first_seq);
  std::vector<uint8_t> out;
  size_t out_len = 0;
  uint64_t seq = first_seq;
  for (size_t i = 0; i < earlier; ++i) {
    const uint8_t b = 'e';
    if (seq == kLastSeq) return;
    if (!layer->Seal(&b, 1, &out, &out_len).ok()) __builtin_trap();
    ++seq;
  }
  const size_t start = out_len;
  const size_t records = (plain.size() + (size_t{1} << 14) - 1) >> 14;
  const bool wraps = records > 0 && kLastSeq - seq < records;
  const tandem::Status st =
      layer->Seal(reinterpret_cast<const uint8_t*>(plain.data()), plain.size(), &out, &out_len);
  if (st.ok() == wraps) __builtin_trap();
  if (wraps) return;
  std::string_view s(reinterpret_cast<const char*>(out.data()) + start, out_len - start);
  std::string opened, inner;
  for (size_t o = 0, r = 0; o < s.size(); ++r, ++seq) {
    if (s.size() - o < kHeader) __builtin_trap();
    const auto* h = reinterpret_cast<const uint8_t*>(s.data() + o);
    const size_t body = size_t{h[3]} << 8 | h[4];
    if (h[0] != 23 || h[1] != 3 || h[2] != 3 || body < 1 + kTag || s.size() - o < kHeader + body) {
      __builtin_trap();
    }
    if (!OpenRecord(kOwnKey, kOwnIv, seq, s.substr(o, kHeader + body), &inner)) __builtin_trap();
    // No padding: the last byte is the type.
    if (inner.back() != 23) __builtin_trap();
    inner.pop_back();
    const size_t want = std::min(plain.size() - opened.size(), size_t{1} << 14);
    if (inner.size() != want || r >= records) __builtin_trap();
    opened += inner;
    o += kHeader + body;
  }
  if (opened != plain) __builtin_trap();
}

// Reads the script's bytes one at a time; past the end, zeros.
struct Script {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool done() const { return at >= size; }
  uint8_t Byte() { return at < size ? data[at++] : 0; }
  size_t Two() { return size_t{Byte()} << 8 | Byte(); }
  std::string Bytes(size_t n) {
    n = std::min(n, size - std::min(at, size));
    std::string b(reinterpret_cast<const char*>(data + at), n);
    at += n;
    return b;
  }
};

std::string Pattern(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 31 + seed);
  return s;
}

}  // namespace

// The script: one byte choosing the first sequence number (0, or 1-3
// before 2^64 - 1), then ops until the input ends, each an op byte and its
// arguments:
//   0 n BYTES         an application data record of n (< 256) bytes
//   1 HI LO           an application data record of (HI LO) % (2^14 + 300) bytes
//   2 TYPE n BYTES    a record of inner type TYPE
//   3 n PHI PLO TYPE BYTES   content n bytes, TYPE, then (PHI PLO) % (2^14 + 300) zeros
//   4 HI LO X         XOR X (odd) into byte (HI LO) of the last record
//   5 n BYTES         n bytes as they are (a header of any kind, junk)
//   6                 skip a sequence number
//   7 HI LO           the legacy version of the records after this one
//   8 HI LO           FrameTlsRecords::Seal of (HI LO) * 3 bytes, checked apart
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  if (!TlsRecordCipher::Available()) __builtin_trap();
  Script in{data, size};
  const uint8_t first = in.Byte() % 4;
  const uint64_t first_seq = first == 0 ? 0 : kLastSeq - first;
  uint64_t seq = first_seq;
  uint16_t version = 0x0303;
  std::string stream;
  size_t last_record = std::string::npos;
  auto seal = [&](const std::string& inner) {
    last_record = stream.size();
    SealRecord(kPeerKey, kPeerIv, seq++, version, inner, &stream);
  };
  size_t records = 0;
  while (!in.done() && records < 64) {
    const uint8_t op = in.Byte();
    switch (op % 9) {
      case 0: {
        const size_t n = in.Byte();
        seal(in.Bytes(n) + '\x17');
        break;
      }
      case 1:
        seal(Pattern(in.Two() % ((1u << 14) + 300), op) + '\x17');
        break;
      case 2: {
        const char type = static_cast<char>(in.Byte());
        const size_t n = in.Byte();
        seal(in.Bytes(n) + type);
        break;
      }
      case 3: {
        const size_t n = in.Byte();
        const size_t pad = in.Two() % ((1u << 14) + 300);
        const char type = static_cast<char>(in.Byte());
        seal(in.Bytes(n) + type + std::string(pad, '\0'));
        break;
      }
      case 4: {
        const size_t at = in.Two();
        const uint8_t x = in.Byte() | 1;
        if (last_record != std::string::npos) {
          const size_t n = stream.size() - last_record;
          stream[last_record + at % n] ^= static_cast<char>(x);
        }
        break;
      }
      case 5: {
        const size_t n = in.Byte();
        stream += in.Bytes(n);
        last_record = std::string::npos;
        break;
      }
      case 6:
        ++seq;
        break;
      case 7:
        version = static_cast<uint16_t>(in.Two());
        break;
      case 8: {
        const size_t n = in.Two() * 3;
        SealBack(first_seq, records % 3, Pattern(n, op));
        break;
      }
    }
    ++records;
  }

  const Reading want = ReadLikeTheRfc(stream, first_seq);
  auto check = [&](const Reading& got) {
    if (got.end != want.end || got.content != want.content) __builtin_trap();
  };
  check(ReadInPieces(stream, first_seq, [](size_t) { return std::numeric_limits<size_t>::max(); }));
  check(ReadInPieces(stream, first_seq, [&](size_t k) {
    return size == 0 ? size_t{1} : 1 + size_t{data[k % size]} * 67;
  }));
  if (stream.size() <= 4096) {
    check(ReadInPieces(stream, first_seq, [](size_t) { return size_t{1}; }));
  }
  return 0;
}
