#include "proxy/h2/h2_acks.h"

#include <algorithm>

namespace tandem::proxy::h2 {
namespace {

constexpr size_t kFrameHeaderBytes = 9;
constexpr uint8_t kWindowUpdate = 0x8;
constexpr size_t kWindowUpdateBytes = kFrameHeaderBytes + 4;

uint32_t Read31(const uint8_t* p) {
  return (static_cast<uint32_t>(p[0] & 0x7f) << 24) | (static_cast<uint32_t>(p[1]) << 16) |
         (static_cast<uint32_t>(p[2]) << 8) | p[3];
}

uint32_t Length(const uint8_t* header) {
  return (static_cast<uint32_t>(header[0]) << 16) | (static_cast<uint32_t>(header[1]) << 8) |
         header[2];
}

// A WINDOW_UPDATE of the only valid length (other lengths are errors the
// session answers: they pass).
bool IsUpdate(const uint8_t* header) {
  return header[3] == kWindowUpdate && Length(header) == 4;
}

// Quiet reading: kMaxLowWater bounds what a request must add to the
// acknowledgements already in the socket to wake the event thread: one
// step's acknowledgements at or above it get this mark (such a connection
// wakes the event thread as before); below it, several steps'
// acknowledgements are left in the socket as long as (steps - 1) of them
// stay under it, and one read takes them all.
constexpr int kMaxLowWater = 80;

}  // namespace

int StepAckBytes(int streams) { return static_cast<int>(kWindowUpdateBytes) * (streams + 1); }

QuietMark QuietMarkFor(int streams, int record_overhead, bool acks_each_step) {
  const int acks = StepAckBytes(streams);
  const int step = acks + record_overhead;  // one step's write of acknowledgements
  if (!acks_each_step || step >= kMaxLowWater) {
    // One step's acknowledgements reach the cap: read every batch, mark
    // at the cap (plus a record's overhead in TLS, on top of a request).
    return {std::min(acks + 1, kMaxLowWater) + record_overhead, 1};
  }
  // k steps stay in the socket while (k - 1) steps plus any request of
  // kMaxLowWater bytes or more still cross the mark: once the batch's
  // acknowledgements are in, a request wakes the event thread at once, as
  // with one step.
  const int every = 1 + (kMaxLowWater - 1) / step;
  return {every * step + 1, every};
}

bool AckFilter::Split(std::span<const uint8_t> bytes, Sink& sink) {
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  const uint8_t* run = p;  // bytes from here to p go to the session as they are
  auto pass_run = [&] {
    const bool ok = p == run || sink.Pass({run, static_cast<size_t>(p - run)});
    run = p;
    return ok;
  };
  // A whole update (13 bytes at `f`): taken, or passed in place.
  auto update = [&](const uint8_t* f) {
    if (sink.Window(Read31(f + 5), Read31(f + 9))) {
      ++taken_;
      return true;
    }
    return sink.Pass({f, kWindowUpdateBytes});
  };
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
    if (frame_got_ == 0 && n >= kFrameHeaderBytes) {
      // A whole header here: the common case.
      if (!IsUpdate(p)) {
        payload_left_ = Length(p);
        p += kFrameHeaderBytes;
        n -= kFrameHeaderBytes;
        continue;
      }
      if (!pass_run()) return false;
      if (n >= kWindowUpdateBytes) {
        if (!update(p)) return false;
        p += kWindowUpdateBytes;
        n -= kWindowUpdateBytes;
      } else {
        std::copy_n(p, n, frame_);
        frame_got_ = n;
        in_update_ = true;
        p += n;
        n = 0;
      }
      run = p;
      continue;
    }
    // A header (or an update) split across reads: kept here until whole.
    if (frame_got_ == 0 && !pass_run()) return false;
    const size_t want = (in_update_ ? kWindowUpdateBytes : kFrameHeaderBytes) - frame_got_;
    const size_t take = std::min(n, want);
    std::copy_n(p, take, frame_ + frame_got_);
    frame_got_ += take;
    p += take;
    n -= take;
    run = p;
    if (take < want) break;  // (n == 0)
    if (!in_update_) {
      if (IsUpdate(frame_)) {
        in_update_ = true;  // its payload next
        continue;
      }
      if (!sink.Pass({frame_, kFrameHeaderBytes})) return false;
      payload_left_ = Length(frame_);
      frame_got_ = 0;
      continue;
    }
    frame_got_ = 0;
    in_update_ = false;
    if (!update(frame_)) return false;
  }
  return pass_run();
}

}  // namespace tandem::proxy::h2
