// TANDEM_CHECK: for programmer errors only (broken invariants), never for
// bad input or run-time failures, which return a Status. Reports file, line,
// the condition and a formatted message, then aborts.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

namespace tandem::detail {
[[noreturn]] inline void CheckFailed(const char* file, int line, const char* cond,
                                     const std::string& msg) {
  std::fprintf(stderr, "%s:%d: check failed: %s%s%s\n", file, line, cond, msg.empty() ? "" : ": ",
               msg.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace tandem::detail

#define TANDEM_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) [[unlikely]] {                                                        \
      ::tandem::detail::CheckFailed(__FILE__, __LINE__, #cond, fmt::format("" __VA_ARGS__)); \
    }                                                                                  \
  } while (0)
