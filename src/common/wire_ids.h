// Repeated id fields of worker.proto that have a fixed-width twin (session
// 8, docs/serving-workers.md "Prompt and hash encoding"): prompt ids as
// fixed32 next to the packed-varint prompt_token_ids, block hashes as
// fixed64 next to block_hashes. A writer fills one of the two; a reader
// takes the fixed field when it is not empty, the varint one otherwise
// (what an older peer writes).
#pragma once

#include <google/protobuf/repeated_field.h>

#include <cstdint>
#include <span>

namespace tandem {

template <typename T>
std::span<const T> FixedOrVarint(const google::protobuf::RepeatedField<T>& fixed,
                                 const google::protobuf::RepeatedField<T>& varint) {
  const auto& f = fixed.empty() ? varint : fixed;
  return {f.data(), static_cast<size_t>(f.size())};
}

// DecodeRequest, PrefillRequest.
template <typename Req>
std::span<const uint32_t> PromptIdsOf(const Req& r) {
  return FixedOrVarint(r.prompt_token_ids_fixed32(), r.prompt_token_ids());
}

// KvEvent.Stored, KvEvent.Removed.
template <typename Ev>
std::span<const uint64_t> BlockHashesOf(const Ev& e) {
  return FixedOrVarint(e.block_hashes_fixed64(), e.block_hashes());
}

}  // namespace tandem
