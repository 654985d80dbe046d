#include "common/delivery_scope.h"

#include <fstream>
#include <string>

namespace tandem {

using SteadyClock = std::chrono::steady_clock;

namespace {

bool KernelKeepsTimeWithTsc() {
#if defined(__x86_64__)
  std::ifstream f("/sys/devices/system/clocksource/clocksource0/current_clocksource");
  std::string name;
  return static_cast<bool>(f >> name) && name == "tsc";
#else
  return false;
#endif
}

// The shortest interval a rate is measured over: a reading's counter is
// within ~1 us of it (kMaxReadingTicks bounds it at ~20 us), so the rate is
// off by ~5e-5 at most typically, ~1e-3 at worst: 5 us (100 us) over the
// kReanchorNs it is used for.
constexpr int64_t kMinRateNs = 20'000'000;
// Counter ticks between the two reads around a clock reading beyond which
// it is not used as an anchor (~40 us at 1 GHz and up).
constexpr uint64_t kMaxReadingTicks = 40'000;

}  // namespace

bool BatchClock::UsesTsc() {
  static const bool uses = KernelKeepsTimeWithTsc();
  return uses;
}

SteadyClock::time_point BatchClock::Reanchor(uint64_t before) {
  const auto now = SteadyClock::now();
  const uint64_t after = ReadTsc();
  ++readings_;
  auto answer = [this](SteadyClock::time_point t) {
    if (t < last_) t = last_;
    last_ = t;
    return t;
  };
  // The reading's counter: the middle of the two around it, which are
  // ~1-2 us apart when the clock's code is cold. Further apart (the thread
  // was preempted in between), the pair is not used.
  if (after < before || after - before > kMaxReadingTicks) return answer(now);
  const uint64_t tsc = before + (after - before) / 2;
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - anchor_).count();
  if (anchor_tsc_ != 0 && ns < kMinRateNs && tsc > anchor_tsc_) {
    return answer(now);  // too soon to measure a rate from the anchor: keep it
  }
  if (anchor_tsc_ != 0 && tsc > anchor_tsc_ && ns > 0) {
    const double rate = static_cast<double>(ns) / static_cast<double>(tsc - anchor_tsc_);
    // A rate far off the last one (the counter jumped: the VM was restored
    // elsewhere) starts over; the first is taken as it is.
    ns_per_tick_ = ns_per_tick_ == 0 || (rate > 0.5 * ns_per_tick_ && rate < 2 * ns_per_tick_)
                       ? rate
                       : 0;
    reanchor_ticks_ =
        ns_per_tick_ > 0 ? static_cast<uint64_t>(static_cast<double>(kReanchorNs) / ns_per_tick_) : 0;
  }
  anchor_tsc_ = tsc;
  anchor_ = now;
  return answer(now);
}

}  // namespace tandem
