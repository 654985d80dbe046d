// The serialised endpoint + memory descriptor a transport exports and a peer
// imports. Binary, little-endian, versioned (docs/kvtransfer.md,
// "Descriptor format"):
//   magic "TKVD" | u32 version | str backend | str agent | u64 generation |
//   u64 block_bytes | u32 num_blocks | u64 remote_base | bytes address |
//   bytes rkey |
//   (version 2:) u32 pid | u64 start_time_ticks | u64 pid_namespace |
//   str boot_id |
//   u64 checksum (XXH3 of everything before it)
// where str/bytes are u32 length + data. Version 1 (no process identity,
// from builds before session 14) is still read: its identity is unknown.
// Pure functions, any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "kvtransfer/process_identity.h"

namespace tandem::kvtransfer {

struct PeerDescriptor {
  std::string backend;  // "ucx" | "loopback"
  std::string agent_name;
  uint64_t generation = 0;
  uint64_t block_bytes = 0;
  uint32_t num_blocks = 0;
  uint64_t remote_base = 0;  // address of the pool in the peer's address space
  std::string address;       // ucx: worker address; loopback: empty
  std::string rkey;          // ucx: packed remote key; loopback: empty
  ProcessIdentity process;   // the exporting process; unknown from a v1 descriptor

  uint64_t pool_bytes() const { return block_bytes * num_blocks; }
};

inline constexpr uint32_t kDescriptorVersion = 2;

// Always writes kDescriptorVersion.
std::string SerializeDescriptor(const PeerDescriptor& d);
// Reads versions 1 and 2. INVALID_ARGUMENT naming the field on truncation
// or an over-long field, and on bad magic/version, checksum mismatch or
// trailing bytes.
Result<PeerDescriptor> ParseDescriptor(std::string_view bytes);

// Lower-case hex, for carrying descriptors through text channels.
std::string ToHex(std::string_view bytes);
Result<std::string> FromHex(std::string_view hex);

}  // namespace tandem::kvtransfer
