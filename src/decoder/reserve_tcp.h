// Decoder.Reserve over framed TCP (issue 23, docs/serving-workers.md
// "Reserve transport"): the same ReserveRequest / ReserveResponse as the
// gRPC call, each call a ReserveFrame exchange told apart by its call id,
// many calls on one connection per prefiller (common/frame_conn.h; mutual
// TLS when the internal plane is TLS: a client without a certificate of the
// fleet CA is refused).
//
// Each request is answered on the listener's one I/O thread as it is read
// (Decoder::Reserve does not block), so a Reserve costs the decoder one
// wake-up; one that waits for a decode seat (ReserveRequest.seat_wait_ms)
// is answered on the decoder's lease thread when a seat comes free, and
// leaves the decoder's queue when the connection ends first; a prefiller
// that asks (ReserveRequest.tell_seat_wait) is sent ReserveFrame.seat_wait
// for it first. A
// reply that cannot be sent (the connection broke or closed for a slow
// peer) never reached the prefiller, so its reservation is released at
// once, as by the prefiller's error notice (the request goes back to
// registered for the proxy's retry). A reply that left but was not read
// before the connection broke is the lease's to end (as a gRPC reply lost
// on a broken channel).
#pragma once

#include <memory>

#include "common/frame_server.h"
#include "decoder/decoder.h"

namespace tandem::decoder {

using ReserveTcpOptions = FrameListenOptions;

// Serves Reserve on `decoder` (borrowed: it must outlive the server) on a
// new listener.
Result<std::unique_ptr<FrameServer>> ServeReserveTcp(Decoder& decoder, ReserveTcpOptions options);

}  // namespace tandem::decoder
