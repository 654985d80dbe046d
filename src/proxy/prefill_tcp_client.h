// The proxy's side of Prefiller.Prefill over framed TCP (issue 23,
// docs/serving-workers.md "Prefill transport"): one framed connection per
// prefiller (common/frame_conn.h; mutual TLS when the internal plane is
// TLS) carries every Prefill call the proxy makes to it, each a PrefillFrame
// exchange told apart by a call id (worker.proto).
//
// A call's request frame is written inline by the thread that starts it
// (never blocking: what the socket does not take waits for the reader's
// POLLOUT). The proxy's frame loop (common/frame_loop.h: one thread for
// every Prefill and Watch connection) dials, runs the TLS handshake, reads
// the replies and runs each call's `done` (inside a
// DeliveryScope, so that the native front end flushes a batch of replies
// once); it also ends calls whose deadline passed (DEADLINE_EXCEEDED, as a
// gRPC client does, and a cancel frame so that the prefiller stops the
// work). A connection that cannot be dialled or authenticated, or that
// breaks, ends every call on it with UNAVAILABLE, as a broken gRPC channel
// does: the lifecycle then retries or migrates as before.
//
// Threads: Start, PrefillTcpCall::Cancel/Abandon and Stop from any thread
// (Stop not from the reader); `done` runs on the frame loop's thread,
// never inside Start or Cancel.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/frame_conn.h"
#include "common/frame_reader.h"
#include "proxy/worker_client.h"
#include "proxy/worker_client_grpc.h"

namespace tandem::v1 {
class PrefillRequest;
class PrefillResponse;
}  // namespace tandem::v1

namespace tandem::proxy {

// The Prefill request and reply, the same for both transports
// (worker_client_grpc.cc). FillPrefillRequestFields: every field but the
// prompt.
void FillPrefillRequest(const PrefillArgs& args, v1::PrefillRequest* req);
void FillPrefillRequestFields(const PrefillArgs& args, v1::PrefillRequest* req);
PrefillResult ToPrefillResult(const v1::PrefillResponse& resp);

// A Prefill request's PrefillFrame in parts for FrameConn::SendParts (issue
// 23): `head` holds the frame's fields but the call id (the timeout, the
// trace context, the request without its prompt), ending with the tag and
// length of the request's prompt field, and `prompt` is that field's
// bytes as the proxy holds them: the client's packed varints in
// prompt_token_ids (session 14, PromptForParts), else the ids'
// little-endian uint32s in prompt_token_ids_fixed32. The prompt is then
// copied once, into the connection's output, instead of into a message
// and out of it again. The call id's field (PrefillCallIdField) goes in
// front: a message's fields may come in any order. False (parts
// untouched) when the request is not sent so: no client varints and a
// worker that reads only the varint field, no prompt, or a big-endian
// host.
struct PrefillRequestParts {
  std::string head;
  std::string_view prompt;  // points into the args' prompt (or its varints)
};
bool PrefillRequestInParts(const PrefillArgs& args, uint64_t timeout_us, PrefillRequestParts* out);
std::string PrefillCallIdField(uint64_t call_id);

class PrefillTcpClient;

// One Prefill call on a PrefillTcpClient.
class PrefillTcpCall final : public Call, public GrpcWorkerClient::Tracked {
 public:
  PrefillTcpCall(std::weak_ptr<PrefillTcpClient> client, uint64_t id,
                 std::function<void(Result<PrefillResult>)> done)
      : client_(std::move(client)), id_(id), done_(std::move(done)) {}
  // Ends the call with CANCELLED (a cancel frame tells the prefiller).
  void Cancel() override;

 private:
  friend class PrefillTcpClient;
  void CancelRpc() override { Cancel(); }

  const std::weak_ptr<PrefillTcpClient> client_;
  const uint64_t id_;
  std::function<void(Result<PrefillResult>)> done_;  // run once, by the reader
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
};

class PrefillTcpClient final : public std::enable_shared_from_this<PrefillTcpClient> {
 public:
  // Starts the reader, which dials `address` ("host:port").
  static std::shared_ptr<PrefillTcpClient> Open(const std::string& address,
                                                std::shared_ptr<FrameTls> tls,
                                                FrameOptions options = {});
  ~PrefillTcpClient();

  // Sends the call's request; null when the connection has ended (the
  // caller opens a new one). `done` runs once, later, on the reader.
  std::shared_ptr<PrefillTcpCall> Start(const PrefillArgs& args,
                                        std::function<void(Result<PrefillResult>)> done);
  // Whether the connection has ended (no call can start on it).
  bool ended() const;
  // The "host:port" it dials.
  const std::string& address() const { return conn_->peer(); }
  size_t num_calls() const;
  // Ends the connection (its calls get UNAVAILABLE) and joins the reader.
  void Stop();

  explicit PrefillTcpClient(std::shared_ptr<FrameConn> conn);  // use Open

 private:
  friend class PrefillTcpCall;
  using Completion = std::pair<std::shared_ptr<PrefillTcpCall>, Result<PrefillResult>>;
  // The reader's hooks: runs due completions and returns the next
  // deadline; a frame; the completions of a read round; the end.
  std::chrono::steady_clock::time_point BeforeWait();
  void AfterProgress();
  void OnEnd(const Status& why);
  // The call's cancel: a cancel frame, and CANCELLED (or the abandon's
  // UNAVAILABLE) from the reader.
  void CancelCall(PrefillTcpCall& call);
  // Takes the call `id` out of calls_ (null when it is already over).
  std::shared_ptr<PrefillTcpCall> TakeLocked(uint64_t id);
  Status OnFrame(std::string_view payload, std::vector<Completion>& out);
  // Calls past their deadline: out of calls_, a cancel frame each.
  void ExpireLocked(std::chrono::steady_clock::time_point now, std::vector<Completion>& out);
  static void Complete(std::vector<Completion>& done);

  const std::shared_ptr<FrameConn> conn_;
  mutable std::mutex mu_;
  bool ended_ = false;                                           // guarded by mu_
  uint64_t next_id_ = 1;                                         // guarded by mu_
  std::map<uint64_t, std::shared_ptr<PrefillTcpCall>> calls_;    // guarded by mu_
  std::set<std::pair<std::chrono::steady_clock::time_point, uint64_t>> deadlines_;  // guarded by mu_
  // When the reader's current wait ends (max(): no timeout); a call with
  // an earlier deadline wakes it.
  std::chrono::steady_clock::time_point reader_until_;           // guarded by mu_
  std::vector<Completion> posted_;  // guarded by mu_: completions for the reader to run
  std::vector<Completion> done_;    // the reader thread only: completions to run now
  // Woken by Stop, a cancel's completion, an earlier deadline, output left.
  FrameReader reader_;  // last: its thread ends before the members above go
};

}  // namespace tandem::proxy
