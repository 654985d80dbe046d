// Process-wide logging setup over spdlog: human-readable text or JSON lines
// (one object per line: ts, level, proc, msg, and request_id on lines about
// one request), level from config or flag.
#pragma once

#include <spdlog/formatter.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"

namespace tandem {

enum class LogFormat { kText, kJson };

// `process` names this process in every line (e.g. "proxy", "prefill-0").
// `level`: trace | debug | info | warn | error. `format`: text | json.
Status SetupLogging(const std::string& process, const std::string& level,
                    const std::string& format);

// The formatter SetupLogging installs, for attaching to other sinks.
Result<std::unique_ptr<spdlog::formatter>> MakeLogFormatter(const std::string& process,
                                                            const std::string& format);

// Escapes `s` for inclusion inside a JSON string literal.
std::string JsonEscape(std::string_view s);

// The request the lines logged on this thread are about, for as long as the
// scope lives (scopes nest; the innermost wins). The formatters write it as
// "request_id" (JSON; a worker's "<id>#<attempt>" key becomes "request_id":"<id>",
// "attempt":N; a fleet id "<label>~<nonce>" (common/request_id.h) becomes
// "request_id":"<label>","fleet_id":"<nonce>") or "[req=ID]" (text). Thread-local: a scope covers
// only lines logged by its own thread, synchronously (tandem's loggers are).
class LogRequestScope {
 public:
  explicit LogRequestScope(std::string_view request_id);
  ~LogRequestScope();
  LogRequestScope(const LogRequestScope&) = delete;
  LogRequestScope& operator=(const LogRequestScope&) = delete;

 private:
  std::string previous_;
};

// The id of the innermost LogRequestScope of this thread ("" when none).
const std::string& CurrentLogRequestId();

// One line about request `request_id`:
//   LogRequest(spdlog::level::debug, id, "reserved {} blocks", n);
template <typename... Args>
void LogRequest(spdlog::level::level_enum level, std::string_view request_id,
                spdlog::format_string_t<Args...> fmt, Args&&... args) {
  if (!spdlog::should_log(level)) return;
  LogRequestScope scope(request_id);
  spdlog::log(level, fmt, std::forward<Args>(args)...);
}

}  // namespace tandem
