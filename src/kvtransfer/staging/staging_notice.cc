#include "kvtransfer/staging/staging_notice.h"

#include <fmt/format.h>

#include <cstring>

namespace tandem::kvtransfer::staging {
namespace {

constexpr std::string_view kMagic = "TSTG";
constexpr uint8_t kVersion = 1;

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(std::string_view s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(s[at + i])} << (8 * i);
  return v;
}

}  // namespace

std::string EncodeStagingNotice(const StagingNotice& n) {
  std::string out(kMagic);
  out.push_back(static_cast<char>(kVersion));
  out.push_back(static_cast<char>(n.kind));
  PutU64(out, n.count);
  if (n.kind == StagingNotice::Kind::kManifest) {
    PutU32(out, static_cast<uint32_t>(n.ranges.size()));
    for (const Range& r : n.ranges) {
      PutU64(out, r.offset);
      PutU64(out, r.length);
    }
  } else {
    out += n.payload;
  }
  return out;
}

Result<std::optional<StagingNotice>> DecodeStagingNotice(std::string_view wire) {
  if (wire.size() < kMagic.size() || wire.substr(0, kMagic.size()) != kMagic) {
    return std::optional<StagingNotice>();
  }
  if (wire.size() < kHeaderBytes) return DataLossError("staging notice: truncated header");
  if (static_cast<uint8_t>(wire[4]) != kVersion) {
    return DataLossError(fmt::format("staging notice: version {} (this build reads {})",
                                     static_cast<int>(static_cast<uint8_t>(wire[4])), kVersion));
  }
  StagingNotice n;
  const auto kind = static_cast<uint8_t>(wire[5]);
  n.count = GetLe(wire, 6, 8);
  if (kind == static_cast<uint8_t>(StagingNotice::Kind::kUser)) {
    n.kind = StagingNotice::Kind::kUser;
    n.payload = std::string(wire.substr(kHeaderBytes));
    return std::optional<StagingNotice>(std::move(n));
  }
  if (kind != static_cast<uint8_t>(StagingNotice::Kind::kManifest)) {
    return DataLossError(fmt::format("staging notice: unknown kind {}", static_cast<int>(kind)));
  }
  n.kind = StagingNotice::Kind::kManifest;
  if (wire.size() < kHeaderBytes + 4) return DataLossError("staging notice: truncated manifest");
  const uint64_t count = GetLe(wire, kHeaderBytes, 4);
  if (wire.size() != kHeaderBytes + 4 + count * kManifestRangeBytes) {
    return DataLossError(fmt::format("staging notice: manifest of {} ranges has {} bytes", count,
                                     wire.size()));
  }
  n.ranges.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    const size_t at = kHeaderBytes + 4 + i * kManifestRangeBytes;
    n.ranges[i] = {GetLe(wire, at, 8), GetLe(wire, at + 8, 8)};
  }
  return std::optional<StagingNotice>(std::move(n));
}

}  // namespace tandem::kvtransfer::staging
