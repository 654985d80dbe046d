// The gRPC methods the native front end serves, over H2Stream:
// tandem.v1.Generation/Generate and /ListModels, grpc.health.v1.Health/Check
// and /Watch. Generate follows generation_service.cc step by step
// (authentication, rate, byte limit, admission, validation, the lifecycle,
// cancellation), so both front ends answer alike.
//
// All of these run on the event thread with the connection's mu_ held.
#pragma once

#include <memory>

#include "proxy/frontend.h"
#include "proxy/h2/h2_stream.h"

namespace tandem::proxy::h2 {

class H2Connection;

// The request's headers are complete: picks the method; answers at once
// what cannot be served (unknown method, not gRPC, bad grpc-timeout).
void OnRequestHeaders(H2Connection& c, const std::shared_ptr<H2Stream>& s);
// The message's 5-byte prefix arrived: refuses compressed or oversized
// messages before their bytes are buffered.
void OnMessagePrefix(H2Connection& c, const std::shared_ptr<H2Stream>& s);
// A client-streaming method's message is complete (s->body).
void OnStreamMessage(H2Connection& c, const std::shared_ptr<H2Stream>& s);
// The client half-closed: runs the call.
void OnRequestComplete(H2Connection& c, const std::shared_ptr<H2Stream>& s);
// The stream is gone (finished, reset by the client, connection lost):
// a running call is cancelled at the workers and its slot freed.
void OnStreamClosed(H2Stream& s, Frontend& fe);
// The deadline passed or the server shuts down: the call ends with `st`.
void AbortCall(H2Connection& c, const std::shared_ptr<H2Stream>& s, const Status& st);

}  // namespace tandem::proxy::h2
