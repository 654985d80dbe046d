// The proxy's side of the decode stream over framed TCP (issue 23,
// docs/decode-stream.md "Transport"): the same protocol and demultiplexing
// as the gRPC DecodeStream (proxy/decode_mux_client.h), carried by one
// framed connection per decoder (common/frame_conn.h; mutual TLS when the
// internal plane is TLS).
//
// One reader thread per connection dials, runs the TLS handshake and reads
// each batch; the batch's items go to the requests' events on a gRPC
// thread when the public front end is gRPC C++ (see Post: the client writes
// they start must be made from gRPC's own threads to leave in one flush),
// else (the native front end) on the reader thread itself; starts and
// cancels are written inline by the thread that makes them, without the
// stream's handle lock that the reader's batches take (never blocking:
// what the socket does not take waits for the reader's POLLOUT).
// A connection that cannot be dialled or authenticated, or that breaks,
// ends every request on it with UNAVAILABLE (from_worker = false), as a
// broken gRPC stream does: retry before the first token, migration after.
//
// Threads: Start, Call::Cancel and Stop from any thread but the reader.
#pragma once

#include <grpcpp/alarm.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/frame_conn.h"
#include "common/frame_reader.h"
#include "proxy/decode_mux_client.h"

namespace tandem::proxy {

class DecodeMuxTcpClient final : public DecodeMux {
 public:
  // Starts the reader, which dials `address` ("host:port"). With
  // `deliver_on_grpc_thread`, batches reach the requests on a gRPC thread
  // (DrainPosted), else on the reader thread.
  static std::shared_ptr<DecodeMuxTcpClient> Open(const std::string& address,
                                                  std::shared_ptr<FrameTls> tls,
                                                  bool deliver_on_grpc_thread = true,
                                                  FrameOptions options = {});
  ~DecodeMuxTcpClient() override;

  // Ends the stream (its requests get UNAVAILABLE), joins the reader and
  // waits (boundedly) for what it posted to be delivered.
  void Stop();

  DecodeMuxTcpClient(std::shared_ptr<FrameConn> conn, bool deliver_on_grpc_thread);  // use Open

 private:
  // What the reader hands to a gRPC thread: a batch, or the stream's end.
  struct Posted {
    v1::DecodeStreamResponse batch;
    std::optional<Status> end;
  };
  // The reader's hooks.
  Status OnFrame(std::string_view payload);
  void OnEnd(const Status& why);
  void SendLocked(std::unique_lock<std::mutex>& lock, v1::DecodeStreamRequest msg) override;
  bool SendsParts() const override { return true; }
  void SendPartsLocked(std::unique_lock<std::mutex>& lock,
                       std::initializer_list<std::string_view> parts) override;
  // A send's status: a failure closes the connection; the reader then ends
  // every request.
  void Sent(const Status& st);
  void CancelRpc() override;
  // Queues `p` for DrainPosted on a gRPC thread (the reader thread).
  void Post(Posted p);
  // Delivers what was posted, in order (one gRPC thread at a time).
  void DrainPosted();

  const std::shared_ptr<FrameConn> conn_;
  const bool deliver_on_grpc_thread_;
  std::mutex post_mu_;
  // The reader's batch when it delivers itself: parsed into the same
  // message every step, so its items and their token arrays are reused.
  v1::DecodeStreamResponse inline_batch_;  // reader thread only
  // The reader's batch as ParseDecodeBatch reads it (the usual case; the
  // vectors keep their capacity from step to step).
  std::vector<DecodeItem> wire_items_;  // reader thread only
  std::vector<uint32_t> wire_ids_;      // reader thread only
  std::deque<Posted> posted_;   // guarded by post_mu_
  bool draining_ = false;       // guarded by post_mu_: an alarm is set or DrainPosted runs
  std::condition_variable drained_;  // draining_ went false
  std::unique_ptr<grpc::Alarm> alarm_;  // the reader's last alarm
  FrameReader reader_;  // last: its thread ends before the members above go
};

}  // namespace tandem::proxy
