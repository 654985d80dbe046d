// Held acknowledgements (docs/grpc-frontend.md "Held acknowledgements"):
// a streaming gRPC client answers every step's DATA with WINDOW_UPDATE
// frames (one per stream plus one for the connection, one write per
// step). The batch's flush still reads them every step, but a read made of
// nothing else need not reach nghttp2 at once: it is held here, summed per
// stream, and handed to the session later as one WINDOW_UPDATE per stream
// (window increments add up, so the session ends in the same state). Any
// other frame is handed over at once, behind what was held, in order.
//
// This class only tracks frame boundaries and sums; when to hold and when
// to hand over (the session's view of the client's windows) is the
// connection's (h2_connection.cc). Not thread-safe: the connection calls it
// under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tandem::proxy::h2 {

class HeldAcks {
 public:
  // Distinct streams held at once; a read that would add more is handed over.
  static constexpr size_t kMaxStreams = 64;

  // Every byte the session is given must pass here first (the client's
  // 24-byte preface, then frames), so that Hold knows where frames start.
  void Fed(std::span<const uint8_t> bytes);

  // `bytes` were just read from the client. true: they were held (they
  // start at a frame boundary and are only whole WINDOW_UPDATE frames of
  // length 4 with a non-zero increment, for at most kMaxStreams streams);
  // the caller must not feed them. false: nothing changed; feed them (after
  // Take's frames).
  bool Hold(std::span<const uint8_t> bytes);

  bool empty() const { return held_.empty(); }
  // Reads held since the last Take.
  size_t reads() const { return reads_; }

  // Appends the held acknowledgements to `out` as WINDOW_UPDATE frames, one
  // per stream (connection first), each increment at most 2^31-1 (a larger
  // sum is split, so a window the client overflows is still reported by
  // the session); then holds nothing.
  void Take(std::string& out);

 private:
  struct Held {
    uint32_t stream_id;
    uint64_t increment;  // the sum of the held frames' increments
  };
  std::vector<Held> held_;  // [streams held], in the order first seen
  size_t reads_ = 0;
  // Frame boundary tracking over the bytes fed to the session.
  size_t preface_left_ = 24;  // "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
  uint8_t header_[9] = {};
  size_t header_got_ = 0;
  uint64_t payload_left_ = 0;
};

}  // namespace tandem::proxy::h2
