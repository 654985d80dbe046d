// The proxy's side of the multiplexed decode stream (worker.proto
// Decoder.DecodeStream, issue 23; docs/decode-stream.md): one stream per
// decoder carries every request this proxy routes there.
//
// Start() sends a DecodeStreamStart under a new handle and returns the
// request's Call; each batch read is split by handle and handed to the
// requests' DecodeEvents in order (registered, tokens, then exactly one of
// finished / error, an error item counting as `from_worker`). Cancel()
// sends a cancel item; nothing more reaches that request's events (nor
// after Call::Forget, which sends nothing: the quiet end). When the
// stream ends (the decoder or the connection is lost, or AbandonCalls),
// every request still on it gets on_error(UNAVAILABLE or the stream's
// status, from_worker = false), as its own Decode stream breaking would.
//
// Flow control: batches are handled on gRPC's reader thread as they come,
// and a request's events only enqueue into its client stream (the
// lifecycle's sink), so a slow client never holds up the others' tokens:
// what it has not read waits in its own client stream (at most its
// max_tokens tokens, coalesced into one message).
//
// Threads: Start and Call::Cancel from any thread; events run on gRPC's
// callback threads, one batch at a time.
#pragma once

#include <grpcpp/grpcpp.h>

#include <deque>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/handle_table.h"
#include "model/tokenizer.h"
#include "proxy/decode_mux_wire.h"
#include "proxy/worker_client.h"
#include "proxy/worker_client_grpc.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::proxy {

// Shared with the Decode RPC (worker_client_grpc.cc). FillDecodeRequestFields:
// every field but the prompt.
void FillDecodeRequest(const DecodeArgs& args, v1::DecodeRequest* req);
void FillDecodeRequestFields(const DecodeArgs& args, v1::DecodeRequest* req);
Finish FinishFromProto(v1::FinishReason r);

// A decode stream's start (a DecodeStreamRequest holding `start`) in parts
// for FrameConn::SendParts (issue 23, dec-parts; proxy/prompt_parts.h): the
// prompt is copied once, from where the proxy holds it into the
// connection's output, instead of into the message and out of it again.
// The parts, in order: DecodeStartPrefix(handle) (made under the stream's
// lock, once the handle is known), `head`, `prompt`, `tail`. With the
// prompt as fixed32 that is byte for byte the message's own serialization
// (fields in number order); with the client's varints (session 14,
// PromptForParts) the request's prompt_token_ids comes after its other
// fields, which protobuf parses to the same message. False (parts
// untouched) when the start is not sent so: no client varints and a
// decoder that reads only the varint field, no prompt, or a big-endian
// host.
struct DecodeStartParts {
  // The start's request field: tag, length, the request without its
  // prompt, the prompt field's tag and length.
  std::string head;
  std::string_view prompt;  // points into the args' prompt (or its varints)
  std::string tail;         // the start's traceparent field ("" when not traced)
  size_t bytes = 0;         // the start's bytes but its handle field's
};
bool DecodeStartInParts(const DecodeArgs& args, DecodeStartParts* out);
std::string DecodeStartPrefix(uint64_t handle, const DecodeStartParts& parts);

// The demultiplexer of one decode stream, whatever carries it (gRPC below,
// framed TCP in proxy/decode_mux_tcp_client.h): handles, the requests'
// events, cancels, and the end of the stream.
class DecodeMux : public GrpcWorkerClient::Tracked, public std::enable_shared_from_this<DecodeMux> {
 public:
  // A request on this stream. Null (and `events` left as they were) when
  // the stream is already over: the caller opens a new one.
  std::shared_ptr<Call> Start(const DecodeArgs& args, DecodeEvents& events);

  bool ended() const;
  size_t num_requests() const;  // started and not yet ended or cancelled
  // The receivers' token byte table (null: none): each batch read
  // prefetches its tokens' entries and bytes before the first delivery, so
  // that the detokenizers' misses overlap (issue 23, tok-chain).
  void SetTokenTable(const model::TokenBytesTable* table);

 protected:
  // Sends `msg` on the stream (mu_ is held; an implementation may release
  // it, and one that sends inline should: a batch read meanwhile then does
  // not wait behind the send). A request's Call is returned only after its
  // start's send, so its cancel always follows its start; starts and
  // cancels of different requests may reach the wire in either order.
  virtual void SendLocked(std::unique_lock<std::mutex>& lock, v1::DecodeStreamRequest msg) = 0;
  // A transport that writes frames from parts (SendsParts()) gets a start
  // as DecodeStartInParts' parts (SendPartsLocked, mu_ held and released
  // as by SendLocked), the rest as messages.
  virtual bool SendsParts() const { return false; }
  virtual void SendPartsLocked(std::unique_lock<std::mutex>& /*lock*/,
                               std::initializer_list<std::string_view> /*parts*/) {}
  // One batch read: each item to its request, in order (the reader thread).
  void Deliver(const v1::DecodeStreamResponse& batch);
  void Deliver(std::span<const DecodeItem> items);
  // The stream is over: every request still on it ends with `status` (the
  // abandon reason instead, when AbandonCalls ended it), from_worker = false.
  void EndAll(const Status& status);

  mutable std::mutex mu_;
  bool ended_ = false;  // guarded by mu_: EndAll ran (or is running)

 private:
  class Request;
  void CancelRequest(uint64_t handle);
  void ForgetRequest(uint64_t handle);

  uint64_t next_handle_ = 1;  // guarded by mu_
  const model::TokenBytesTable* token_table_ = nullptr;  // guarded by mu_
  HandleTable<std::shared_ptr<Request>> requests_;  // guarded by mu_
  std::vector<std::pair<std::shared_ptr<Request>, const DecodeItem*>> batch_;  // reader only
  std::vector<DecodeItem> items_;  // reader only: a parsed message's items
};

class DecodeMuxClient final
    : public DecodeMux,
      public grpc::ClientBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse> {
 public:
  // Opens the stream on `channel`; it lives until its RPC is done.
  static std::shared_ptr<DecodeMuxClient> Open(const std::shared_ptr<grpc::Channel>& channel);

  // ---- gRPC reactor ----
  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

  DecodeMuxClient() = default;  // use Open

 private:
  void SendLocked(std::unique_lock<std::mutex>& lock, v1::DecodeStreamRequest msg) override;
  void Pump(std::unique_lock<std::mutex>& lock);
  void CancelRpc() override { ctx_.TryCancel(); }

  std::unique_ptr<v1::Decoder::Stub> stub_;
  grpc::ClientContext ctx_;
  v1::DecodeStreamResponse resp_;  // the batch being read
  v1::DecodeStreamRequest current_;  // the message being written

  std::deque<v1::DecodeStreamRequest> queue_;  // guarded by mu_
  bool writing_ = false;                       // guarded by mu_
  std::shared_ptr<DecodeMuxClient> self_;  // keeps the reactor alive until OnDone
};

}  // namespace tandem::proxy
