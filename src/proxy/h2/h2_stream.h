// One HTTP/2 stream of the native gRPC front end: one gRPC call, its
// request as read so far, its queued response, and the request lifecycle
// it started (docs/grpc-frontend.md).
//
// Three groups of fields, three owners:
//  - the request: the connection's event thread, under the connection's mu_;
//  - the outbox (what the call has to send): any thread, under the
//    connection's out_mu_ (producers run under the lifecycle's mutex and
//    only append there);
//  - the session side (bytes handed to nghttp2): under the connection's mu_.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "proxy/lifecycle.h"
#include "proxy/tenants.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::proxy::h2 {

class H2Connection;

enum class Method { kUnknown, kGenerate, kListModels, kHealthCheck, kHealthWatch, kReflection };

struct H2Stream {
  explicit H2Stream(int32_t stream_id) : id(stream_id) {}
  const int32_t id;
  // ---- Read with the id for every WINDOW_UPDATE (connection mu_): one line.
  bool in_session = true;  // false once the stream closed (left the connection's map)
  // The client's flow-control window for this stream: the connection
  // writes the DATA frames itself and counts it (docs/grpc-frontend.md
  // "Response DATA and flow control").
  int64_t send_window = 0;
  std::weak_ptr<H2Connection> conn;

  // ---- The request (event thread, connection mu_).
  std::string method;  // :method
  std::string path;    // :path
  std::string content_type;
  std::string authorization;
  std::string traceparent;
  std::string grpc_timeout;
  Method kind = Method::kUnknown;
  uint8_t prefix[5] = {};
  size_t prefix_got = 0;    // bytes of the 5-byte message prefix read
  uint32_t msg_len = 0;     // from the prefix
  std::string body;         // the message, without its prefix
  size_t extra_bytes = 0;   // DATA past the first message (an error)
  bool headers_done = false;
  bool request_done = false;  // END_STREAM received
  std::atomic<bool> answered{false};  // a status was posted: later DATA is dropped
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();

  // ---- The outbox (connection out_mu_).
  // Generate's response, kept as its fields until the session takes it and
  // encoded then (grpc_wire.h AppendGenerateResponse): a token delta, into
  // which later deltas merge while it is queued (common/token_merge.h's
  // rule: only plain deltas merge), then the final message.
  bool delta_queued = false;
  std::vector<uint32_t> delta_ids;
  std::string delta_text;
  bool final_queued = false;  // finish_reason + usage, after the delta
  int32_t final_reason = 0;
  uint32_t final_usage[3] = {};  // prompt, completion, cached prompt tokens
  std::string pending_raw;    // framed messages of unary methods
  bool OutboxEmpty() const { return !delta_queued && !final_queued && pending_raw.empty(); }
  bool finishing = false;  // the status below is final
  int status_code = 0;
  std::string status_message;
  long long retry_after_s = 0;  // trailing "retry-after" when > 0
  int http_status = 200;
  bool out_closed = false;  // the stream is gone: posts are dropped
  bool dirty = false;       // on the connection's dirty list

  // ---- The session side (connection mu_).
  // Framed messages the connection writes as DATA frames: its flush moves
  // the outbox here (under out_mu_, once per flush for all its streams).
  std::string wire;
  size_t wire_off = 0;
  bool wire_final = false;  // the status is final: after `wire`, the trailers
  bool outbox_waits = false;  // a flush left the outbox (the wire was not out yet)
  bool submitted = false;  // response HEADERS submitted
  bool headers_out = false;  // ... and in the connection's output: DATA may follow
  bool sending = false;      // on the connection's sending list
  bool eof = false;          // the wire is all out and the trailers submitted

  // ---- The call.
  std::mutex call_mu;
  std::shared_ptr<RequestLifecycle> lifecycle;  // guarded by call_mu
  bool call_closed = false;                     // guarded by call_mu: no lifecycle may start
  const Tenant* tenant = nullptr;
  bool admitted = false;  // holds a Frontend::Admit slot
  std::atomic<bool> released{false};
  std::string request_id;
};

}  // namespace tandem::proxy::h2
