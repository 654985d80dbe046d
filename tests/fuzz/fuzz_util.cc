#include "fuzz_util.h"

#include <spdlog/spdlog.h>

namespace tandem::fuzz {

void QuietLogs() {
  static const bool done = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)done;
}

}  // namespace tandem::fuzz
