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

// Where one stream's batches go: the gRPC reactor, or a framed TCP
// connection (decoder/decode_mux_tcp.h). Called by one thread at a time.
class MuxOutput {
 public:
  virtual ~MuxOutput() = default;
  // Writes `batch` (kept unchanged until the write is done). True: done
  // (the next batch may follow at once); false: in flight, the session's
  // OnWriteDone follows.
  virtual bool Write(const v1::DecodeStreamResponse& batch) = 0;
  // The stream is over and nothing is in flight.
  virtual void EndStream() = 0;
};

class MuxState;

// The transport-independent part of one decode stream: starts and cancels
// in, one batch per delivery out through `out` (borrowed; the reactor or
// connection that owns this session). Requests come from one thread at a
// time (the transport's reader); Close may come from any.
class MuxSession {
 public:
  // `keep` (may be null) keeps `out` alive as long as a sink may write.
  MuxSession(Decoder& decoder, MuxOutput* out, std::shared_ptr<MuxOutput> keep = nullptr);
  void OnRequest(const v1::DecodeStreamRequest& req);
  void OnWriteDone(bool ok);
  // The stream is over: cancels every request still on it. Idempotent.
  void Close();

 private:
  void Start(const v1::DecodeStreamStart& start);

  Decoder& decoder_;
  std::shared_ptr<MuxState> state_;
};

}  // namespace tandem::decoder
