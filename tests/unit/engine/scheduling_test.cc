// Issue 22 (docs/scheduling.md) in the engine: priorities order the waiting
// list and let a better priority preempt a worse one's decode (which then
// resumes with unchanged output); tenants of one priority share the steps
// by weighted fair queueing on tokens; a new request waits for the growth
// reserve while others run. Also FairShare on its own.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/fair_share.h"
#include "test_models.h"

namespace tandem::engine {
namespace {
using testing::Collector;
using testing::MakeEngine;
using testing::Prompt;
using testing::TinyModel;

GenerateRequest Req(const std::string& id, std::vector<uint32_t> prompt, uint32_t max_tokens,
                    Collector* c, int32_t priority = 0, const std::string& tenant = "",
                    double weight = 1.0) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.sampling.seed = 7;
  r.sampling.ignore_eos = true;
  r.priority = priority;
  r.tenant = tenant;
  r.tenant_weight = weight;
  if (c) r.on_output = c->Callback();
  return r;
}

TEST(FairShareTest, OrdersByPriorityThenVirtualTimeThenArrival) {
  FairShare f;
  FairTenant* a = f.Enqueue("a", 1);
  FairTenant* b = f.Enqueue("b", 1);
  EXPECT_EQ(f.Enqueue("a", 1), a);               // one entry per tenant
  EXPECT_TRUE(f.Before({0, b, 9}, {10, a, 1}));  // priority first
  EXPECT_TRUE(f.Before({0, a, 1}, {0, b, 2}));   // equal virtual time: arrival
  FairShare::Charge(*a, 100);
  EXPECT_TRUE(f.Before({0, b, 2}, {0, a, 1}));  // a was served more
  EXPECT_TRUE(f.Before({0, a, 1}, {0, a, 2}));  // one tenant: arrival
  EXPECT_DOUBLE_EQ(f.VirtualTime("a"), 100);
  // Weight 4: 100 tokens cost a quarter; a run of 3 charges at once moves
  // the virtual time as 3 single charges.
  FairTenant* c = f.Enqueue("c", 4);
  FairShare::Charge(*c, 100);
  EXPECT_DOUBLE_EQ(f.VirtualTime("c"), 25);
  FairShare::Charge(*c, 8, 3);
  EXPECT_DOUBLE_EQ(f.VirtualTime("c"), 31);
  EXPECT_EQ(f.served(), (std::map<std::string, uint64_t>{{"a", 100}, {"b", 0}, {"c", 124}}));
  // A tenant that comes back after idling starts at the system time.
  f.Picked(*a);
  f.Enqueue("d", 1);
  EXPECT_DOUBLE_EQ(f.VirtualTime("d"), 100);
  EXPECT_DOUBLE_EQ(f.VirtualTime("never queued"), 100);
}

// max_num_seqs 2 full of priority-10 decodes: a priority-0 request preempts
// one of them, gets its first token in the very next step, and the
// preempted one later finishes with the tokens it would have had alone.
TEST(SchedulingTest, BetterPriorityPreemptsAWorseDecodeWhichResumesUnchanged) {
  EngineOptions o;
  o.scheduler.max_num_seqs = 2;
  o.num_blocks = 64;
  std::vector<std::pair<int32_t, double>> queued;  // on_queue_time: once per request
  o.on_queue_time = [&](int32_t priority, const std::string&, double seconds) {
    queued.emplace_back(priority, seconds);
  };
  auto e = MakeEngine(TinyModel(), o);
  Collector low[3];
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(e->Submit(Req(testing::Id("low", i), Prompt(40, i), 12, &low[i], 10)).ok());
  }
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->Step());  // both slots decoding
  ASSERT_FALSE(low[0].tokens.empty());
  ASSERT_FALSE(low[1].tokens.empty());
  EXPECT_TRUE(low[2].tokens.empty());
  Collector high;
  ASSERT_TRUE(e->Submit(Req("high", Prompt(40, 9), 4, &high, 0)).ok());
  ASSERT_TRUE(e->Step());
  EXPECT_EQ(high.tokens.size(), 1u);  // admitted at once, ahead of low2
  EXPECT_EQ(e->stats().preemptions, 1u);
  EXPECT_TRUE(low[2].tokens.empty());
  e->RunUntilIdle();
  EXPECT_TRUE(high.finished);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(low[i].finished);
    EXPECT_EQ(low[i].tokens.size(), 12u);
    auto alone = MakeEngine(TinyModel());
    Collector c;
    ASSERT_TRUE(alone->Submit(Req("alone", Prompt(40, i), 12, &c)).ok());
    alone->RunUntilIdle();
    EXPECT_EQ(low[i].tokens, c.tokens) << "low" << i;
  }
  EXPECT_EQ(e->stats().free_blocks, o.num_blocks);
  ASSERT_EQ(queued.size(), 4u);  // the preempted one is not counted twice
  EXPECT_EQ(queued[2].first, 0);  // high, before low2
  EXPECT_EQ(queued[3].first, 10);
  for (const auto& [p, seconds] : queued) EXPECT_GE(seconds, 0.0);
}

// Without preemption room (same priority): FIFO as before, no preemption.
TEST(SchedulingTest, EqualPriorityNeverPreempts) {
  EngineOptions o;
  o.scheduler.max_num_seqs = 1;
  auto e = MakeEngine(TinyModel(), o);
  Collector a, b;
  ASSERT_TRUE(e->Submit(Req("a", Prompt(20, 1), 6, &a, 5)).ok());
  ASSERT_TRUE(e->Step());
  ASSERT_TRUE(e->Submit(Req("b", Prompt(20, 2), 6, &b, 5)).ok());
  while (!a.finished) {
    ASSERT_TRUE(e->Step());
    if (!a.finished) {
      EXPECT_TRUE(b.tokens.empty());
    }
  }
  e->RunUntilIdle();
  EXPECT_TRUE(b.finished);
  EXPECT_EQ(e->stats().preemptions, 0u);
}

// The growth reserve at admission (docs/engine.md "Growth reserve"): while
// `a` decodes in an 8-block pool towards 6 blocks, a new request `b` of 2
// blocks growing to 5 fits the free blocks but would leave `a` too few to
// grow into: it waits until `a` ends, and nothing is preempted. Without the
// reserve (schedule_conservativeness 0) `b` is admitted at once and one of
// the two is preempted on the way. Both ways each output equals its
// request generated alone.
TEST(SchedulingTest, ANewRequestWaitsForTheRunningOnesGrowthInsteadOfPreemptingThem) {
  for (const double conservativeness : {1.0, 0.0}) {
    SCOPED_TRACE(conservativeness);
    auto e = testing::MakeSmallPoolEngine(8, conservativeness);
    Collector a, b;
    // 48 prompt tokens and 40 to generate: a's KV ends at 87 tokens, 6 blocks.
    ASSERT_TRUE(e->Submit(Req("a", Prompt(48, 1), 40, &a)).ok());
    ASSERT_TRUE(e->Step());
    // 32 and 40: b's ends at 71 tokens, 5 blocks.
    ASSERT_TRUE(e->Submit(Req("b", Prompt(32, 2), 40, &b)).ok());
    ASSERT_TRUE(e->Step());
    if (conservativeness > 0) {
      // a took its 4th block; b's 2 fit the 4 free, but the reserve keeps
      // ceil(0.7 x (23 + 39) / 16) = 3 of them for a's growth and b's own.
      EXPECT_EQ(e->stats().num_running, 1u);
      EXPECT_EQ(e->stats().num_waiting, 1u);
      EXPECT_TRUE(b.tokens.empty());
      while (!a.finished) {
        ASSERT_TRUE(e->Step());
        if (!a.finished) {
          EXPECT_TRUE(b.tokens.empty());
        }
      }
      e->RunUntilIdle();
      EXPECT_EQ(e->stats().preemptions, 0u);
    } else {
      EXPECT_EQ(e->stats().num_running, 2u);
      EXPECT_EQ(b.tokens.size(), 1u);
      e->RunUntilIdle();
      EXPECT_GE(e->stats().preemptions, 1u);
    }
    EXPECT_EQ(a.tokens, testing::GenerateAlone(Prompt(48, 1), 40));
    EXPECT_EQ(b.tokens, testing::GenerateAlone(Prompt(32, 2), 40));
    EXPECT_EQ(e->stats().free_blocks, 8u);
  }
}

// Two tenants of weight 1, one queueing 4x the other's requests (submitted
// first): while both have requests waiting, each is delivered about half
// the tokens (within 20 %); FIFO would give the light tenant nothing.
TEST(SchedulingTest, TenantsShareTokensEquallyWhileBothAreBacklogged) {
  EngineOptions o;
  o.scheduler.max_num_seqs = 4;
  o.num_blocks = 256;
  auto e = MakeEngine(TinyModel(), o);
  constexpr int kHeavy = 32, kLight = 8;
  std::vector<std::unique_ptr<Collector>> heavy, light;
  for (int i = 0; i < kHeavy; ++i) {
    heavy.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(e->Submit(Req(testing::Id("h", i), Prompt(16, i), 8, heavy.back().get(), 0,
                              "heavy")).ok());
  }
  for (int i = 0; i < kLight; ++i) {
    light.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(e->Submit(Req(testing::Id("l", i), Prompt(16, 100 + i), 8, light.back().get(), 0,
                              "light")).ok());
  }
  auto delivered = [](const std::vector<std::unique_ptr<Collector>>& v) {
    size_t n = 0;
    for (const auto& c : v) n += c->tokens.size();
    return n;
  };
  // Both are backlogged while each still has a request not yet started.
  auto waiting = [](const std::vector<std::unique_ptr<Collector>>& v) {
    for (const auto& c : v) {
      if (c->tokens.empty()) return true;
    }
    return false;
  };
  size_t h = 0, l = 0;
  for (int step = 0; step < 10000 && waiting(heavy) && waiting(light); ++step) {
    h = delivered(heavy);
    l = delivered(light);
    ASSERT_TRUE(e->Step());
  }
  ASSERT_GT(h + l, 40u);
  const double mean = double(h + l) / 2;
  EXPECT_LE(std::abs(double(h) - mean), 0.2 * mean) << "heavy " << h << " light " << l;
  e->RunUntilIdle();
  for (const auto& c : heavy) EXPECT_TRUE(c->finished);
  for (const auto& c : light) EXPECT_TRUE(c->finished);
}

// Weights 3:1: the weighted tenant gets about three quarters.
TEST(SchedulingTest, WeightsSplitTokensInProportion) {
  EngineOptions o;
  o.scheduler.max_num_seqs = 4;
  o.num_blocks = 256;
  auto e = MakeEngine(TinyModel(), o);
  std::vector<std::unique_ptr<Collector>> a, b;
  for (int i = 0; i < 24; ++i) {
    a.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(e->Submit(Req(testing::Id("a", i), Prompt(16, i), 8, a.back().get(), 0, "a", 3))
                    .ok());
    b.push_back(std::make_unique<Collector>());
    ASSERT_TRUE(e->Submit(Req(testing::Id("b", i), Prompt(16, 50 + i), 8, b.back().get(), 0, "b",
                              1)).ok());
  }
  auto delivered = [](const std::vector<std::unique_ptr<Collector>>& v) {
    size_t n = 0;
    for (const auto& c : v) n += c->tokens.size();
    return n;
  };
  auto waiting = [](const std::vector<std::unique_ptr<Collector>>& v) {
    for (const auto& c : v) {
      if (c->tokens.empty()) return true;
    }
    return false;
  };
  size_t na = 0, nb = 0;
  for (int step = 0; step < 10000 && waiting(a) && waiting(b); ++step) {
    na = delivered(a);
    nb = delivered(b);
    ASSERT_TRUE(e->Step());
  }
  ASSERT_GT(na + nb, 40u);
  const double share = double(na) / double(na + nb);
  EXPECT_NEAR(share, 0.75, 0.75 * 0.2) << "a " << na << " b " << nb;
  e->RunUntilIdle();
}

}  // namespace
}  // namespace tandem::engine
