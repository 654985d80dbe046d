#include "fuzz_util.h"

#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

namespace tandem::fuzz {

void QuietLogs() {
  static const bool done = [] {
    spdlog::set_level(spdlog::level::off);
    // protobuf logs every string field that is not UTF-8 (kv_notice).
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)done;
}

}  // namespace tandem::fuzz
