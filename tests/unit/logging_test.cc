#include "common/logging.h"
#include "common/request_id.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <sstream>
#include <thread>

namespace tandem {
namespace {

TEST(Logging, JsonEscape) {
  EXPECT_EQ(JsonEscape("a\"b\\c\n\t\x01"), "a\\\"b\\\\c\\n\\t\\u0001");
  EXPECT_EQ(JsonEscape("naïve"), "naïve");  // UTF-8 passes through
}

TEST(Logging, RejectsBadLevelAndFormat) {
  EXPECT_EQ(SetupLogging("t", "loud", "text").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetupLogging("t", "info", "xml").code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(SetupLogging("t", "warn", "text").ok());
  EXPECT_EQ(spdlog::default_logger()->level(), spdlog::level::warn);
}

std::string Emit(const std::string& format, const std::string& msg) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto f = MakeLogFormatter("prefill-0", format);
  EXPECT_TRUE(f.ok());
  sink->set_formatter(std::move(f).value());
  spdlog::logger logger("test", sink);
  logger.info("{}", msg);
  logger.flush();
  return out.str();
}

TEST(Logging, JsonLinesAreParseableObjects) {
  const std::string line = Emit("json", "req=abc said \"hi\"\nbye");
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1);  // exactly one line
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j.at("level"), "info");
  EXPECT_EQ(j.at("proc"), "prefill-0");
  EXPECT_EQ(j.at("msg"), "req=abc said \"hi\"\nbye");
  EXPECT_EQ(j.at("ts").get<std::string>().size(), 24u);  // 2026-11-29T20:45:50.123Z
}

TEST(Logging, TextLinesNameTheProcess) {
  const std::string line = Emit("text", "hello");
  EXPECT_NE(line.find("I [prefill-0] hello"), std::string::npos) << line;
}

std::string EmitAbout(const std::string& format, const std::string& request_id,
                      const std::string& msg) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto f = MakeLogFormatter("decode-0", format);
  EXPECT_TRUE(f.ok());
  sink->set_formatter(std::move(f).value());
  auto logger = std::make_shared<spdlog::logger>("test", sink);
  logger->set_level(spdlog::level::trace);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  LogRequest(spdlog::level::debug, request_id, "reserved {} blocks", 3);
  spdlog::info("{}", msg);  // not about a request
  logger->flush();
  spdlog::set_default_logger(previous);
  return out.str();
}

TEST(Logging, JsonLinesCarryTheRequestId) {
  const std::string out = EmitAbout("json", "req-\"7\"", "idle");
  std::istringstream lines(out);
  std::string first, second;
  ASSERT_TRUE(std::getline(lines, first));
  ASSERT_TRUE(std::getline(lines, second));
  const auto a = nlohmann::json::parse(first);
  EXPECT_EQ(a.at("request_id"), "req-\"7\"");
  EXPECT_EQ(a.at("msg"), "reserved 3 blocks");
  EXPECT_EQ(a.at("level"), "debug");
  EXPECT_EQ(a.at("proc"), "decode-0");
  const auto b = nlohmann::json::parse(second);
  EXPECT_FALSE(b.contains("request_id")) << second;  // the scope ended with the line
  EXPECT_EQ(b.at("msg"), "idle");
}

TEST(Logging, JsonLinesSplitAWorkersAttemptKey) {
  // Workers key requests by "<id>#<attempt>" (worker/attempt_key.h).
  auto first_line = [](const std::string& out) {
    return nlohmann::json::parse(out.substr(0, out.find('\n')));
  };
  const auto a = first_line(EmitAbout("json", "obs#7#12", "idle"));
  EXPECT_EQ(a.at("request_id"), "obs#7");
  EXPECT_EQ(a.at("attempt"), 12);
  const auto b = first_line(EmitAbout("json", "plain#x", "idle"));
  EXPECT_EQ(b.at("request_id"), "plain#x");
  EXPECT_FALSE(b.contains("attempt"));
}

TEST(Logging, JsonLinesShowAFleetIdsLabelAsTheRequestId) {
  // The proxy's fleet ids are "<client id>~<32 hex>" (common/request_id.h).
  auto first_line = [](const std::string& out) {
    return nlohmann::json::parse(out.substr(0, out.find('\n')));
  };
  const std::string nonce = "0123456789abcdef0123456789abcdef";
  const auto a = first_line(EmitAbout("json", "obs-1~" + nonce + "#3", "idle"));
  EXPECT_EQ(a.at("request_id"), "obs-1");
  EXPECT_EQ(a.at("fleet_id"), nonce);
  EXPECT_EQ(a.at("attempt"), 3);
  const auto b = first_line(EmitAbout("json", nonce + "#1", "idle"));  // no client id
  EXPECT_EQ(b.at("request_id"), nonce);
  EXPECT_FALSE(b.contains("fleet_id"));
  const auto c = first_line(EmitAbout("json", "x~not-hex", "idle"));
  EXPECT_EQ(c.at("request_id"), "x~not-hex");
  EXPECT_FALSE(c.contains("fleet_id"));
}

TEST(RequestId, FleetIdsAreRandomAndKeepTheLabel) {
  const std::string a = NewFleetRequestId("dup"), b = NewFleetRequestId("dup");
  EXPECT_NE(a, b);
  EXPECT_EQ(SplitFleetRequestId(a).label, "dup");
  EXPECT_EQ(SplitFleetRequestId(a).nonce.size(), 32u);
  const std::string bare = NewFleetRequestId("");
  EXPECT_EQ(bare.size(), 32u);
  EXPECT_EQ(SplitFleetRequestId(bare).label, bare);
  // A label that itself looks like a fleet id stays whole: only the last nonce is ours.
  const std::string nested = NewFleetRequestId(a);
  EXPECT_EQ(SplitFleetRequestId(nested).label, a);
}

TEST(Logging, TextLinesCarryTheRequestId) {
  const std::string out = EmitAbout("text", "abc", "idle");
  EXPECT_NE(out.find("D [decode-0] [req=abc] reserved 3 blocks"), std::string::npos) << out;
  EXPECT_NE(out.find("I [decode-0] idle"), std::string::npos) << out;
  EXPECT_EQ(out.find("[req=abc] idle"), std::string::npos) << out;
}

TEST(Logging, ScopesNestAndRestore) {
  EXPECT_EQ(CurrentLogRequestId(), "");
  {
    LogRequestScope outer("a");
    EXPECT_EQ(CurrentLogRequestId(), "a");
    {
      LogRequestScope inner("b");
      EXPECT_EQ(CurrentLogRequestId(), "b");
    }
    EXPECT_EQ(CurrentLogRequestId(), "a");
    std::string other_thread = "unset";
    std::thread([&] { other_thread = CurrentLogRequestId(); }).join();
    EXPECT_EQ(other_thread, "");  // thread-local
  }
  EXPECT_EQ(CurrentLogRequestId(), "");
}

TEST(Logging, LineBelowTheLevelIsNotFormatted) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto logger = std::make_shared<spdlog::logger>("test", sink);
  logger->set_level(spdlog::level::info);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);
  LogRequest(spdlog::level::debug, "x", "hidden {}", 1);
  LogRequest(spdlog::level::warn, "x", "shown {}", 2);
  logger->flush();
  spdlog::set_default_logger(previous);
  EXPECT_EQ(out.str().find("hidden"), std::string::npos);
  EXPECT_NE(out.str().find("shown 2"), std::string::npos);
}

}  // namespace
}  // namespace tandem
