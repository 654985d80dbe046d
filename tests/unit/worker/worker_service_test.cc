// The Watch loop of WorkerService (worker/worker_service.h) through a
// WatchSink of the test's own: what each update carries, on the tiny
// golden model's engine stepped by the test (no network).
//
// Issue 23 (load piggyback): an update that carries KV events to a batched
// watcher carries the worker's load as sampled in that round, whatever the
// load interval, so a busy worker sends one update per batch of events
// instead of a batch and a separate report.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "../engine/test_models.h"
#include "tandem/v1/worker.pb.h"
#include "worker/worker_service.h"

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

}  // namespace
}  // namespace tandem::worker
