// Process-wide logging setup over spdlog: human-readable text or JSON lines
// (one object per line: ts, level, proc, msg), level from config or flag.
#pragma once

#include <spdlog/formatter.h>

#include <memory>
#include <string>

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

}  // namespace tandem
