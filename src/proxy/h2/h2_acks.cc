#include "proxy/h2/h2_acks.h"

#include <algorithm>

namespace tandem::proxy::h2 {
namespace {

constexpr size_t kFrameHeaderBytes = 9;
constexpr uint8_t kWindowUpdate = 0x8;
constexpr size_t kWindowUpdateBytes = kFrameHeaderBytes + 4;
constexpr uint64_t kMaxIncrement = 0x7fffffff;  // RFC 9113 6.9: 31 bits

uint32_t Read31(const uint8_t* p) {
  return (static_cast<uint32_t>(p[0] & 0x7f) << 24) | (static_cast<uint32_t>(p[1]) << 16) |
         (static_cast<uint32_t>(p[2]) << 8) | p[3];
}

void AppendWindowUpdate(std::string& out, uint32_t stream_id, uint32_t increment) {
  const char frame[kWindowUpdateBytes] = {
      0, 0, 4, static_cast<char>(kWindowUpdate), 0,
      static_cast<char>(stream_id >> 24), static_cast<char>(stream_id >> 16),
      static_cast<char>(stream_id >> 8), static_cast<char>(stream_id),
      static_cast<char>(increment >> 24), static_cast<char>(increment >> 16),
      static_cast<char>(increment >> 8), static_cast<char>(increment)};
  out.append(frame, sizeof frame);
}

}  // namespace

void HeldAcks::Fed(std::span<const uint8_t> bytes) {
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  if (preface_left_ > 0) {
    const size_t take = std::min(n, preface_left_);
    preface_left_ -= take;
    p += take;
    n -= take;
  }
  while (n > 0) {
    if (payload_left_ > 0) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, payload_left_));
      payload_left_ -= take;
      p += take;
      n -= take;
      continue;
    }
    const size_t take = std::min(n, kFrameHeaderBytes - header_got_);
    std::copy_n(p, take, header_ + header_got_);
    header_got_ += take;
    p += take;
    n -= take;
    if (header_got_ == kFrameHeaderBytes) {
      header_got_ = 0;
      payload_left_ = (static_cast<uint64_t>(header_[0]) << 16) |
                      (static_cast<uint64_t>(header_[1]) << 8) | header_[2];
    }
  }
}

bool HeldAcks::Hold(std::span<const uint8_t> bytes) {
  // Only at a frame boundary, past the preface: the session has no partial
  // frame that these bytes would continue.
  if (preface_left_ > 0 || header_got_ > 0 || payload_left_ > 0) return false;
  if (bytes.empty() || bytes.size() % kWindowUpdateBytes != 0) return false;
  size_t new_streams = 0;
  for (size_t at = 0; at < bytes.size(); at += kWindowUpdateBytes) {
    const uint8_t* f = bytes.data() + at;
    // Length 4, type WINDOW_UPDATE (flags are unused), a non-zero increment
    // (zero is an error the session must see, in place).
    if (f[0] != 0 || f[1] != 0 || f[2] != 4 || f[3] != kWindowUpdate) return false;
    if (Read31(f + 9) == 0) return false;
    const uint32_t id = Read31(f + 5);
    const bool known = std::any_of(held_.begin(), held_.end(),
                                   [id](const Held& h) { return h.stream_id == id; });
    // (A stream repeated within `bytes` is counted twice: conservative.)
    // Past the cap, stop here: a read of hundreds of streams' updates (a
    // connection with that many open) is not searched through.
    if (!known && held_.size() + ++new_streams > kMaxStreams) return false;
  }
  for (size_t at = 0; at < bytes.size(); at += kWindowUpdateBytes) {
    const uint8_t* f = bytes.data() + at;
    const uint32_t id = Read31(f + 5);
    const uint32_t inc = Read31(f + 9);
    auto it = std::find_if(held_.begin(), held_.end(),
                           [id](const Held& h) { return h.stream_id == id; });
    if (it == held_.end()) {
      held_.push_back(Held{id, inc});
    } else {
      it->increment += inc;
    }
  }
  ++reads_;
  return true;
}

void HeldAcks::Take(std::string& out) {
  // The connection's first (two passes: no reordering, no allocation).
  for (const bool connection : {true, false}) {
    for (const Held& h : held_) {
      if ((h.stream_id == 0) != connection) continue;
      for (uint64_t left = h.increment; left > 0;) {
        const uint64_t inc = std::min(left, kMaxIncrement);
        AppendWindowUpdate(out, h.stream_id, static_cast<uint32_t>(inc));
        left -= inc;
      }
    }
  }
  held_.clear();
  reads_ = 0;
}

}  // namespace tandem::proxy::h2
