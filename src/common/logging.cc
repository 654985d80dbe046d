#include "common/logging.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <spdlog/formatter.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "common/request_id.h"

namespace tandem {
namespace {

thread_local std::string t_request_id;

class JsonFormatter final : public spdlog::formatter {
 public:
  explicit JsonFormatter(std::string process) : process_(std::move(process)) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        msg.time.time_since_epoch()) .count();
    const std::time_t secs = static_cast<std::time_t>(ms / 1000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    const auto level = spdlog::level::to_string_view(msg.level);
    fmt::format_to(std::back_inserter(dest),
                   R"({{"ts":"{:%Y-%m-%dT%H:%M:%S}.{:03d}Z","level":"{}","proc":"{}",)", tm,
                   static_cast<int>(ms % 1000), std::string_view(level.data(), level.size()),
                   JsonEscape(process_));
    if (!t_request_id.empty()) {
      // Workers key a request by "<request_id>#<attempt>" (worker/attempt_key.h):
      // JSON lines carry the client's id and the attempt as separate fields, so
      // one id finds every line of a request on every process.
      std::string_view id = t_request_id;
      const size_t hash = id.rfind('#');
      const std::string_view suffix = hash == std::string_view::npos ? "" : id.substr(hash + 1);
      const bool has_attempt =
          !suffix.empty() && suffix.size() <= 9 &&
          std::all_of(suffix.begin(), suffix.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (has_attempt) id = id.substr(0, hash);
      // A fleet id "<label>~<nonce>" (common/request_id.h): the client's id
      // is the request_id, the nonce tells apart requests sharing a label.
      const FleetIdParts parts = SplitFleetRequestId(id);
      fmt::format_to(std::back_inserter(dest), R"("request_id":"{}",)", JsonEscape(parts.label));
      if (!parts.nonce.empty() && parts.nonce.data() != parts.label.data()) {
        fmt::format_to(std::back_inserter(dest), R"("fleet_id":"{}",)", parts.nonce);
      }
      if (has_attempt) fmt::format_to(std::back_inserter(dest), R"("attempt":{},)", suffix);
    }
    fmt::format_to(std::back_inserter(dest), R"("msg":"{}"}})",
                   JsonEscape(std::string_view(msg.payload.data(), msg.payload.size())));
    dest.push_back('\n');
  }

  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>(process_);
  }

 private:
  std::string process_;
};

// %* in the text pattern: "[req=ID] " on lines about a request, else nothing.
class RequestIdFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    if (t_request_id.empty()) return;
    fmt::format_to(std::back_inserter(dest), "[req={}] ", t_request_id);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<RequestIdFlag>();
  }
};

}  // namespace

LogRequestScope::LogRequestScope(std::string_view request_id) : previous_(std::move(t_request_id)) {
  t_request_id.assign(request_id.data(), request_id.size());
}

LogRequestScope::~LogRequestScope() { t_request_id = std::move(previous_); }

const std::string& CurrentLogRequestId() { return t_request_id; }

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (const unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  return out;
}

Result<std::unique_ptr<spdlog::formatter>> MakeLogFormatter(const std::string& process,
                                                            const std::string& format) {
  if (format == "json") return std::unique_ptr<spdlog::formatter>(new JsonFormatter(process));
  if (format == "text") {
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->add_flag<RequestIdFlag>('*');
    f->set_pattern(fmt::format("%Y-%m-%d %H:%M:%S.%e %L [{}] %*%v", process));
    return std::unique_ptr<spdlog::formatter>(std::move(f));
  }
  return InvalidArgumentError(fmt::format("log format '{}' must be 'text' or 'json'", format));
}

Status SetupLogging(const std::string& process, const std::string& level,
                    const std::string& format) {
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgumentError(
        fmt::format("log level '{}' must be one of trace, debug, info, warn, error", level));
  }
  TANDEM_ASSIGN_OR_RETURN(auto formatter, MakeLogFormatter(process, format));
  auto logger = std::make_shared<spdlog::logger>(
      process, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_formatter(std::move(formatter));
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
  return Status::Ok();
}

}  // namespace tandem
