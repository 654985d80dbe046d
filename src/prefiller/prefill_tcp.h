// Prefiller.Prefill over framed TCP (issue 23, docs/serving-workers.md
// "Prefill transport"): the same PrefillRequest / PrefillResponse and
// statuses as the gRPC service (prefiller_service.h), each message one
// PrefillFrame (worker.proto) on a framed connection (common/frame_conn.h),
// mutual TLS when the internal plane is TLS, many calls in flight on one
// connection told apart by the proxy's call ids.
//
// A request is read and submitted on the listener's I/O thread; the reply
// (a response or an error frame) is written inline by the thread that
// completes the prefill (engine, transfer or reservation callback): no
// hand-off. As with gRPC: a cancel frame cancels the work at any stage
// (nothing is replied to a cancelled call); a call's deadline (the frame's
// timeout, on this process's clock) ends it with DEADLINE_EXCEEDED and
// cancels the work; the connection breaking cancels every call on it, so
// that no KV block or reservation is left behind.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/frame_server.h"
#include "prefiller/prefiller.h"

namespace tandem::prefiller {

struct PrefillTcpOptions : FrameListenOptions {
  // An authenticated connection ended, after its calls were cancelled
  // (logs, tests).
  std::function<void(const std::string& peer, const Status& why)> on_closed;
};

// Serves Prefill of `prefiller` (borrowed: it must outlive the server) on a
// new listener.
Result<std::unique_ptr<FrameServer>> ServePrefillTcp(Prefiller& prefiller, PrefillTcpOptions options);

}  // namespace tandem::prefiller
