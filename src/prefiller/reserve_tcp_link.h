// The prefiller's Decoder.Reserve over framed TCP (issue 23,
// docs/serving-workers.md "Reserve transport"): a DecoderLink that keeps one
// framed connection per decoder (common/frame_conn.h; mutual TLS when the
// internal plane is TLS, the decoder's certificate checked against the
// dialled host) and carries every Reserve this prefiller makes to it, each
// a ReserveFrame exchange told apart by a call id (worker.proto). The
// decoder's framed listener is decoder/reserve_tcp.h.
//
// A call's request frame is written inline by the thread that starts it
// (the dispatcher; never blocking). The process's frame loop
// (common/frame_loop.h: one thread for all of these connections) dials,
// handshakes, reads the replies and runs each call's `done`; it also ends a
// call whose deadline (the job's, at most kReserveTimeout) passed with
// DEADLINE_EXCEEDED, as the gRPC client does. A reply that arrives after
// that (the decoder reserved all the same) is not dropped: its target goes
// to the LateTarget handler (DecoderLink::SetLateTargetHandler), which
// tells the decoder that no one writes into it; a reservation whose live
// writer never says so stays quarantined (docs/failure-handling.md). A
// connection that cannot be dialled or authenticated, or that breaks, ends
// every call on it with UNAVAILABLE, as a broken gRPC channel does (the
// prefiller's failure handling then runs: the proxy retries); the next
// Reserve to that decoder dials a new connection.
//
// Every call asks the decoder to say when it waits for a decode seat
// (ReserveRequest.tell_seat_wait): its ReserveFrame.seat_wait goes to the
// SeatWait handler (DecoderLink::SetSeatWaitHandler) before the reply.
//
// A job whose decoder advertises no framed address (an older decoder, or
// decode.reserve_listen: off) is reserved over gRPC, as before.
//
// Threads: Reserve and EncodeNotice from any thread; `done` runs on the
// frame loop's thread (or a gRPC thread), never inside Reserve.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/frame_conn.h"
#include "prefiller/prefiller.h"

namespace tandem::prefiller {

// `grpc`: the link for decoders without a framed address (and its notice
// encoding); `tls` null: plaintext. `prefiller_descriptor` and `layout` as
// in MakeGrpcDecoderLink.
std::unique_ptr<DecoderLink> MakeTcpDecoderLink(std::unique_ptr<DecoderLink> grpc,
                                                std::shared_ptr<FrameTls> tls,
                                                std::string prefiller_descriptor = {},
                                                parallel::ParallelLayout layout = {},
                                                FrameOptions options = {});

// The connections a link made by MakeTcpDecoderLink keeps (zeros for any
// other link): one entry per decoder address in use; an entry whose
// connection has ended is dropped when the link next dials a new one.
struct ReserveLinkEntries {
  size_t total = 0;
  size_t ended = 0;
};
ReserveLinkEntries TcpDecoderLinkEntries(DecoderLink& link);

}  // namespace tandem::prefiller
