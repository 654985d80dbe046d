// A routed request's predicted prefill load ends when the prefiller stores
// the prompt's last full block (its KV event), not only at the next load
// report: back-to-back questions on one document keep their prefiller.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <vector>

#include "router/router.h"

namespace tandem::router {
namespace {

std::vector<uint64_t> Chain(uint64_t first, uint64_t n) {
  std::vector<uint64_t> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = (first + i + 1) * 0x9E3779B97F4A7C15ull;
  return v;
}

struct TwoByTwo {
  std::shared_ptr<std::atomic<int64_t>> now = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  std::unique_ptr<Router> router;
  uint64_t event_id[2] = {0, 0};

  TwoByTwo() {
    RouterOptions o;
    o.clock = [c = now] { return c->load(); };
    router = Router::Create(RouterConfig{}, o).value();
    for (const char* n : {"p0", "p1"}) Add(n, WorkerRole::kPrefill);
    for (const char* n : {"d0", "d1"}) Add(n, WorkerRole::kDecode);
  }
  WorkerId Add(const char* name, WorkerRole role) {
    WorkerInfo info;
    info.name = name;
    info.role = role;
    info.epoch = 1;
    info.num_blocks = 10000;
    return router->AddWorker(info).value();
  }
  EventResult Store(WorkerId w, std::span<const uint64_t> hashes) {
    auto r = router->ApplyEvent(w, {KvEventKind::kStored, 1, ++event_id[w], 0, hashes});
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : EventResult::kDuplicate;
  }
};

TEST(PrefillCompletion, StoredLastBlockEndsThePrediction) {
  TwoByTwo s;
  const auto doc = Chain(0, 12);
  auto d = s.router->Route({doc, 12 * 16 + 5});
  ASSERT_TRUE(d.ok());
  const WorkerId p = d->prefill;
  EXPECT_EQ(s.router->load(p)->queued_prefill_tokens, 12 * 16 + 5);
  EXPECT_EQ(s.router->load(p)->running_requests, 1);
  // A stored event without the last block (an earlier chunk) changes nothing.
  s.Store(p, std::span(doc).first(8));
  EXPECT_EQ(s.router->load(p)->queued_prefill_tokens, 12 * 16 + 5);
  // The last chunk: the prefill is done.
  s.Store(p, std::span(doc).subspan(8));
  EXPECT_EQ(s.router->load(p)->queued_prefill_tokens, 0);
  EXPECT_EQ(s.router->load(p)->running_requests, 0);
  EXPECT_EQ(s.router->counters().prefills_completed, 1u);
  // The decoder's predicted blocks stay until its report.
  EXPECT_EQ(s.router->load(d->decode)->active_decode_blocks, 13);
}

TEST(PrefillCompletion, OneEventCompletesOnePrediction) {
  TwoByTwo s;
  const auto doc = Chain(100, 4);
  // Two identical prompts at once on the same prefiller (both miss).
  auto a = s.router->Route({doc, 70});
  ASSERT_TRUE(a.ok());
  auto b = s.router->Route({doc, 70});
  ASSERT_TRUE(b.ok());
  ASSERT_NE(a->prefill, b->prefill);  // the burst spreads
  // p of `a` stores the blocks: only a's prediction ends.
  s.Store(a->prefill, doc);
  EXPECT_EQ(s.router->load(a->prefill)->queued_prefill_tokens, 0);
  EXPECT_EQ(s.router->load(b->prefill)->queued_prefill_tokens, 70);
}

// Documents asked back to back, no load report in between: with each
// prefill's stored event arriving before the next request (as in a fleet
// with sequential clients), every question after the first goes to the
// prefiller holding its document.
TEST(PrefillCompletion, BackToBackQuestionsStayOnTheirDocument) {
  TwoByTwo s;
  constexpr uint32_t kDocs = 5, kQuestions = 3, kDocBlocks = 12;
  std::vector<WorkerId> home(kDocs, kNoWorker);
  uint32_t hits = 0;
  for (uint32_t q = 0; q < kQuestions; ++q) {
    for (uint32_t doc = 0; doc < kDocs; ++doc) {
      auto hashes = Chain(doc * 1000, kDocBlocks);
      hashes.push_back(doc * 1000 + 500 + q);  // the question's own (last) full block
      auto d = s.router->Route({hashes, (kDocBlocks + 1) * 16 + 3});
      ASSERT_TRUE(d.ok());
      if (q == 0) {
        home[doc] = d->prefill;
      } else {
        EXPECT_EQ(d->prefill, home[doc]) << "doc " << doc << " question " << q << ": "
                                         << d->DebugString();
        hits += d->prefill_overlap_blocks;
      }
      // The prefiller commits what it computed: the uncached blocks.
      s.Store(d->prefill, std::span(hashes).subspan(d->prefill_overlap_blocks));
      s.now->fetch_add(1'000'000);  // 1 ms later, well inside the report interval
    }
  }
  EXPECT_EQ(hits, kDocs * (kQuestions - 1) * kDocBlocks);
}

}  // namespace
}  // namespace tandem::router
