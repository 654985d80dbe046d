// AckFilter (src/proxy/h2/h2_acks.h): what a client sends is split into the
// bytes the session gets, unchanged and in order, and the WINDOW_UPDATE
// frames the connection counts; the same however the bytes arrive cut into
// reads; frames the connection refuses (increment 0, unknown stream) and
// malformed updates go to the session in place.
#include "proxy/h2/h2_acks.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tandem::proxy::h2 {
namespace {

std::string Frame(uint32_t length, uint8_t type, uint32_t stream_id, const std::string& payload) {
  std::string f;
  f.push_back(static_cast<char>(length >> 16));
  f.push_back(static_cast<char>(length >> 8));
  f.push_back(static_cast<char>(length));
  f.push_back(static_cast<char>(type));
  f.push_back(0);  // flags
  for (int shift : {24, 16, 8, 0}) f.push_back(static_cast<char>(stream_id >> shift));
  return f + payload;
}

std::string U32(uint32_t v) {
  std::string s;
  for (int shift : {24, 16, 8, 0}) s.push_back(static_cast<char>(v >> shift));
  return s;
}

std::string WindowUpdate(uint32_t stream_id, uint32_t increment) {
  return Frame(4, 0x8, stream_id, U32(increment));
}

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

const std::string kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// Takes updates of the connection and of `known` streams with a non-zero
// increment; records everything.
struct Recorder : AckFilter::Sink {
  std::set<uint32_t> known = {1, 3};
  std::string passed;
  std::vector<std::pair<uint32_t, uint32_t>> taken;
  int passes = 0;
  int fail_at_pass = -1;  // Pass number that returns false
  bool Pass(std::span<const uint8_t> bytes) override {
    if (passes++ == fail_at_pass) return false;
    passed.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return true;
  }
  bool Window(uint32_t stream_id, uint32_t increment) override {
    if (increment == 0 || (stream_id != 0 && known.count(stream_id) == 0)) return false;
    taken.emplace_back(stream_id, increment);
    return true;
  }
};

// A conversation: the preface, SETTINGS, request HEADERS and DATA (whose
// payload looks like a WINDOW_UPDATE: it must not be taken), updates the
// connection takes, one of an unknown stream, one with increment 0, one of
// the wrong length, a PING.
struct Conversation {
  std::string bytes, session;
  std::vector<std::pair<uint32_t, uint32_t>> taken;
  Conversation() {
    auto pass = [&](const std::string& f) {
      bytes += f;
      session += f;
    };
    auto take = [&](uint32_t id, uint32_t inc) {
      bytes += WindowUpdate(id, inc);
      taken.emplace_back(id, inc & 0x7fffffffu);
    };
    pass(kPreface);
    pass(Frame(6, 0x4, 0, std::string("\x00\x04\x00\x00\x02\x00", 6)));  // SETTINGS
    pass(Frame(3, 0x1, 1, "abc"));                                         // HEADERS
    pass(Frame(13, 0x0, 1, WindowUpdate(0, 77)));                          // DATA
    take(0, 1000);
    take(1, 65535);
    take(3, 0x7fffffff);
    pass(WindowUpdate(5, 10));   // unknown stream: the session's
    pass(WindowUpdate(1, 0));    // increment 0: the session's error
    pass(Frame(5, 0x8, 1, U32(9) + "x"));  // wrong length: the session's error
    take(0, 13);
    pass(Frame(8, 0x6, 0, "pingpong"));  // PING
    take(1, 26);
    take(1, 0x80000000u | 5);  // the reserved bit is ignored
  }
};

TEST(AckFilter, UpdatesAreTakenAndEverythingElsePassesUnchangedInOrder) {
  Conversation c;
  AckFilter f;
  Recorder r;
  ASSERT_TRUE(f.Split(Bytes(c.bytes), r));
  EXPECT_EQ(r.passed, c.session);
  EXPECT_EQ(r.taken, c.taken);
  EXPECT_EQ(f.taken(), c.taken.size());
}

TEST(AckFilter, TheSameWhereverTheReadsAreCut) {
  Conversation c;
  // Every cut into two reads, and one byte per read.
  for (size_t cut = 0; cut <= c.bytes.size(); ++cut) {
    AckFilter f;
    Recorder r;
    ASSERT_TRUE(f.Split(Bytes(c.bytes.substr(0, cut)), r));
    ASSERT_TRUE(f.Split(Bytes(c.bytes.substr(cut)), r));
    ASSERT_EQ(r.passed, c.session) << "cut at " << cut;
    ASSERT_EQ(r.taken, c.taken) << "cut at " << cut;
  }
  AckFilter f;
  Recorder r;
  for (char ch : c.bytes) ASSERT_TRUE(f.Split(Bytes(std::string(1, ch)), r));
  EXPECT_EQ(r.passed, c.session);
  EXPECT_EQ(r.taken, c.taken);
}

TEST(AckFilter, AReadOfOnlyUpdatesPassesNothing) {
  AckFilter f;
  Recorder r;
  ASSERT_TRUE(f.Split(Bytes(kPreface), r));
  const int passes = r.passes;
  ASSERT_TRUE(f.Split(Bytes(WindowUpdate(1, 40) + WindowUpdate(3, 40) + WindowUpdate(0, 80)), r));
  EXPECT_EQ(r.passes, passes);
  EXPECT_EQ(r.taken.size(), 3u);
}

TEST(AckFilter, ASessionErrorStopsTheSplit) {
  AckFilter f;
  Recorder r;
  r.fail_at_pass = 1;  // the second run: the unknown stream's update
  EXPECT_FALSE(f.Split(Bytes(kPreface + WindowUpdate(5, 1) + WindowUpdate(1, 1)), r));
  EXPECT_TRUE(r.taken.empty());  // nothing after the error
}

}  // namespace
}  // namespace tandem::proxy::h2
