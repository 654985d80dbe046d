// The framing of the multiplexed decode stream (worker.proto
// Decoder.DecodeStream, issue 23): what one DecodeStreamResponse carries.
//
// MuxBatcher assembles the batch the decoder sends next from per-request
// events, in the order they happen: for each request (handle) at most one
// item per batch in the common case — `registered`, then its new tokens,
// then its end (finished / error) — so that a decode step of N requests is
// one message of N items whatever the order of their deliveries. Tokens
// that do not continue the handle's item (never the case for one request's
// ordered events) start a new item, so nothing is reordered or lost.
//
// Not thread-safe: the owner (the stream's state) serializes the calls.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include "common/handle_table.h"
#include "common/status.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::decoder {

class MuxBatcher {
 public:
  void Registered(uint64_t handle);
  void Tokens(uint64_t handle, uint32_t first_index, std::span<const uint32_t> token_ids);
  void Finished(uint64_t handle, const v1::DecodeFinished& finished);
  void Error(uint64_t handle, const Status& status);
  // Removes the handle's open item from the batch when it holds the
  // request's first token (index 0) alone (and perhaps `registered`):
  // true then, and the handle has no item in this batch. False (nothing
  // changed) for any other item, or none (DecodeStreamStart.quiet_end_on_first_token).
  bool DropFirstTokenItem(uint64_t handle);

  bool empty() const { return batch_.items_size() == 0; }
  size_t num_items() const { return static_cast<size_t>(batch_.items_size()); }
  // The batch so far; the next event starts a new one.
  v1::DecodeStreamResponse Take();
  // Take() into `out` without allocating: `out`'s previous contents (a batch
  // already written) are cleared and kept for the next batch, whose items
  // and token arrays then reuse their memory (one message per decode step,
  // issue 23).
  void TakeInto(v1::DecodeStreamResponse* out);
  void Clear();

 private:
  // The handle's item in this batch that can still take events (no end yet).
  v1::DecodeStreamItem* Open(uint64_t handle);
  v1::DecodeStreamItem* Add(uint64_t handle);

  v1::DecodeStreamResponse batch_;
  // handle -> index in batch_ of its item without an end. A HandleTable
  // (common/handle_table.h): filled and cleared every batch without a node
  // allocated per item as std::unordered_map did (issue 23, tok-chain).
  // Handle 0 (refused by the stream: an error item) is never open.
  HandleTable<int> open_;
};

}  // namespace tandem::decoder
