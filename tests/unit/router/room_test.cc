// A decoder's room as the router sees it (docs/router.md, "Room"): its last
// load report minus the decode blocks of the routes made since. An attempt
// that is over withdraws its blocks at once (Router::EndAttempt), excluded
// workers are left out without a decision (RouteRequest::exclude), and an
// estimate alone never refuses a request the decoder's last report has
// room for: the decoder's Reserve decides then.
//
// Session 14's Failure.LeaseExpiryWithStoppedPrefiller under load: six
// retries after expired leases on a 2P1D fleet (512 blocks) were refused
// "no decoder has room ... the most free on any decoder is 12": the proxy
// routed each retry up to 8 times a call to skip an excluded prefiller, and
// every dropped decision kept its 25 blocks until the decoder's next report.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "router/router.h"

namespace tandem::router {
namespace {

constexpr uint32_t kBs = 16;
constexpr uint32_t kBlocks = 512;
constexpr uint32_t kPromptTokens = 400;  // 25 blocks

std::vector<uint64_t> Chain(uint64_t first, uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = (first + i + 1) * 0x9E3779B97F4A7C15ull;
  return v;
}

// 2P1D on a fake clock (report_lag 5 ms, the default).
struct TwoByOne {
  std::shared_ptr<std::atomic<int64_t>> now = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  std::unique_ptr<Router> router;
  WorkerId p0, p1, d0;
  uint64_t next_prompt = 0;

  TwoByOne() {
    RouterOptions o;
    o.clock = [c = now] { return c->load(); };
    router = Router::Create(RouterConfig{}, o).value();
    p0 = Add("p0", WorkerRole::kPrefill);
    p1 = Add("p1", WorkerRole::kPrefill);
    d0 = Add("d0", WorkerRole::kDecode);
  }
  WorkerId Add(const char* name, WorkerRole role) {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.epoch = 1;
    info.num_blocks = kBlocks;
    return router->AddWorker(info).value();
  }
  void Report(WorkerId w, uint32_t free_blocks) {
    ASSERT_TRUE(router->ApplyLoadReport(w, {.active_decode_blocks = kBlocks - free_blocks,
                                            .free_blocks = free_blocks})
                    .ok());
  }
  // A decoder's report with what its growth reserve keeps and its ratio.
  void ReportGrowth(WorkerId w, uint32_t free_blocks, uint32_t reserve, float ratio) {
    LoadReport r;
    r.active_decode_blocks = kBlocks - free_blocks;
    r.free_blocks = free_blocks;
    r.kv_growth_reserve_blocks = reserve;
    r.kv_growth_ratio = ratio;
    ASSERT_TRUE(router->ApplyLoadReport(w, r).ok());
  }
  // Adds a second decoder, d1, and reports both with their reserves and
  // ratios (d0's first); returns d1.
  WorkerId AddD1Reporting(uint32_t d0_free, uint32_t d0_reserve, float d0_ratio, uint32_t d1_free,
                          float d1_ratio) {
    const WorkerId d1 = Add("d1", WorkerRole::kDecode);
    ReportGrowth(d0, d0_free, d0_reserve, d0_ratio);
    ReportGrowth(d1, d1_free, 0, d1_ratio);
    return d1;
  }
  // A new prompt of `tokens` (nothing of it cached anywhere).
  Result<RouteDecision> Route(const WorkerMask* exclude = nullptr, uint32_t tokens = kPromptTokens,
                              uint32_t max_tokens = 0) {
    const std::vector<uint64_t> hashes = Chain(1000 * ++next_prompt, tokens / kBs);
    return router->Route({hashes, tokens, 0, exclude, max_tokens});
  }
  int64_t Free(WorkerId w) { return router->load(w)->free_blocks; }
  void AdvanceMs(int64_t ms) { now->fetch_add(ms * 1'000'000); }
};

// Decisions the caller does not use, and attempts that end before the
// decoder reports them, give their blocks back at once: any number of them
// between two reports leaves the decoder's room as its report says.
TEST(Room, AttemptsThatEndBeforeAReportGiveTheirBlocksBack) {
  TwoByOne f;
  f.Report(f.d0, kBlocks);
  for (int i = 0; i < 100; ++i) {  // 2500 blocks routed at a 512-block decoder
    auto d = f.Route();
    ASSERT_TRUE(d.ok()) << "route " << i << ": " << d.status().ToString();
    EXPECT_FALSE(d->room_by_report) << "route " << i;
    EXPECT_EQ(d->prefill_ticket.decode, f.d0);
    EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks} - 25);
    f.router->EndAttempt(d->prefill_ticket);
    f.router->EndAttempt(d->prefill_ticket);  // idempotent
    EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks});
  }
  EXPECT_EQ(f.router->counters().predictions_withdrawn, 100u);
  EXPECT_EQ(f.router->load(f.p0)->queued_prefill_tokens + f.router->load(f.p1)->queued_prefill_tokens, 0)
      << "EndAttempt ends the prefill too";
}

// Once a report counts the request, it is the report's: ending the attempt
// takes nothing off (the decoder's next report says what it freed).
TEST(Room, AnAttemptAReportCountedIsNotWithdrawnTwice) {
  TwoByOne f;
  f.Report(f.d0, kBlocks);
  auto d = f.Route();
  ASSERT_TRUE(d.ok());
  f.router->EndPrefill(d->prefill_ticket);  // the prefill reply
  f.AdvanceMs(10);
  f.Report(f.d0, kBlocks - 25);  // the decoder holds its blocks
  EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks} - 25);
  f.router->EndAttempt(d->prefill_ticket, /*prefill_ended=*/true);
  EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks} - 25);
  EXPECT_EQ(f.router->counters().predictions_withdrawn, 0u);
  // A later route's prediction is withdrawn, the counted one's still not.
  auto e = f.Route();
  ASSERT_TRUE(e.ok());
  f.router->EndAttempt(e->prefill_ticket);
  EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks} - 25);
  EXPECT_EQ(f.router->counters().predictions_withdrawn, 1u);
}

// Excluded workers are not candidates: one decision, on the other pair.
TEST(Room, ExcludedWorkersAreLeftOutOfTheDecision) {
  TwoByOne f;
  f.Report(f.d0, kBlocks);
  WorkerMask no_p0;
  no_p0.Set(f.p0);
  for (int i = 0; i < 4; ++i) {
    auto d = f.Route(&no_p0);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->prefill, f.p1);
    f.router->EndAttempt(d->prefill_ticket);
  }
  WorkerMask no_prefiller = no_p0;
  no_prefiller.Set(f.p1);
  auto none = f.Route(&no_prefiller);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable) << none.status().ToString();
  EXPECT_EQ(f.Free(f.d0), int64_t{kBlocks}) << "a refused route predicts nothing";
  EXPECT_EQ(f.router->counters().routes[static_cast<size_t>(Policy::kKvAware)], 4u);
}

// Blocks a decoder's growth reserve keeps free (docs/engine.md, "Growth
// reserve") are not room: its Reserve would wait for them. Of two
// decoders, the one with fewer free blocks but none reserved gets the
// 25-block prompt; with nothing reserved the less loaded one gets it.
TEST(Room, BlocksAGrowthReserveKeepsAreNotRoom) {
  TwoByOne f;
  const WorkerId d1 = f.AddD1Reporting(100, 90, 0, 40, 0);  // d0: 10 usable
  auto a = f.Route();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->decode, d1) << a->DebugString();
  EXPECT_FALSE(a->room_by_report);
  f.router->EndAttempt(a->prefill_ticket);
  f.ReportGrowth(f.d0, 100, 0, 0);
  auto b = f.Route();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->decode, f.d0) << b->DebugString();
}

// A decoder keeps free, beyond its reserve for the requests there, a share
// of what the new request may generate (its ratio x the tokens past the
// prompt's blocks): not room either (session 27). A 400-token prompt (25
// blocks) that may generate 256 tokens keeps ceil(1.0 x 255 / 16) = 16 at
// ratio 1: d0's 40 free leave 24. Its max_tokens unknown: d0 (the less
// loaded) has room and takes it.
TEST(Room, ARequestsOwnGrowthShareIsNotRoomEither) {
  TwoByOne f;
  const WorkerId d1 = f.AddD1Reporting(40, 0, 1.0f, 30, 0.0f);
  auto a = f.Route(nullptr, kPromptTokens, /*max_tokens=*/0);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->decode, f.d0) << a->DebugString();
  f.router->EndAttempt(a->prefill_ticket);
  auto b = f.Route(nullptr, kPromptTokens, /*max_tokens=*/256);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->decode, d1) << b->DebugString();
  EXPECT_FALSE(b->room_by_report);
}

// A route's own share counts in the decoder's reserve from the route on,
// until the decoder's report counts it (its Reserve adds the reservation's
// growth to the reserve at once) or the attempt ends (session 28). At ratio
// 1 a 400-token prompt that may generate 256 keeps 16: after `a`, d0 has
// 55 free with 16 kept, so `b` (25 blocks and 16 of its own) goes to d1,
// which is more loaded; before, d0 still looked to have room (55 - 16).
TEST(Room, ARoutesOwnShareCountsInTheDecodersReserveUntilItsReportDoes) {
  TwoByOne f;
  const WorkerId d1 = f.AddD1Reporting(80, 0, 1.0f, 50, 0.0f);
  auto a = f.Route(nullptr, kPromptTokens, /*max_tokens=*/256);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->decode, f.d0) << a->DebugString();
  EXPECT_EQ(f.Free(f.d0), 55);
  EXPECT_EQ(f.router->load(f.d0)->growth_reserve_blocks, 16);
  auto b = f.Route(nullptr, kPromptTokens, 256);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->decode, d1) << b->DebugString();
  EXPECT_EQ(f.router->load(d1)->growth_reserve_blocks, 0);  // its ratio is 0
  // Ended before a report: the share goes with the blocks.
  f.router->EndAttempt(b->prefill_ticket);
  f.router->EndAttempt(a->prefill_ticket);
  EXPECT_EQ(f.Free(f.d0), 80);
  EXPECT_EQ(f.router->load(f.d0)->growth_reserve_blocks, 0);
  // Counted by a report: the report's alone, not twice.
  auto c = f.Route(nullptr, kPromptTokens, 256);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->decode, f.d0) << c->DebugString();
  f.AdvanceMs(10);
  f.ReportGrowth(f.d0, 55, 16, 1.0f);
  EXPECT_EQ(f.router->load(f.d0)->growth_reserve_blocks, 16);
  EXPECT_EQ(f.Free(f.d0), 55);
}

// Routes in flight the decoder has not reported yet may add up to more than
// its last report's free blocks: the estimate. It alone does not refuse a
// request the report has room for; the decision says so and the decoder's
// Reserve decides. A decoder whose own report has no room still takes a
// request its pool holds (session 24): its Reserve waits for blocks to come
// free. Only a prompt no decoder's pool holds is refused.
TEST(Room, TheEstimateAloneNeverRefuses) {
  TwoByOne f;
  f.Report(f.d0, 30);
  auto a = f.Route();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_FALSE(a->room_by_report);
  EXPECT_EQ(f.Free(f.d0), 5);
  auto b = f.Route();  // 25 blocks: the estimate says 5 free, the report 30
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(b->room_by_report);
  EXPECT_EQ(b->decode, f.d0);
  EXPECT_NE(b->DebugString().find("room=report"), std::string::npos) << b->DebugString();
  EXPECT_EQ(f.router->counters().room_by_report, 1u);

  f.AdvanceMs(10);
  f.Report(f.d0, 12);  // it took both: full by its own report for a third
  auto c = f.Route();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->decode, f.d0);
  EXPECT_FALSE(c->room_by_report);
  EXPECT_TRUE(c->room_by_wait);
  EXPECT_NE(c->DebugString().find("room=wait"), std::string::npos) << c->DebugString();
  EXPECT_EQ(f.router->counters().room_by_wait, 1u);
  EXPECT_EQ(f.router->counters().room_by_report, 1u);
  // 600 blocks: more than the decoder's whole pool (512).
  auto huge = f.Route(nullptr, 600 * kBs);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find("the prompt needs up to 600 blocks; the most free on any "
                                         "decoder is 12 by its last load report"),
            std::string::npos)
      << huge.status().ToString();
  EXPECT_NE(huge.status().message().find("the largest decoder holds 512 in all"), std::string::npos)
      << huge.status().ToString();
  EXPECT_EQ(f.router->counters().room_by_wait, 1u);
}

}  // namespace
}  // namespace tandem::router
