// The decoder's side of the multiplexed decode stream (worker.proto
// Decoder.DecodeStream, issue 23; docs/decode-stream.md).
//
// One reactor per stream (one per proxy connection). Each DecodeStreamStart
// registers a request with the Decoder exactly as a Decode RPC would (same
// DecodeSpec, same attempt key); its sink appends the request's events to
// the stream's next batch (decoder/decode_mux_batch.h). A batch leaves when
// the engine's delivery of a step ends (common/delivery_scope.h: one
// message per step for all of this proxy's requests), or at once for events
// outside a delivery (a lease expiring, a KV notice refused). One write is
// in flight at a time; what comes meanwhile waits in the one pending batch,
// which leaves as soon as that write is done (never held back to batch).
//
// Per request, as with Decode: `registered` first (only once Register
// accepted it; a refusal is an in-band error item), then tokens, then one
// end. A cancel item from the proxy cancels that registration only. The
// stream ending (the proxy went away, a write failed) cancels every request
// still on it.
#pragma once

#include <grpcpp/grpcpp.h>

#include "decoder/decoder.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::decoder {

// The Decoder registration of a DecodeRequest (under its attempt key,
// worker/attempt_key.h), shared by Decode and DecodeStream.
DecodeSpec DecodeSpecFromProto(const v1::DecodeRequest& req);
v1::FinishReason FinishReasonToProto(engine::FinishReason r);

// A new DecodeStream reactor around `decoder` (borrowed; it must outlive
// the stream). It deletes itself when the RPC is done.
grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>* NewDecodeMuxReactor(
    Decoder& decoder);

}  // namespace tandem::decoder
