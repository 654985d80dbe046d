// The KvNotice payload (worker.proto) as the decoder reads it from the KV
// transport: bytes from a peer, parsed here and nowhere else (fuzzed in
// tests/fuzz/fuzz_kv_notice.cc). Pure function, any thread.
#pragma once

#include <string_view>

#include "common/status.h"
#include "decoder/decoder.h"

namespace tandem::decoder {

// INVALID_ARGUMENT when `payload` is not a KvNotice.
Result<KvNoticeInfo> ParseKvNotice(std::string_view payload);

}  // namespace tandem::decoder
