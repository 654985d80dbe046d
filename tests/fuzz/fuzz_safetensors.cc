// libFuzzer target: a safetensors file (header length, JSON header, tensor
// table) as SafetensorsFile::Open validates it, then every tensor read.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::QuietLogs();
  tandem::fuzz::MemFile file(data, size, "fuzz.safetensors");
  auto f = tandem::model::SafetensorsFile::Open(file.path());
  if (!f.ok()) return 0;
  for (const auto& [name, t] : (*f)->tensors()) {
    if (t.numel() > (1u << 20)) continue;  // bounded work per input
    auto v = (*f)->ReadF32(name, t.shape);
    if (!v.ok() || v->size() != t.numel()) __builtin_trap();  // validated tensors must read
  }
  return 0;
}
