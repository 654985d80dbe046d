// DeliveryScope's one clock reading per batch and the BatchClock behind it
// (common/delivery_scope.h): inside a scope every Now() is the same time;
// the batch clock never goes back and stays with the steady clock while it
// extrapolates between readings of it (the ITL samples are taken from it).
#include "common/delivery_scope.h"

#include <gtest/gtest.h>

#include <chrono>

namespace tandem {
namespace {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::microseconds;

TEST(DeliveryScope, OneTimeForTheWholeScope) {
  SteadyClock::time_point first, again;
  const auto before = SteadyClock::now();
  {
    DeliveryScope outer;
    first = DeliveryScope::Now();
    {
      DeliveryScope inner;  // nested: the outermost scope's time
      const auto spin_until = SteadyClock::now() + microseconds(200);
      while (SteadyClock::now() < spin_until) {
      }
      again = DeliveryScope::Now();
    }
    EXPECT_EQ(DeliveryScope::Now(), first);
  }
  EXPECT_EQ(again, first);
  EXPECT_GE(first, before - microseconds(100));
  // Outside any scope: the clock itself, past the scope's time.
  EXPECT_GT(DeliveryScope::Now(), first);
}

// A thread's batches over ~0.5 s of steady time (spinning, with a batch
// every ~0.5 ms): each batch's time lies between steady-clock readings
// taken just before and after it (within the extrapolation's bound), never
// earlier than the previous batch's; with the TSC in use, the clock is
// read far less often than once per batch.
TEST(DeliveryScope, BatchTimesFollowTheSteadyClock) {
  const auto tolerance = microseconds(150);
  const auto start = SteadyClock::now();
  const uint64_t readings_before = DeliveryScope::ThreadClock().readings();
  SteadyClock::time_point prev{};
  int batches = 0;
  while (SteadyClock::now() - start < std::chrono::milliseconds(500)) {
    const auto a = SteadyClock::now();
    SteadyClock::time_point t;
    {
      DeliveryScope scope;
      t = DeliveryScope::Now();
    }
    const auto b = SteadyClock::now();
    ASSERT_GE(t, a - tolerance) << "batch " << batches;
    ASSERT_LE(t, b + tolerance) << "batch " << batches;
    ASSERT_GE(t, prev) << "batch " << batches;
    prev = t;
    ++batches;
    const auto spin_until = SteadyClock::now() + microseconds(500);
    while (SteadyClock::now() < spin_until) {
    }
  }
  const uint64_t readings = DeliveryScope::ThreadClock().readings() - readings_before;
  if (BatchClock::UsesTsc()) {
    // A reading per batch for the first rate (20 ms), then one per 100 ms
    // (and any whose two counter reads were too far apart).
    EXPECT_LT(readings, static_cast<uint64_t>(batches) / 2) << batches << " batches";
  } else {
    EXPECT_EQ(readings, 0u);  // steady_clock::now() directly
  }
}

}  // namespace
}  // namespace tandem
