// The gRPC-over-HTTP/2 wire helpers of the native front end (proxy/h2).
#include "proxy/h2/grpc_wire.h"

#include <gtest/gtest.h>

namespace tandem::proxy::h2 {
namespace {

using namespace std::chrono;

TEST(GrpcWire, GrpcTimeoutUnitsAndMalformedValues) {
  EXPECT_EQ(ParseGrpcTimeout("1H"), nanoseconds(hours(1)));
  EXPECT_EQ(ParseGrpcTimeout("2M"), nanoseconds(minutes(2)));
  EXPECT_EQ(ParseGrpcTimeout("30S"), nanoseconds(seconds(30)));
  EXPECT_EQ(ParseGrpcTimeout("250m"), nanoseconds(milliseconds(250)));
  EXPECT_EQ(ParseGrpcTimeout("99999999u"), nanoseconds(microseconds(99999999)));
  EXPECT_EQ(ParseGrpcTimeout("7n"), nanoseconds(7));
  EXPECT_FALSE(ParseGrpcTimeout(""));
  EXPECT_FALSE(ParseGrpcTimeout("S"));
  EXPECT_FALSE(ParseGrpcTimeout("10"));
  EXPECT_FALSE(ParseGrpcTimeout("10s"));   // lower-case s is not a unit
  EXPECT_FALSE(ParseGrpcTimeout("-1S"));
  EXPECT_FALSE(ParseGrpcTimeout("123456789S"));  // 9 digits: at most 8
}

TEST(GrpcWire, GrpcMessageIsPercentEncoded) {
  EXPECT_EQ(PercentEncode("plain text: ok"), "plain text: ok");
  EXPECT_EQ(PercentEncode("100%"), "100%25");
  EXPECT_EQ(PercentEncode("a\nb"), "a%0Ab");
  EXPECT_EQ(PercentEncode("caf\xc3\xa9"), "caf%C3%A9");
}

TEST(GrpcWire, MessagePrefixRoundTrips) {
  std::string out;
  AppendMessagePrefix(out, 0x01020304);
  ASSERT_EQ(out.size(), 5u);
  const MessagePrefix p = ReadMessagePrefix(reinterpret_cast<const uint8_t*>(out.data()));
  EXPECT_FALSE(p.compressed);
  EXPECT_EQ(p.length, 0x01020304u);
  const uint8_t compressed[5] = {1, 0, 0, 0, 9};
  EXPECT_TRUE(ReadMessagePrefix(compressed).compressed);
  EXPECT_EQ(ReadMessagePrefix(compressed).length, 9u);
}

}  // namespace
}  // namespace tandem::proxy::h2
