// The Watch loop of WorkerService (worker/worker_service.h) through a
// WatchSink of the test's own: what each update carries, on the tiny
// golden model's engine stepped by the test (no network).
//
// Issue 23 (load piggyback): an update that carries KV events to a batched
// watcher carries the worker's load as sampled in that round, whatever the
// load interval, so a busy worker sends one update per batch of events
// instead of a batch and a separate report.
#include "worker/worker_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <vector>

#include "../engine/test_models.h"
#include "common/wire_ids.h"
#include "proxy/watch_batch.h"
#include "router/prefix_index.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::worker {
namespace {

namespace pb = ::tandem::v1;
using engine::testing::MakeEngine;
using engine::testing::Prompt;
using engine::testing::TinyModel;
using namespace std::chrono_literals;

class RecordingSink final : public WatchSink {
 public:
  bool open() const override { return true; }
  void Write(const pb::WorkerUpdate& update) override {
    std::lock_guard lock(mu_);
    updates_.push_back(update);
    cv_.notify_all();
  }
  void End(bool) override {}

  // Waits (20 s at most) until `pred(updates)` holds.
  template <class Pred>
  bool WaitFor(Pred pred) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return pred(updates_); });
  }
  std::vector<pb::WorkerUpdate> updates() {
    std::lock_guard lock(mu_);
    return updates_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<pb::WorkerUpdate> updates_;
};

class WorkerServiceWatchTest : public ::testing::Test {
 protected:
  // `interval`: the load sampling period; the keep-alive (default: as
  // long), so nothing but events, changes and the first report make an
  // update on its own.
  void Start(std::chrono::milliseconds interval, std::chrono::milliseconds keepalive = {}) {
    engine::EngineOptions o;
    o.num_blocks = 64;
    engine_ = MakeEngine(TinyModel(), o);
    ASSERT_NE(engine_, nullptr);
    WorkerIdentity id;
    id.name = "prefill-0";
    id.role = "prefill";
    id.epoch = engine_->events().epoch();
    service_ = std::make_unique<WorkerService>(
        id, *engine_,
        [this] {
          LoadSample s;
          s.queued_prefill_tokens = queued_.load();
          s.registered_requests = registered_.load();
          std::lock_guard lock(samples_mu_);
          ++samples_;
          samples_cv_.notify_all();
          return s;
        },
        nullptr, interval);
    service_->SetKeepalive("proxy", keepalive.count() > 0 ? keepalive : interval);
    service_->Start();
  }
  void TearDown() override {
    if (service_) service_->Stop();
  }
  // A request of `blocks` full blocks, run to its end: its stored events.
  void Run(const std::string& id, uint32_t blocks, uint32_t salt) {
    engine::GenerateRequest r;
    r.request_id = id;
    r.prompt_ids = Prompt(16 * blocks + 3, salt);
    r.sampling.max_tokens = 1;
    ASSERT_TRUE(engine_->Submit(std::move(r)).ok());
    engine_->RunUntilIdle();
  }
  static bool HasEvent(const std::vector<pb::WorkerUpdate>& us, uint64_t id) {
    for (const auto& u : us) {
      for (const auto& e : u.events()) {
        if (e.event_id() == id) return true;
      }
    }
    return false;
  }

  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<WorkerService> service_;
  // Until the loop has sampled the load `n` times in all.
  void WaitSamples(int n) {
    std::unique_lock lock(samples_mu_);
    ASSERT_TRUE(samples_cv_.wait_for(lock, 20s, [&] { return samples_ >= n; }));
  }
  int samples() {
    std::lock_guard lock(samples_mu_);
    return samples_;
  }

  std::atomic<uint32_t> queued_{0};
  std::atomic<uint32_t> registered_{0};
  std::mutex samples_mu_;
  std::condition_variable samples_cv_;
  int samples_ = 0;  // guarded by samples_mu_
};

// Waits for an update that carried a load report on a batch.
constexpr auto kAnyBatchedLoad = [](const auto& updates) {
  for (const auto& u : updates) {
    if (u.has_batched_load()) return true;
  }
  return false;
};

TEST_F(WorkerServiceWatchTest, EveryBatchOfEventsCarriesTheLoadOfItsRound) {
  // An hour between samples: only the piggyback can put a report on the
  // batches below.
  Start(std::chrono::hours(1));
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(service_->AddWatch(sink, /*batched=*/true));
  // The snapshot, then the first report (the stream's first load).
  ASSERT_TRUE(sink->WaitFor(kAnyBatchedLoad));
  ASSERT_TRUE(sink->updates().front().has_snapshot());
  EXPECT_EQ(sink->updates().back().batched_load().queued_prefill_tokens(), 0u);

  for (uint32_t i = 1; i <= 3; ++i) {
    queued_ = 100 * i;  // the load each batch's round samples
    Run("r" + std::to_string(i), i + 1, 40 + i);
    const uint64_t last = engine_->events().last_event_id();
    ASSERT_TRUE(sink->WaitFor([&](const auto& us) { return HasEvent(us, last); }));
    // Every update with events carries a report, and the one with this
    // request's last event says what the load was then.
    for (const auto& u : sink->updates()) {
      if (u.events_size() == 0) continue;
      EXPECT_TRUE(u.has_batched_load()) << "a batch of " << u.events_size() << " events without load";
      if (u.events(u.events_size() - 1).event_id() == last) {
        EXPECT_EQ(u.batched_load().queued_prefill_tokens(), 100 * i);
      }
    }
  }
  // Nothing came alone: each report was on a batch (or the stream's first).
  int alone = 0;
  for (const auto& u : sink->updates()) alone += u.events_size() == 0 && u.has_batched_load();
  EXPECT_EQ(alone, 1);
}

// A watcher that did not ask for batches gets each event and each report as
// an update of its own; the report of a round with events comes after them.
TEST_F(WorkerServiceWatchTest, AnUnbatchedWatcherGetsTheReportAfterTheEvents) {
  Start(std::chrono::hours(1));
  auto batched = std::make_shared<RecordingSink>();
  auto single = std::make_shared<RecordingSink>();
  ASSERT_TRUE(service_->AddWatch(batched, /*batched=*/true));
  ASSERT_TRUE(service_->AddWatch(single, /*batched=*/false));
  const auto first_load = [](const auto& us) {
    for (const auto& u : us) {
      if (u.has_load() || u.has_batched_load()) return true;
    }
    return false;
  };
  ASSERT_TRUE(batched->WaitFor(first_load));
  ASSERT_TRUE(single->WaitFor(first_load));
  queued_ = 42;
  Run("r", 2, 7);
  const uint64_t last = engine_->events().last_event_id();
  ASSERT_TRUE(single->WaitFor([&](const auto& us) {
    for (const auto& u : us) {
      if (u.has_load() && u.load().queued_prefill_tokens() == 42) return true;
    }
    return false;
  }));
  const auto us = single->updates();
  uint64_t seen_last_at = 0, load_at = 0;
  for (size_t i = 0; i < us.size(); ++i) {
    EXPECT_EQ(us[i].events_size(), 0);  // never a batch
    if (us[i].has_event() && us[i].event().event_id() == last) seen_last_at = i;
    if (us[i].has_load() && us[i].load().queued_prefill_tokens() == 42) load_at = i;
  }
  EXPECT_GT(seen_last_at, 0u);
  EXPECT_GT(load_at, seen_last_at);
}

// A change only in what the proxy does not route by (registered requests,
// reservations, waiting, leases, notices, usage ratio: docs/serving-workers.md)
// sends no update of its own; the next update carries it.
TEST_F(WorkerServiceWatchTest, AChangeTheRouterDoesNotReadWaitsForTheNextUpdate) {
  Start(std::chrono::milliseconds(5), std::chrono::hours(1));
  auto sink = std::make_shared<RecordingSink>();
  ASSERT_TRUE(service_->AddWatch(sink, /*batched=*/true));
  ASSERT_TRUE(sink->WaitFor(kAnyBatchedLoad));
  registered_ = 3;
  // Several samples see only that change...
  const int seen = samples();
  WaitSamples(seen + 3);
  // ...then one the router reads.
  queued_ = 64;
  ASSERT_TRUE(sink->WaitFor([](const auto& us) {
    for (const auto& u : us) {
      if (u.batched_load().queued_prefill_tokens() == 64) return true;
    }
    return false;
  }));
  const auto us = sink->updates();
  int loads = 0;
  for (const auto& u : us) {
    if (!u.has_batched_load()) continue;
    ++loads;
    if (u.batched_load().queued_prefill_tokens() == 0) {
      EXPECT_EQ(u.batched_load().registered_requests(), 0u) << "an update for registered_requests alone";
    } else {
      EXPECT_EQ(u.batched_load().registered_requests(), 3u);
    }
  }
  EXPECT_EQ(loads, 2);
}


// Session 8 (WatchRequest.fixed64_hashes): a watcher that asks for fixed64
// hashes gets every event's and snapshot's hashes there and none in
// block_hashes (an older watcher: the reverse), and what it receives,
// read by the proxy's conversion (proxy::KvEventViewFromProto), rebuilds
// the same prefix index as an older watcher's, batched or not; so does a
// late watcher's snapshot in either encoding.
TEST_F(WorkerServiceWatchTest, Fixed64HashesRebuildTheSameIndexAsVarints) {
  Start(std::chrono::hours(1));
  struct Watch {
    std::shared_ptr<RecordingSink> sink;
    bool fixed64;
  };
  std::vector<Watch> ws;
  for (const bool batched : {true, false}) {
    for (const bool fixed64 : {false, true}) {
      ws.push_back({std::make_shared<RecordingSink>(), fixed64});
      ASSERT_TRUE(service_->AddWatch(ws.back().sink, batched, fixed64));
    }
  }
  // 8 prompts of 10 full blocks on a 64-block engine: stores, then removals.
  for (uint32_t i = 0; i < 8; ++i) Run("r" + std::to_string(i), 10, 100 + i);
  const uint64_t last = engine_->events().last_event_id();
  const auto has_last = [&](const std::vector<pb::WorkerUpdate>& us) {
    for (const auto& u : us) {
      if (u.has_event() && u.event().event_id() == last) return true;
    }
    return HasEvent(us, last);
  };
  for (auto& w : ws) ASSERT_TRUE(w.sink->WaitFor(has_last));
  // Late watchers: a snapshot of what the events left.
  for (const bool fixed64 : {false, true}) {
    ws.push_back({std::make_shared<RecordingSink>(), fixed64});
    ASSERT_TRUE(service_->AddWatch(ws.back().sink, /*batched=*/true, fixed64));
  }
  for (size_t i = ws.size() - 2; i < ws.size(); ++i) {
    ASSERT_TRUE(ws[i].sink->WaitFor([](const auto& us) {
      return !us.empty() && us.front().has_snapshot();
    }));
  }

  const uint64_t epoch = engine_->events().epoch();
  std::set<uint64_t> all;  // every hash any update named
  int removed = 0;
  std::vector<std::unique_ptr<router::PrefixIndex>> indexes;
  for (const Watch& w : ws) {
    auto index = std::make_unique<router::PrefixIndex>();
    ASSERT_TRUE(index->AddWorker(3, epoch).ok());
    const auto apply = [&](const pb::KvEvent& e) {
      const auto& fixed =
          e.has_stored() ? e.stored().block_hashes_fixed64() : e.removed().block_hashes_fixed64();
      const auto& varint = e.has_stored() ? e.stored().block_hashes() : e.removed().block_hashes();
      EXPECT_EQ((w.fixed64 ? varint : fixed).size(), 0) << "hashes in the field not asked for";
      removed += e.has_removed();
      const router::KvEventView v = proxy::KvEventViewFromProto(e);
      all.insert(v.hashes.begin(), v.hashes.end());
      auto r = index->Apply(3, v);
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(*r, router::EventResult::kApplied);
    };
    for (const auto& u : w.sink->updates()) {
      if (u.has_snapshot()) {
        const auto& s = u.snapshot();
        EXPECT_EQ((w.fixed64 ? s.block_hashes() : s.block_hashes_fixed64()).size(), 0);
        const auto hashes = BlockHashesOf(u.snapshot());
        all.insert(hashes.begin(), hashes.end());
        ASSERT_TRUE(index->ApplySnapshot(3, u.epoch(), u.snapshot_event_id(), hashes).ok());
      }
      if (u.has_event()) apply(u.event());
      for (const auto& e : u.events()) apply(e);
    }
    indexes.push_back(std::move(index));
  }
  EXPECT_GT(removed, 0) << "no removal was exercised";
  ASSERT_GT(indexes[0]->size(), 0u);
  EXPECT_GT(all.size(), indexes[0]->size());  // some blocks came and went
  for (size_t i = 1; i < indexes.size(); ++i) {
    SCOPED_TRACE("watcher " + std::to_string(i));
    EXPECT_EQ(indexes[i]->size(), indexes[0]->size());
    EXPECT_EQ(indexes[i]->HeldBlocks(3), indexes[0]->HeldBlocks(3));
    for (uint64_t h : all) {
      ASSERT_EQ(indexes[i]->Holders(h).Test(3), indexes[0]->Holders(h).Test(3)) << h;
    }
  }
}

}  // namespace
}  // namespace tandem::worker
