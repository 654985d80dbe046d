// libFuzzer target: a fleet file (YAML) as ParseFleetConfig validates it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto c = tandem::ParseFleetConfig(text, "fuzz.yaml", "/nonexistent-fuzz-dir");
  if (!c.ok() && c.status().message().empty()) __builtin_trap();  // errors must say what
  return 0;
}
