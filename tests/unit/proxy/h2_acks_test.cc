// HeldAcks (src/proxy/h2/h2_acks.h): which reads of a client may be held
// (whole WINDOW_UPDATE frames at a frame boundary, past the preface), and
// the frames handed over for them (one per stream, sums split at 2^31-1).
#include "proxy/h2/h2_acks.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <span>
#include <string>
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

// Parses Take's output: stream -> increments in order; fails on anything
// that is not a well-formed WINDOW_UPDATE.
std::map<uint32_t, std::vector<uint32_t>> Parse(const std::string& out) {
  std::map<uint32_t, std::vector<uint32_t>> got;
  EXPECT_EQ(out.size() % 13, 0u);
  for (size_t at = 0; at + 13 <= out.size(); at += 13) {
    const auto* f = reinterpret_cast<const uint8_t*>(out.data() + at);
    EXPECT_EQ(f[0] | f[1], 0);
    EXPECT_EQ(f[2], 4);
    EXPECT_EQ(f[3], 0x8);
    const uint32_t id = (uint32_t{f[5]} << 24) | (uint32_t{f[6]} << 16) | (uint32_t{f[7]} << 8) | f[8];
    const uint32_t inc = (uint32_t{f[9]} << 24) | (uint32_t{f[10]} << 16) | (uint32_t{f[11]} << 8) | f[12];
    EXPECT_EQ(inc & 0x80000000u, 0u);
    EXPECT_GT(inc, 0u);
    got[id].push_back(inc);
  }
  return got;
}

// A client's usual step: one update per stream that got data, one for the
// connection, all in one write.
std::string Step(uint32_t per_stream) {
  return WindowUpdate(1, per_stream) + WindowUpdate(3, per_stream) + WindowUpdate(0, 2 * per_stream);
}

TEST(HeldAcks, NothingIsHeldBeforeThePrefaceAndTheFirstFramesWereFed) {
  HeldAcks acks;
  EXPECT_FALSE(acks.Hold(Bytes(Step(10))));  // the preface is still expected
  acks.Fed(Bytes(kPreface.substr(0, 10)));
  EXPECT_FALSE(acks.Hold(Bytes(Step(10))));
  acks.Fed(Bytes(kPreface.substr(10) + Frame(6, 0x4, 0, std::string(6, '\0'))));  // + SETTINGS
  EXPECT_TRUE(acks.Hold(Bytes(Step(10))));
  EXPECT_EQ(acks.reads(), 1u);
}

TEST(HeldAcks, StepsAreSummedIntoOneUpdatePerStreamConnectionFirst) {
  HeldAcks acks;
  acks.Fed(Bytes(kPreface));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(acks.Hold(Bytes(Step(40 + i))));
  EXPECT_EQ(acks.reads(), 5u);
  EXPECT_FALSE(acks.empty());
  std::string out;
  acks.Take(out);
  ASSERT_EQ(out.size(), 3u * 13);
  EXPECT_EQ(out.substr(0, 13), WindowUpdate(0, 2 * (40 + 41 + 42 + 43 + 44)));
  const auto got = Parse(out);
  EXPECT_EQ(got.at(1), std::vector<uint32_t>{210});
  EXPECT_EQ(got.at(3), std::vector<uint32_t>{210});
  EXPECT_TRUE(acks.empty());
  EXPECT_EQ(acks.reads(), 0u);
  std::string again;
  acks.Take(again);
  EXPECT_TRUE(again.empty());
}

TEST(HeldAcks, AnyOtherFrameOrAMalformedUpdateIsNotHeld) {
  HeldAcks acks;
  acks.Fed(Bytes(kPreface));
  const std::string ping = Frame(8, 0x6, 0, std::string(8, 'p'));
  const std::string rst = Frame(4, 0x3, 5, U32(8));
  EXPECT_FALSE(acks.Hold(Bytes(WindowUpdate(1, 10) + ping)));      // a PING behind acks
  EXPECT_FALSE(acks.Hold(Bytes(rst + WindowUpdate(0, 10))));
  EXPECT_FALSE(acks.Hold(Bytes(WindowUpdate(1, 0))));              // increment 0: an error
  EXPECT_FALSE(acks.Hold(Bytes(Frame(5, 0x8, 1, U32(7) + "x"))));  // length 5: an error
  EXPECT_FALSE(acks.Hold(Bytes(WindowUpdate(1, 10).substr(0, 12))));  // a partial frame
  EXPECT_FALSE(acks.Hold(Bytes(std::string())));
  EXPECT_TRUE(acks.empty());
  // The reserved bit is ignored (RFC 9113 6.9), as the session would.
  EXPECT_TRUE(acks.Hold(Bytes(WindowUpdate(1, 0x80000000u | 7))));
  std::string out;
  acks.Take(out);
  EXPECT_EQ(out, WindowUpdate(1, 7));
}

TEST(HeldAcks, ReadsAreHeldOnlyAtAFrameBoundaryOfWhatWasFed) {
  HeldAcks acks;
  acks.Fed(Bytes(kPreface));
  const std::string data = Frame(100, 0x0, 1, std::string(100, 'd'));
  acks.Fed(Bytes(data.substr(0, 4)));  // inside a frame header
  EXPECT_FALSE(acks.Hold(Bytes(Step(1))));
  acks.Fed(Bytes(data.substr(4, 50)));  // inside its payload
  EXPECT_FALSE(acks.Hold(Bytes(Step(1))));
  acks.Fed(Bytes(data.substr(54)));
  EXPECT_TRUE(acks.Hold(Bytes(Step(1))));
  // A large frame (16 MiB - 1 payload) is skipped by its length.
  std::string big_header = Frame(0xffffff, 0x0, 1, "");
  acks.Fed(Bytes(big_header));
  EXPECT_FALSE(acks.Hold(Bytes(Step(1))));
  const std::string chunk(1 << 20, 'x');
  for (int i = 0; i < 15; ++i) acks.Fed(Bytes(chunk));
  acks.Fed(Bytes(chunk.substr(0, (1 << 20) - 2)));
  EXPECT_FALSE(acks.Hold(Bytes(Step(1))));
  acks.Fed(Bytes(chunk.substr(0, 1)));
  EXPECT_TRUE(acks.Hold(Bytes(Step(1))));
}

TEST(HeldAcks, SumsPastTheLargestIncrementAreSplitAndStreamsAreCapped) {
  HeldAcks acks;
  acks.Fed(Bytes(kPreface));
  ASSERT_TRUE(acks.Hold(Bytes(WindowUpdate(7, 0x7fffffff))));
  ASSERT_TRUE(acks.Hold(Bytes(WindowUpdate(7, 0x7fffffff))));
  ASSERT_TRUE(acks.Hold(Bytes(WindowUpdate(7, 5))));
  std::string out;
  acks.Take(out);
  EXPECT_EQ(Parse(out).at(7), (std::vector<uint32_t>{0x7fffffff, 0x7fffffff, 5}));

  std::string many;
  for (uint32_t id = 1; id <= 2 * HeldAcks::kMaxStreams; id += 2) many += WindowUpdate(id, 1);
  {
    HeldAcks fresh;  // one read of more streams than that: handed over whole
    fresh.Fed(Bytes(kPreface));
    EXPECT_FALSE(fresh.Hold(Bytes(many + WindowUpdate(2001, 1))));
    EXPECT_TRUE(fresh.empty());
  }
  ASSERT_TRUE(acks.Hold(Bytes(many)));  // exactly kMaxStreams streams
  EXPECT_FALSE(acks.Hold(Bytes(WindowUpdate(1001, 1))));  // one more stream
  EXPECT_TRUE(acks.Hold(Bytes(WindowUpdate(1, 1))));      // a held stream again
  out.clear();
  acks.Take(out);
  const auto got = Parse(out);
  EXPECT_EQ(got.size(), HeldAcks::kMaxStreams);
  EXPECT_EQ(got.at(1), std::vector<uint32_t>{2});
  EXPECT_EQ(got.count(1001), 0u);
}

}  // namespace
}  // namespace tandem::proxy::h2
