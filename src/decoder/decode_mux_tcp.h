// The decode stream over framed TCP (issue 23, docs/decode-stream.md
// "Transport"): the same DecodeStreamRequest / DecodeStreamResponse protocol
// as Decoder.DecodeStream, one stream per connection, each message one frame
// (common/frame_conn.h), mutual TLS when the internal plane is TLS.
//
// A batch is written from the thread whose delivery produced it (the
// engine thread at the end of a step), inline: no hand-off to another
// thread, one TLS record and one send per step for all of a proxy's
// requests. Starts and cancels are read on the listener's one I/O thread.
#pragma once

#include <memory>

#include "common/frame_server.h"
#include "decoder/decoder.h"

namespace tandem::decoder {

using DecodeMuxTcpOptions = FrameListenOptions;

// Serves the decode stream of `decoder` (borrowed: it must outlive the
// server) on a new listener.
Result<std::unique_ptr<FrameServer>> ServeDecodeMuxTcp(Decoder& decoder, DecodeMuxTcpOptions options);

}  // namespace tandem::decoder
