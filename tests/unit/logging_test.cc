#include "common/logging.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <sstream>

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

}  // namespace
}  // namespace tandem
