// gRPC adapters of the prefiller (worker.proto): the tandem.v1.Prefiller
// callback service, and the DecoderLink that calls decoders' Reserve with
// the async (callback) stub and encodes KvNotice.
//
//   Prefill (unary): PrefillResponse once the KV and the notice reached the
//   decoder; RESOURCE_EXHAUSTED at once when the service queue is full, and
//   when the decoder refused the reservation (the proxy re-routes);
//   DEADLINE_EXCEEDED for work whose deadline passed in the queue; CANCELLED
//   after the caller cancelled (the work is stopped at any stage).
//
// Threads: gRPC callback threads; everything goes to the thread-safe
// Prefiller.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "common/tls.h"
#include "prefiller/prefiller.h"

namespace tandem::v1 {
class PrefillRequest;
class PrefillResponse;
class ReserveRequest;
class ReserveResponse;
}  // namespace tandem::v1

namespace tandem::prefiller {

// The PrefillRequest -> PrefillJob and PrefillResult -> PrefillResponse
// conversions, shared by the gRPC service and the framed TCP listener
// (prefill_tcp.h). The job is keyed by the request's attempt
// (worker/attempt_key.h); `traceparent` continues the caller's trace when
// tracing is on ("" = not traced).
PrefillJob ToPrefillJob(const v1::PrefillRequest& req, std::string_view traceparent);
void ToPrefillResponse(const std::string& request_id, const PrefillResult& r,
                       v1::PrefillResponse* resp);

// Decoder.Reserve's request and reply, the same for both transports (the
// gRPC link below and the framed one, prefiller/reserve_tcp_link.h): the
// request of `job` from this prefiller (`prefiller_descriptor`: its KV
// transport descriptor; `layout`: its rank layout); the call's deadline
// (the job's, at most kReserveTimeout from now); the reply as a target or
// the decoder's refusal. The request lets a decoder whose seats are all
// taken hold the call for one until kSeatWaitMargin (at most a quarter of
// the time left) before its deadline (ReserveRequest.seat_wait_ms).
inline constexpr std::chrono::seconds kReserveTimeout{10};
inline constexpr std::chrono::milliseconds kSeatWaitMargin{500};
void FillReserveRequest(const PrefillJob& job, const std::string& prefiller_name,
                        const std::string& prefiller_descriptor, parallel::ParallelLayout layout,
                        v1::ReserveRequest* req);
std::chrono::system_clock::time_point ReserveDeadline(const PrefillJob& job);
Result<ReserveTarget> FromReserveResponse(const v1::ReserveResponse& resp);

// `prefiller` is borrowed and must outlive the service.
std::unique_ptr<grpc::Service> MakePrefillerService(Prefiller& prefiller);

// Channels are created per decoder address on first use and kept; all use
// `credentials` (the internal plane's).
// `prefiller_descriptor`: this prefiller's KV transport descriptor (binary),
// sent with every Reserve so that the decoder can watch this prefiller's
// liveness (docs/failure-handling.md, "Quarantine").
// `layout`: this prefiller's rank layout, sent with every Reserve (issue 18).
std::unique_ptr<DecoderLink> MakeGrpcDecoderLink(const RpcCredentials& credentials,
                                                 std::string prefiller_descriptor = {},
                                                 parallel::ParallelLayout layout = {});

}  // namespace tandem::prefiller
