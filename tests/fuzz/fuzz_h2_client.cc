// libFuzzer target: the bytes a public gRPC client sends the native front
// end, as the connection splits them before nghttp2 (proxy::h2::AckFilter:
// the clients' WINDOW_UPDATEs counted by the proxy, everything else passed
// to the session in order; issue 23). Held to a plain frame walk of the same
// bytes, which is what the filter must do whatever the reads: the input is
// split whole, one byte per read and in reads cut where the input's own
// bytes say, and every way must give the walk's passed bytes and taken
// updates.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_util.h"
#include "proxy/h2/h2_acks.h"

namespace {

using Taken = std::vector<std::pair<uint32_t, uint32_t>>;

// The connection's rule, reduced: an update of stream 3 mod 4 is one it
// does not know, increment 0 is the session's error.
bool Takes(uint32_t stream_id, uint32_t increment) { return increment != 0 && stream_id % 4 != 3; }

struct Recorder : tandem::proxy::h2::AckFilter::Sink {
  std::string passed;
  Taken taken;
  int passes_left = -1;  // >= 0: the Pass after that many returns false
  bool refused = false;
  bool Pass(std::span<const uint8_t> bytes) override {
    if (passes_left == 0) {
      refused = true;
      return false;
    }
    if (passes_left > 0) --passes_left;
    passed.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return true;
  }
  bool Window(uint32_t stream_id, uint32_t increment) override {
    if (!Takes(stream_id, increment)) return false;
    taken.emplace_back(stream_id, increment);
    return true;
  }
};

uint32_t Be24(const uint8_t* p) { return (uint32_t{p[0]} << 16) | (uint32_t{p[1]} << 8) | p[2]; }
uint32_t Be31(const uint8_t* p) {
  return (uint32_t{p[0] & 0x7fu} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// What the session and the connection must get, by walking the frames: the
// 24-byte preface passes as it is; a WINDOW_UPDATE (type 8, length 4) whole
// is offered, and passed when refused; any other frame passes, as much of
// its payload as has come; a frame header or an update not yet whole at
// the end is held back.
void Walk(const uint8_t* data, size_t size, std::string* passed, Taken* taken) {
  size_t o = std::min<size_t>(size, 24);
  passed->assign(reinterpret_cast<const char*>(data), o);
  while (size - o >= 9) {
    const uint8_t* h = data + o;
    const uint32_t length = Be24(h);
    if (h[3] == 0x8 && length == 4) {
      if (size - o < 13) return;
      const uint32_t id = Be31(h + 5), inc = Be31(h + 9);
      if (Takes(id, inc)) {
        taken->emplace_back(id, inc);
      } else {
        passed->append(reinterpret_cast<const char*>(h), 13);
      }
      o += 13;
      continue;
    }
    const size_t have = std::min<size_t>(size - o, 9 + size_t{length});
    passed->append(reinterpret_cast<const char*>(h), have);
    o += have;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  std::string want_passed;
  Taken want_taken;
  Walk(data, size, &want_passed, &want_taken);

  auto check = [&](const Recorder& r, const tandem::proxy::h2::AckFilter& f) {
    if (r.passed != want_passed || r.taken != want_taken || f.taken() != want_taken.size()) {
      __builtin_trap();
    }
  };
  {  // whole
    tandem::proxy::h2::AckFilter f;
    Recorder r;
    if (!f.Split({data, size}, r)) __builtin_trap();
    check(r, f);
  }
  {  // one byte per read
    tandem::proxy::h2::AckFilter f;
    Recorder r;
    for (size_t i = 0; i < size; ++i) {
      if (!f.Split({data + i, 1}, r)) __builtin_trap();
    }
    check(r, f);
  }
  {  // reads of 1-29 bytes, cut where the input's bytes say
    tandem::proxy::h2::AckFilter f;
    Recorder r;
    for (size_t i = 0, k = 0; i < size; ++k) {
      const size_t n = std::min<size_t>(size - i, 1 + data[k % size] % 29);
      if (!f.Split({data + i, n}, r)) __builtin_trap();
      i += n;
    }
    check(r, f);
  }
  if (size > 0) {  // the session refuses a Pass: the split stops and says so
    tandem::proxy::h2::AckFilter f;
    Recorder r;
    r.passes_left = data[0] % 4;
    const bool ok = f.Split({data, size}, r);
    if (ok == r.refused || !want_passed.starts_with(r.passed)) __builtin_trap();
  }
  return 0;
}
