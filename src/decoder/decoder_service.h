// gRPC adapter of the Decoder (worker.proto `service Decoder`), callback API.
//
//   Decode  (server stream): first message `registered`, then TokenChunk*,
//           then DecodeFinished — or an in-band ErrorInfo as the last message,
//           with the same code as the stream's status.
//   Reserve (unary): KvTarget, or ReserveResponse.error (RESOURCE_EXHAUSTED
//           when there is no room, or no decode seat came free within
//           ReserveRequest.seat_wait_ms; NOT_FOUND when the request is not
//           registered); the RPC status itself is OK then. DEADLINE_EXCEEDED
//           when the call's deadline passed while reserving (nothing stays
//           reserved); a target whose reply the client never received is
//           released (ReleaseUnreceivedTarget).
// KV notices arrive through the transport's notification callback, which
// this adapter installs (KvNotice is serialized worker.proto).
//
// Threads: gRPC callback threads and the transport's progress thread;
// everything is forwarded to the thread-safe Decoder.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/service_type.h>

#include <functional>
#include <memory>

#include "common/tracing.h"
#include "decoder/decoder.h"

namespace tandem::v1 {
class KvTarget;
class ReserveRequest;
class ReserveResponse;
}  // namespace tandem::v1

namespace tandem::decoder {

// Decoder.Reserve, for both transports (this gRPC service and the framed
// listener, decoder/reserve_tcp.h): reserves on `decoder`, waiting for a
// decode seat for up to `req.seat_wait_ms` (at most kMaxSeatWaitMs), and
// hands `answer` the target or the refusal: inline, or later on the
// decoder's lease thread (never under its lock). Records the span when
// `trace` is sampled. `req` need not outlive the call. Returns the
// decoder's ticket (Decoder::AbandonReserve) while the call waits, else 0;
// `for_registration` (may be null) is set when it waits for its request's
// registration rather than for a seat (Decoder::ReserveOrWait).
using ReserveAnswer = Decoder::ReserveDone;
inline constexpr uint32_t kMaxSeatWaitMs = 60'000;
uint64_t ServeReserve(Decoder& decoder, const v1::ReserveRequest& req, tracing::SpanContext trace,
                      ReserveAnswer answer, bool* for_registration = nullptr);
// The reply to send: KvTarget, or ReserveResponse.error.
void FillReserveResponse(const Result<KvTargetInfo>& target, v1::ReserveResponse* resp);

// A Reserve reply carrying `target` that its prefiller never received (the
// framed reply could not be sent; the gRPC call ended cancelled: deadline,
// cancel or broken connection before the status went out): no prefiller
// will write into that reservation, so it is released at once, as by the
// prefiller's error notice `why` (docs/failure-handling.md "Quarantine").
// Only that reservation: one already ended, or replaced by a newer Reserve
// for the request, is left as it is (Decoder::OnKvNotice's checks).
void ReleaseUnreceivedTarget(Decoder& decoder, const v1::KvTarget& target, const Status& why);

// The tandem.v1.Decoder callback service around `decoder`; also routes
// `transport`'s notifications to it. Both are borrowed and must outlive the
// service. While draining, new Decode streams get UNAVAILABLE.
std::unique_ptr<grpc::Service> MakeDecoderService(Decoder& decoder,
                                                  kvtransfer::Transport& transport);

}  // namespace tandem::decoder
