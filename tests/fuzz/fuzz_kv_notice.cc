// libFuzzer target: what a KV peer sends — the transport's notice framing
// (detail::DecodeNotice) and the KvNotice it carries
// (decoder::ParseKvNotice, as the decoder reads it), the staging path's
// manifest/user notices (staging::DecodeStagingNotice, cuda workers) and
// the hex that carries descriptors through text. Every input goes through
// all of them; whatever parses must survive a round trip. (Descriptors:
// fuzz_descriptor.)
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "decoder/kv_notice.h"
#include "fuzz_util.h"
#include "kvtransfer/descriptor.h"  // ToHex, FromHex
#include "kvtransfer/staging/staging_notice.h"
#include "kvtransfer/transport_base.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  namespace kv = tandem::kvtransfer;
  const std::string_view in(reinterpret_cast<const char*>(data), size);

  if (auto n = kv::detail::DecodeNotice(in); n.ok()) {
    const std::string again =
        kv::detail::EncodeNotice(n->target_generation, n->notification.sender_generation,
                                 n->notification.sender, n->notification.payload);
    if (again != in) __builtin_trap();
    (void)tandem::decoder::ParseKvNotice(n->notification.payload);
  }
  if (auto k = tandem::decoder::ParseKvNotice(in); k.ok()) {
    if (k->request_id.size() > size || k->kv_tags.size() > size ||
        k->block_checksums.size() * sizeof(uint64_t) > size) {
      __builtin_trap();
    }
  }
  namespace stg = kv::staging;
  if (auto s = stg::DecodeStagingNotice(in); s.ok() && s->has_value()) {
    const stg::StagingNotice& a = **s;
    if (a.ranges.size() * stg::kManifestRangeBytes > size || a.payload.size() > size) __builtin_trap();
    auto back = stg::DecodeStagingNotice(stg::EncodeStagingNotice(a));
    if (!back.ok() || !back->has_value()) __builtin_trap();
    const stg::StagingNotice& b = **back;
    if (b.kind != a.kind || b.count != a.count || b.payload != a.payload ||
        b.ranges.size() != a.ranges.size()) {
      __builtin_trap();
    }
    for (size_t i = 0; i < a.ranges.size(); ++i) {
      if (b.ranges[i].offset != a.ranges[i].offset || b.ranges[i].length != a.ranges[i].length) {
        __builtin_trap();
      }
    }
  }
  auto hex = kv::FromHex(in);
  if (hex.ok() && kv::ToHex(*hex).size() != size) __builtin_trap();
  return 0;
}
