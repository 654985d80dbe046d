// The notices of the staging path (staged_transport.h), carried as the
// payload of ordinary transport notices so the data bytes keep the wire
// format of every other transport (blocks at the same pool offsets):
//
//   manifest: sent with each staged chunk; lists the receiver pool ranges
//             the chunk wrote, so the receiver copies them host->device;
//   user:     the caller's notice, sent after every chunk of the transfer
//             (and of every earlier transfer to that peer) completed; it
//             says how many manifests the sender delivered to this
//             receiver before it, and the receiver hands it on only once
//             that many manifests' host->device copies are done.
//
// Layout (little-endian): "TSTG" | u8 version (1) | u8 kind (1 manifest,
// 2 user) | u64 manifests_before (user) or manifest sequence number |
// manifest: u32 n | n x (u64 offset, u64 length)   user: payload bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::kvtransfer::staging {

struct Range {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct StagingNotice {
  enum class Kind : uint8_t { kManifest = 1, kUser = 2 };
  Kind kind = Kind::kManifest;
  uint64_t count = 0;          // manifest: its sequence number; user: manifests delivered before it
  std::vector<Range> ranges;   // manifest only
  std::string payload;         // user only
};

inline constexpr uint64_t kHeaderBytes = 4 + 1 + 1 + 8;
inline constexpr uint64_t kManifestRangeBytes = 16;

std::string EncodeStagingNotice(const StagingNotice& n);
// nullopt: not a staging notice (a plain transport's notice, delivered as is);
// an error: a staging notice that is malformed.
Result<std::optional<StagingNotice>> DecodeStagingNotice(std::string_view wire);

}  // namespace tandem::kvtransfer::staging
