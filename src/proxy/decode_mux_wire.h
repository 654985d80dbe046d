// The items of one decode stream batch (worker.proto DecodeStreamResponse)
// as the proxy's demultiplexer reads them (proxy/decode_mux_client.h), and
// a reader of the batch's bytes that makes no protobuf message for what the
// decoder writes every step (tok-hops, issue 23; docs/decode-stream.md
// "Reading a batch").
//
// ParseDecodeBatch reads handle, registered, first_index, token_ids (packed
// or not) and finished, with protobuf's rules (a scalar's last value wins,
// repeated values append, a repeated sub-message merges, a field it does
// not know or of another wire type than its own is skipped, as protobuf
// keeps it aside as an unknown field). An error item, a group or bytes
// protobuf might refuse make it return false, and the caller parses the
// message with protobuf (ItemsOf): what a batch means never depends on the
// reader.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "tandem/v1/worker.pb.h"

namespace tandem::proxy {

struct DecodeItem {
  enum class End : uint8_t { kNone, kFinished, kError };
  uint64_t handle = 0;
  bool registered = false;
  uint32_t first_index = 0;
  std::span<const uint32_t> token_ids;
  End end = End::kNone;
  // kFinished: DecodeFinished's fields.
  int32_t finish_reason = 0;
  uint32_t completion_tokens = 0;
  uint32_t decoder_cached_prompt_tokens = 0;
  uint32_t prefill_cached_prompt_tokens = 0;
  // kError: the parsed message's (ItemsOf only).
  const v1::ErrorInfo* error = nullptr;
};

// Parses `bytes` into *items (their token_ids views of *ids, both cleared
// first; the vectors keep their capacity for the next batch). false: the
// bytes hold something this reader leaves to protobuf (*items then
// unspecified).
bool ParseDecodeBatch(std::string_view bytes, std::vector<DecodeItem>* items,
                      std::vector<uint32_t>* ids);

// The items of a parsed batch (views of `batch`, valid while it is).
void ItemsOf(const v1::DecodeStreamResponse& batch, std::vector<DecodeItem>* items);

}  // namespace tandem::proxy
