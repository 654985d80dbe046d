// The autoscaling planner's rules (docs/scheduling.md, "Autoscaling"):
// proportional scale-up bounded by max and by doubling, cooldowns, one step
// down only when one worker fewer would still be well under target, and the
// windowed quantile of the proxy's histograms. The launcher following these
// counts with real processes: tests/integration/sim/autoscale_fleet_test.cc.
#include "proxy/planner.h"

#include <gtest/gtest.h>

#include <prometheus/histogram.h>

namespace tandem::proxy {
namespace {

AutoscaleConfig Config() {
  AutoscaleConfig c;
  c.enabled = true;
  c.prefill = {1, 4};
  c.decode = {1, 3};
  c.scale_up_cooldown_s = 10;
  c.scale_down_cooldown_s = 30;
  c.ttft_target_ms = 500;
  c.itl_target_ms = 50;
  c.queued_prefill_tokens_target = 1000;
  c.kv_usage_target = 0.5;
  c.scale_down_below = 0.6;
  return c;
}

PlannerInputs Load(uint32_t p, uint32_t d, double ttft_ms, double itl_ms, double queued = 0,
                   double kv = 0) {
  PlannerInputs in;
  in.prefillers = p;
  in.decoders = d;
  in.ttft_p90_s = ttft_ms < 0 ? -1 : ttft_ms / 1000;
  in.itl_p90_s = itl_ms < 0 ? -1 : itl_ms / 1000;
  in.queued_prefill_tokens = queued;
  in.kv_usage = kv;
  return in;
}

TEST(PlannerPolicy, StartsAtTheFleetFileClampedIntoTheBounds) {
  PlannerPolicy a(Config(), 0, 9);
  EXPECT_EQ(a.desired_prefill(), 1u);
  EXPECT_EQ(a.desired_decode(), 3u);
}

TEST(PlannerPolicy, ScalesUpProportionallyCappedByDoublingAndMax) {
  PlannerPolicy p(Config(), 1, 1);
  // TTFT 1.5x target on one prefiller: 2; ITL at target: decode stays.
  auto d = p.Evaluate(Load(1, 1, 750, 50), 0);
  EXPECT_EQ(d.prefill, 2u);
  EXPECT_EQ(d.decode, 1u);
  EXPECT_DOUBLE_EQ(d.prefill_pressure, 1.5);
  // Within the cooldown nothing moves, however high the pressure.
  d = p.Evaluate(Load(2, 1, 5000, 500), 5);
  EXPECT_EQ(d.prefill, 2u);
  EXPECT_EQ(d.decode, 2u);  // decode's first change: its own cooldown had not started
  // After it: 10x on two prefillers wants 20, doubling caps at 4 (= max).
  d = p.Evaluate(Load(2, 2, 5000, 40), 11);
  EXPECT_EQ(d.prefill, 4u);
  EXPECT_EQ(d.decode, 2u);
  // KV usage drives decode too: 0.9 / 0.5 on 2 decoders wants 4, max is 3.
  d = p.Evaluate(Load(4, 2, 100, 10, 0, 0.9), 16);
  EXPECT_EQ(d.decode, 3u);
  // Queued prefill tokens drive prefill: already at max.
  d = p.Evaluate(Load(4, 3, 100, 10, 8000), 40);
  EXPECT_EQ(d.prefill, 4u);
}

TEST(PlannerPolicy, ScalesDownOneAtATimeAfterTheCooldownWithHysteresis) {
  PlannerPolicy p(Config(), 3, 1);
  // TTFT at 0.65 of target: under 1 but not under scale_down_below: stays (the band).
  auto d = p.Evaluate(Load(3, 1, 325, 10), 100);
  EXPECT_EQ(d.prefill, 3u);
  // Queue at 0.5 of target on 3: 0.75 on 2 is not under 0.6: stays, TTFT low or not.
  d = p.Evaluate(Load(3, 1, 100, 10, 1500), 101);
  EXPECT_EQ(d.prefill, 3u);
  // TTFT 0.3 of target and the queue (0.3 on 3, 0.45 on 2) low: one down.
  d = p.Evaluate(Load(3, 1, 150, 10, 900), 102);
  EXPECT_EQ(d.prefill, 2u);
  // Not settled yet (3 still registered) and within the cooldown: no second step.
  d = p.Evaluate(Load(3, 1, -1, -1), 103);
  EXPECT_EQ(d.prefill, 2u);
  d = p.Evaluate(Load(2, 1, -1, -1), 120);
  EXPECT_EQ(d.prefill, 2u);
  // Idle (no samples in the window) after the cooldown: down to min, one step at a time.
  d = p.Evaluate(Load(2, 1, -1, -1), 133);
  EXPECT_EQ(d.prefill, 1u);
  d = p.Evaluate(Load(1, 1, -1, -1), 200);
  EXPECT_EQ(d.prefill, 1u);
  EXPECT_EQ(d.decode, 1u);
}

TEST(PlannerPolicy, DecodeScalesDownOnKvUsageOnOneFewer) {
  PlannerPolicy p(Config(), 1, 2);
  // KV usage 0.25 (target 0.5) on 2 decoders would be 1.0 on one: stays.
  auto d = p.Evaluate(Load(1, 2, 100, 10, 0, 0.25), 100);
  EXPECT_EQ(d.decode, 2u);
  // 0.1 on 2 is 0.4 of target on one: down.
  d = p.Evaluate(Load(1, 2, 100, 10, 0, 0.1), 101);
  EXPECT_EQ(d.decode, 1u);
  // ITL near target keeps decoders even with little KV in use.
  PlannerPolicy q(Config(), 1, 2);
  d = q.Evaluate(Load(1, 2, 100, 40, 0, 0.01), 100);
  EXPECT_EQ(d.decode, 2u);
}

TEST(PlannerPolicy, RequestsAwaitingAFirstTokenDrivePrefill) {
  PlannerPolicy p(Config(), 1, 1);
  PlannerInputs in = Load(1, 1, 100, 10);
  in.awaiting_first_token = 1.5;  // target 1.0 per prefiller
  auto d = p.Evaluate(in, 0);
  EXPECT_DOUBLE_EQ(d.prefill_pressure, 1.5);
  EXPECT_EQ(d.prefill, 2u);
  // 2 awaiting on 3 prefillers: 0.67 each, 1.0 on 2: no step down.
  PlannerPolicy q(Config(), 3, 1);
  in = Load(3, 1, 100, 10);
  in.awaiting_first_token = 2.0;
  EXPECT_EQ(q.Evaluate(in, 100).prefill, 3u);
  // 1 awaiting on 3: 0.5 each on 2 < 0.6: one down.
  in.awaiting_first_token = 1.0;
  EXPECT_EQ(q.Evaluate(in, 101).prefill, 2u);
}

TEST(PlannerPolicy, NoDecisionWithoutRegisteredWorkers) {
  PlannerPolicy p(Config(), 2, 2);
  auto d = p.Evaluate(Load(0, 0, 9000, 900, 1e6, 1), 100);
  EXPECT_EQ(d.prefill, 2u);
  EXPECT_EQ(d.decode, 2u);
}

TEST(PlannerPolicy, AScaleUpAfterADownStepWaitsOnlyForTheUpCooldown) {
  PlannerPolicy p(Config(), 2, 1);
  auto d = p.Evaluate(Load(2, 1, -1, -1), 100);
  EXPECT_EQ(d.prefill, 1u);
  d = p.Evaluate(Load(1, 1, 2000, 10), 105);  // within scale_up_cooldown_s of that change
  EXPECT_EQ(d.prefill, 1u);
  d = p.Evaluate(Load(1, 1, 2000, 10), 110);
  EXPECT_EQ(d.prefill, 2u);
}

TEST(WindowQuantile, InterpolatesWithinTheBucketOfTheWindowOnly) {
  prometheus::Histogram h({0.1, 0.2, 0.4});
  const auto before_empty = h.Collect().histogram.bucket;
  EXPECT_EQ(WindowQuantile(before_empty, before_empty, 0.9), -1);
  for (int i = 0; i < 100; ++i) h.Observe(0.05);  // before the window
  const auto before = h.Collect().histogram.bucket;
  for (int i = 0; i < 10; ++i) h.Observe(0.15);  // in the window: all in (0.1, 0.2]
  const auto now = h.Collect().histogram.bucket;
  EXPECT_NEAR(WindowQuantile(before, now, 0.5), 0.15, 1e-9);
  EXPECT_NEAR(WindowQuantile(before, now, 0.9), 0.19, 1e-9);
  // Over everything, p50 is in the first bucket.
  EXPECT_NEAR(WindowQuantile(before_empty, now, 0.5), 0.1 * 55 / 100, 1e-9);
  // Past the last finite bound: that bound.
  for (int i = 0; i < 50; ++i) h.Observe(3.0);
  EXPECT_DOUBLE_EQ(WindowQuantile(now, h.Collect().histogram.bucket, 0.9), 0.4);
}

}  // namespace
}  // namespace tandem::proxy
