// Coalescing of token messages for StreamWriter (common/stream_writer.h):
// when a stream's next message is still queued behind the write in flight,
// tokens that become ready are appended to it instead of queueing one more
// message. Nothing waits for a batch: a message is merged only into one that
// could not be sent yet anyway, so every token leaves as early as before and
// a slow or busy connection carries fewer, larger messages (issue 23).
//
// Each function returns true when `next` was merged into `queued` (then
// `next` must be dropped), false when both must be sent as they are. Only
// plain token messages merge; anything else (finish, usage, errors, the
// `registered` marker) ends the run of merges, so the order of every
// message the client can tell apart is kept.
#pragma once

#include "tandem/v1/generation.pb.h"
#include "tandem/v1/worker.pb.h"

namespace tandem {

// tandem.v1.GenerateResponse (proxy -> client): token_ids and text of two
// deltas of the same request, neither of them the final message. A field
// added to GenerateResponse must be added here (a message that sets it must
// not merge), or it would be lost.
inline bool MergeGenerateDelta(v1::GenerateResponse& queued, v1::GenerateResponse& next) {
  const auto plain = [](const v1::GenerateResponse& m) {
    return m.finish_reason() == v1::FINISH_REASON_UNSPECIFIED && !m.has_usage();
  };
  if (!plain(queued) || !plain(next) || queued.request_id() != next.request_id()) return false;
  queued.mutable_token_ids()->Add(next.token_ids().begin(), next.token_ids().end());
  queued.mutable_text()->append(next.text());
  return true;
}

// tandem.v1.DecodeResponse (decoder -> proxy): two TokenChunks of the same
// request where `next` starts right after `queued`.
inline bool MergeDecodeTokens(v1::DecodeResponse& queued, v1::DecodeResponse& next) {
  if (queued.kind_case() != v1::DecodeResponse::kTokens ||
      next.kind_case() != v1::DecodeResponse::kTokens || queued.request_id() != next.request_id()) {
    return false;
  }
  auto* q = queued.mutable_tokens();
  const auto& n = next.tokens();
  if (static_cast<uint64_t>(q->first_index()) + q->token_ids_size() != n.first_index()) return false;
  q->mutable_token_ids()->Add(n.token_ids().begin(), n.token_ids().end());
  return true;
}

}  // namespace tandem
