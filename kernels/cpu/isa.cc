#include "kernels/cpu/ops.h"

#include <algorithm>
#include <atomic>

namespace tandem::kernels::cpu {
namespace {
Isa Detect() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kPortable;
}
std::atomic<int> g_isa{static_cast<int>(Detect())};
}  // namespace

Isa BestIsa() {
  static const Isa best = Detect();
  return best;
}
Isa ActiveIsa() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }
void SetIsa(Isa isa) {
  g_isa.store(std::min(static_cast<int>(isa), static_cast<int>(BestIsa())),
              std::memory_order_relaxed);
}
const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "?";
}
}  // namespace tandem::kernels::cpu
