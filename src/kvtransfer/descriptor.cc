#include "kvtransfer/descriptor.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cstring>

namespace tandem::kvtransfer {
namespace {

constexpr char kMagic[4] = {'T', 'K', 'V', 'D'};
constexpr uint32_t kMaxFieldBytes = 1u << 20;  // worker addresses and rkeys are far smaller

template <typename T>
void PutInt(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutBytes(std::string& out, std::string_view s) {
  PutInt<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

// Reads fields in order; the first failure is kept with the field's name,
// so that a bad descriptor says where it broke.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool Int(const char* field, T& v) {
    if (!error_.ok()) return false;
    if (in_.size() - pos_ < sizeof(T)) return Truncated(field, sizeof(T));
    v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<T>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
    }
    pos_ += sizeof(T);
    return true;
  }
  bool Bytes(const char* field, std::string& s, uint32_t max_bytes = kMaxFieldBytes) {
    uint32_t n = 0;
    if (!Int(field, n)) return false;
    if (n > max_bytes) {
      error_ = InvalidArgumentError(fmt::format(
          "KV descriptor: field '{}' is {} bytes; at most {} are allowed", field, n, max_bytes));
      return false;
    }
    if (in_.size() - pos_ < n) return Truncated(field, n);
    s.assign(in_.substr(pos_, n));
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  const Status& error() const { return error_; }

 private:
  bool Truncated(const char* field, size_t need) {
    error_ = InvalidArgumentError(
        fmt::format("KV descriptor: truncated in field '{}' (needs {} bytes at offset {}, {} left)",
                    field, need, pos_, in_.size() - pos_));
    return false;
  }
  std::string_view in_;
  size_t pos_ = 0;
  Status error_;
};

}  // namespace

std::string SerializeDescriptor(const PeerDescriptor& d) {
  std::string out(kMagic, sizeof(kMagic));
  PutInt<uint32_t>(out, kDescriptorVersion);
  PutBytes(out, d.backend);
  PutBytes(out, d.agent_name);
  PutInt<uint64_t>(out, d.generation);
  PutInt<uint64_t>(out, d.block_bytes);
  PutInt<uint32_t>(out, d.num_blocks);
  PutInt<uint64_t>(out, d.remote_base);
  PutBytes(out, d.address);
  PutBytes(out, d.rkey);
  PutInt<uint32_t>(out, d.process.pid);
  PutInt<uint64_t>(out, d.process.start_time_ticks);
  PutInt<uint64_t>(out, d.process.pid_namespace);
  PutBytes(out, d.process.boot_id);
  PutInt<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

Result<PeerDescriptor> ParseDescriptor(std::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) + 12 || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return InvalidArgumentError(
        fmt::format("KV descriptor: not a tandem descriptor ({} bytes)", bytes.size()));
  }
  Reader r(bytes.substr(4));
  PeerDescriptor d;
  uint32_t version = 0;
  if (!r.Int("version", version) || version < 1 || version > kDescriptorVersion) {
    return InvalidArgumentError(fmt::format(
        "KV descriptor: version {} unsupported (this build reads 1 to {})", version,
        kDescriptorVersion));
  }
  // Each read is a no-op once one failed; r.error() names the first.
  r.Bytes("backend", d.backend);
  r.Bytes("agent", d.agent_name);
  r.Int("generation", d.generation);
  r.Int("block_bytes", d.block_bytes);
  r.Int("num_blocks", d.num_blocks);
  r.Int("remote_base", d.remote_base);
  r.Bytes("address", d.address);
  r.Bytes("rkey", d.rkey);
  if (version >= 2) {
    // A v1 descriptor (an older peer mid-upgrade) has no identity: unknown,
    // which keeps the handshake's plain timeout for it.
    r.Int("pid", d.process.pid);
    r.Int("start_time_ticks", d.process.start_time_ticks);
    r.Int("pid_namespace", d.process.pid_namespace);
    r.Bytes("boot_id", d.process.boot_id, kMaxBootIdBytes);
  }
  if (!r.error().ok()) return r.error();
  const size_t body_bytes = 4 + r.pos();
  uint64_t checksum = 0;
  if (!r.Int("checksum", checksum)) return r.error();
  if (checksum != XXH3_64bits(bytes.data(), body_bytes)) {
    return InvalidArgumentError("KV descriptor: checksum mismatch (corrupted in transit?)");
  }
  if (4 + r.pos() != bytes.size()) {
    return InvalidArgumentError(fmt::format("KV descriptor: {} trailing bytes after the checksum",
                                            bytes.size() - 4 - r.pos()));
  }
  return d;
}

std::string ToHex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

Result<std::string> FromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return InvalidArgumentError("hex string has an odd length");
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgumentError(fmt::format("bad hex digit at {}", 2 * i));
    out[i] = static_cast<char>((hi << 4) | lo);
  }
  return out;
}

}  // namespace tandem::kvtransfer
