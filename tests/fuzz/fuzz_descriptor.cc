// libFuzzer target: a KV transport descriptor as it comes off the network
// (a Reserve's prefiller descriptor at the decoder, a KV target's decoder
// descriptor at the prefiller): kvtransfer::ParseDescriptor, versions 1
// and 2 (docs/kvtransfer.md, "Descriptor format"). Whatever parses is
// bounded by the input and survives a round trip: exactly for the current
// version, and for version 1 with its identity unknown.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/process_identity.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  namespace kv = tandem::kvtransfer;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto d = kv::ParseDescriptor(in);
  if (!d.ok()) return 0;
  if (d->backend.size() + d->agent_name.size() + d->address.size() + d->rkey.size() +
          d->process.boot_id.size() > size ||
      d->process.boot_id.size() > kv::kMaxBootIdBytes) {
    __builtin_trap();
  }
  const uint32_t version = static_cast<uint32_t>(data[4]) | static_cast<uint32_t>(data[5]) << 8 |
                           static_cast<uint32_t>(data[6]) << 16 |
                           static_cast<uint32_t>(data[7]) << 24;
  const std::string again = kv::SerializeDescriptor(*d);
  if (version == kv::kDescriptorVersion) {
    if (again != in) __builtin_trap();
  } else {
    if (version != 1 || d->process != kv::ProcessIdentity{}) __builtin_trap();
    auto back = kv::ParseDescriptor(again);
    if (!back.ok() || kv::SerializeDescriptor(*back) != again) __builtin_trap();
  }
  // What the UCX transport decides from it (pure: no /proc read for the peer).
  (void)d->process.SameHostAndNamespace(kv::LocalProcessIdentity());
  return 0;
}
