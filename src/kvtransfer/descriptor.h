// The serialised endpoint + memory descriptor a transport exports and a peer
// imports. Binary, little-endian, versioned:
//   magic "TKVD" | u32 version | str backend | str agent | u64 generation |
//   u64 block_bytes | u32 num_blocks | u64 remote_base | bytes address |
//   bytes rkey | u64 checksum (XXH3 of everything before it)
// where str/bytes are u32 length + data. Pure functions, any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

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

  uint64_t pool_bytes() const { return block_bytes * num_blocks; }
};

std::string SerializeDescriptor(const PeerDescriptor& d);
// INVALID_ARGUMENT on truncation, bad magic/version or checksum mismatch.
Result<PeerDescriptor> ParseDescriptor(std::string_view bytes);

// Lower-case hex, for carrying descriptors through text channels.
std::string ToHex(std::string_view bytes);
Result<std::string> FromHex(std::string_view hex);

}  // namespace tandem::kvtransfer
