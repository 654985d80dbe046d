// The client's acknowledgements (docs/grpc-frontend.md "Response DATA and
// flow control"): the connection writes the response DATA frames itself,
// not through nghttp2, so the client's WINDOW_UPDATE frames are its to
// count, not nghttp2's (nghttp2 never sent that DATA, and its idea of a
// window grown by the updates would pass 2^31-1 and be refused). AckFilter
// splits what the client sends, in order: runs of bytes that go to the
// session as they are, and WINDOW_UPDATE frames (length 4), which it offers
// to the connection; a frame the connection does not take (increment 0, a
// stream it does not know) goes to the session in place, which answers the
// errors. A gRPC client's every-step write of nothing but WINDOW_UPDATEs
// never reaches nghttp2.
//
// QuietMarkFor (below) sizes the quiet reading of those acknowledgements.
//
// This class only tracks frame boundaries (a frame header or an update
// split across reads is kept until whole). Not thread-safe: the connection
// calls it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace tandem::proxy::h2 {

class AckFilter {
 public:
  // Receives what the filter decided, in the order of the bytes.
  class Sink {
   public:
    virtual ~Sink() = default;
    // Bytes for the session. false: stop (a protocol error).
    virtual bool Pass(std::span<const uint8_t> bytes) = 0;
    // A WINDOW_UPDATE frame of `stream_id` with this 31-bit increment.
    // true: taken (counted); false: the frame goes to the session instead.
    virtual bool Window(uint32_t stream_id, uint32_t increment) = 0;
  };

  // Every byte the client sends, in order (the 24-byte preface first).
  // false: a Pass returned false (the rest of `bytes` is dropped).
  bool Split(std::span<const uint8_t> bytes, Sink& sink);

  // Number of WINDOW_UPDATE frames taken (for tests and probes).
  uint64_t taken() const { return taken_; }

 private:
  size_t preface_left_ = 24;  // "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
  uint8_t frame_[13] = {};    // a header (and an update's payload) being read
  size_t frame_got_ = 0;      // bytes of frame_ read
  bool in_update_ = false;    // frame_ holds a WINDOW_UPDATE's header
  uint64_t payload_left_ = 0;  // payload of a passed frame still to pass
  uint64_t taken_ = 0;
};

// Quiet reading's low-water mark for a connection whose batches write to
// `streams` streams (docs/grpc-frontend.md "Quiet reading", "Several steps
// per read"): SO_RCVLOWAT, and every how many batches their flush reads
// the client's acknowledgements. `acks_each_step`: the client's reads so
// far found its acknowledgements of every batch (else one batch at a time,
// the mark just above them). `record_overhead`: TLS's per record (0 plain).
struct QuietMark {
  int low_water = 1;
  int read_every = 1;
};
QuietMark QuietMarkFor(int streams, int record_overhead, bool acks_each_step);
// The WINDOW_UPDATE bytes a client sends for one batch to `streams` streams
// (one per stream and one for the connection).
int StepAckBytes(int streams);

}  // namespace tandem::proxy::h2
