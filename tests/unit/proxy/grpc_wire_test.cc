// The gRPC-over-HTTP/2 wire helpers of the native front end (proxy/h2).
#include "proxy/h2/grpc_wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tandem/v1/generation.pb.h"

namespace tandem::proxy::h2 {
namespace {

using namespace std::chrono;

// The deadline handed to the workers: the steady deadline's time left, on
// the system clock; none stays none, and a deadline past the system
// clock's range (a ~274-year timeout in 2026) is none instead of an
// overflowed time (session 47: it wrapped into the past).
TEST(GrpcWire, SystemDeadlineOfASteadyDeadline) {
  using std::chrono::steady_clock;
  using std::chrono::system_clock;
  const steady_clock::time_point steady_now{hours(5)};
  const system_clock::time_point system_now{hours(24 * 365 * 57)};  // ~2026
  EXPECT_EQ(SystemDeadlineOf(steady_clock::time_point::max(), steady_now, system_now),
            system_clock::time_point::max());
  EXPECT_EQ(SystemDeadlineOf(steady_now + seconds(30), steady_now, system_now),
            system_now + seconds(30));
  EXPECT_EQ(SystemDeadlineOf(steady_now - seconds(1), steady_now, system_now),
            system_now - seconds(1));
  const auto timeout = ParseGrpcTimeout("2400000H");
  ASSERT_TRUE(timeout);
  EXPECT_EQ(SystemDeadlineOf(steady_now + *timeout, steady_now, system_now),
            system_clock::time_point::max());
  EXPECT_EQ(SystemDeadlineOf(steady_now + hours(24 * 365 * 100), steady_now, system_now),
            system_now + hours(24 * 365 * 100));
}

TEST(GrpcWire, GrpcTimeoutUnitsAndMalformedValues) {
  EXPECT_EQ(ParseGrpcTimeout("1H"), nanoseconds(hours(1)));
  EXPECT_EQ(ParseGrpcTimeout("2M"), nanoseconds(minutes(2)));
  EXPECT_EQ(ParseGrpcTimeout("30S"), nanoseconds(seconds(30)));
  EXPECT_EQ(ParseGrpcTimeout("250m"), nanoseconds(milliseconds(250)));
  EXPECT_EQ(ParseGrpcTimeout("99999999u"), nanoseconds(microseconds(99999999)));
  EXPECT_EQ(ParseGrpcTimeout("7n"), nanoseconds(7));
  // The longest values of each unit: only hours pass int64 nanoseconds
  // (until session 47 they overflowed into a garbage deadline).
  EXPECT_EQ(ParseGrpcTimeout("99999999M"), nanoseconds(minutes(99999999)));
  EXPECT_EQ(ParseGrpcTimeout("2562047H"), nanoseconds(hours(2562047)));
  EXPECT_EQ(ParseGrpcTimeout("2562048H"), nanoseconds::max());
  EXPECT_EQ(ParseGrpcTimeout("99999999H"), nanoseconds::max());
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

// The hand encoder of the token path against protobuf's own serializer:
// every field combination the native front end emits (deltas with and
// without tokens or text, the final message with its finish reason and
// usage, zero and multi-byte varints, long text and request ids), byte for
// byte, and the bytes parse back to the same message.
TEST(GrpcWire, GenerateResponseEncoderWritesProtobufsBytes) {
  const std::vector<std::string> ids_cases = {"", "r1", "chatcmpl-0123456789abcdef0123456789abcdef",
                                              std::string(200, 'x')};
  const std::vector<std::vector<uint32_t>> token_cases = {
      {}, {0}, {7}, {127, 128}, {16383, 16384, 2097151, 2097152}, {4294967295u, 1, 128000}};
  const std::vector<std::string> text_cases = {"", " the", "caf\xc3\xa9", std::string(300, 'a')};
  struct Final {
    int32_t reason;
    bool usage;
    UsageFields u;
  };
  const std::vector<Final> finals = {
      {0, false, {}},
      {v1::FINISH_REASON_STOP, true, {16, 1000, 0}},
      {v1::FINISH_REASON_LENGTH, true, {8000, 1, 7984}},
      {v1::FINISH_REASON_LENGTH, true, {0, 0, 0}},
      {v1::FINISH_REASON_STOP, true, {300, 129, 16384}},
      {0, true, {1, 2, 3}},
      {v1::FINISH_REASON_STOP, false, {}},
      {-1, false, {}},  // an int32 enum is written sign-extended, as protobuf does
  };
  int checked = 0;
  for (const auto& id : ids_cases) {
    for (const auto& tokens : token_cases) {
      for (const auto& text : text_cases) {
        for (const Final& f : finals) {
          v1::GenerateResponse m;
          m.set_request_id(id);
          m.mutable_token_ids()->Add(tokens.begin(), tokens.end());
          m.set_text(text);
          m.set_finish_reason(static_cast<v1::FinishReason>(f.reason));
          if (f.usage) {
            m.mutable_usage()->set_prompt_tokens(f.u.prompt_tokens);
            m.mutable_usage()->set_completion_tokens(f.u.completion_tokens);
            m.mutable_usage()->set_cached_prompt_tokens(f.u.cached_prompt_tokens);
          }
          const std::string want = m.SerializeAsString();
          std::string got = "prefix";  // appends after what is there
          AppendGenerateResponse(got, id, tokens, text, f.reason, f.usage ? &f.u : nullptr);
          ASSERT_EQ(got.substr(0, 6), "prefix");
          ASSERT_EQ(got.size(), 6 + 5 + want.size());
          const auto* p = reinterpret_cast<const uint8_t*>(got.data() + 6);
          const MessagePrefix prefix = ReadMessagePrefix(p);
          EXPECT_FALSE(prefix.compressed);
          ASSERT_EQ(prefix.length, want.size());
          ASSERT_EQ(got.substr(11), want) << "id '" << id << "', " << tokens.size()
                                          << " tokens, text of " << text.size() << " bytes, reason "
                                          << f.reason << ", usage " << f.usage;
          v1::GenerateResponse back;
          ASSERT_TRUE(back.ParseFromString(got.substr(11)));
          EXPECT_EQ(back.SerializeAsString(), want);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 4 * 6 * 4 * 8);
}

}  // namespace
}  // namespace tandem::proxy::h2
