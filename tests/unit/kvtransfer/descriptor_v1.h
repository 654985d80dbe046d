// A KV descriptor in the version-1 layout (builds before session 14: no
// process identity), written independently of descriptor.cc so that the
// tests pin the old format a peer mid-upgrade still sends:
//   "TKVD" | u32 1 | str backend | str agent | u64 generation |
//   u64 block_bytes | u32 num_blocks | u64 remote_base | bytes address |
//   bytes rkey | u64 XXH3 of everything before it
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kvtransfer/descriptor.h"

namespace tandem::kvtransfer::testing {

inline std::string SerializeDescriptorV1(const PeerDescriptor& d) {
  std::string out = "TKVD";
  auto put = [&out](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  auto str = [&](std::string_view s) {
    put(s.size(), 4);
    out.append(s);
  };
  put(1, 4);
  str(d.backend);
  str(d.agent_name);
  put(d.generation, 8);
  put(d.block_bytes, 8);
  put(d.num_blocks, 4);
  put(d.remote_base, 8);
  str(d.address);
  str(d.rkey);
  put(XXH3_64bits(out.data(), out.size()), 8);
  return out;
}

}  // namespace tandem::kvtransfer::testing
