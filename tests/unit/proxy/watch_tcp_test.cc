// The Watch stream over framed TCP (issue 23; worker/watch_tcp.h and
// proxy/watch_tcp_client.h) between a real WorkerService (the tiny golden
// model's engine, stepped by the test) and the proxy's client, over mutual
// TLS on 127.0.0.1: the snapshot first, then the engine's KV events in id
// order and load reports; the worker leaving ends the watch gracefully; a
// listener that goes away ends it broken; the proxy closing it runs the
// worker's cancel hook; a client without a certificate of the fleet CA is
// refused and gets nothing. The whole path with real fleets is the
// registry, router, failure and security suites (TANDEM_TEST_WATCH_TRANSPORT).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "../engine/test_models.h"
#include "../frame_test_support.h"
#include "proxy/watch_tcp_client.h"
#include "tandem/v1/worker.pb.h"
#include "worker/watch_tcp.h"
#include "worker/worker_service.h"

namespace tandem {
namespace {

namespace pb = ::tandem::v1;
using engine::testing::MakeEngine;
using engine::testing::Prompt;
using engine::testing::TinyModel;
using frame_testing::Identity;
using frame_testing::Tls;


// What the proxy's side saw.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<pb::WorkerUpdate> updates;
  bool ended = false;
  bool graceful = false;
  Status why = Status::Ok();

  proxy::WatchTcpClient::Callbacks Callbacks() {
    return {[this](const pb::WorkerUpdate& u) {
              std::lock_guard lock(mu);
              updates.push_back(u);
              cv.notify_all();
            },
            [this](bool g, const Status& w) {
              std::lock_guard lock(mu);
              ended = true;
              graceful = g;
              why = w;
              cv.notify_all();
            }};
  }
  template <class Pred>
  bool WaitFor(Pred p) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20), p);
  }
  // Every stored hash received in events so far, and whether their ids
  // were consecutive from `after`.
  std::vector<uint64_t> Stored(uint64_t after, bool* consecutive) {
    std::vector<uint64_t> out;
    uint64_t next = after + 1;
    *consecutive = true;
    for (const auto& u : updates) {
      for (const auto& e : u.events()) {
        *consecutive &= e.event_id() == next++;
        if (e.has_stored()) {
          out.insert(out.end(), e.stored().block_hashes().begin(), e.stored().block_hashes().end());
        }
      }
    }
    return out;
  }
};

pb::WatchRequest Batched() {
  pb::WatchRequest r;
  r.set_batched(true);
  return r;
}

class WatchTcpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // (MakeCa also ignores SIGPIPE, as every tandem process does.)
    ca_ = frame_testing::MakeCa("fleet-ca");
    ASSERT_FALSE(HasFailure());
    engine::EngineOptions o;
    o.num_blocks = 64;
    engine_ = MakeEngine(TinyModel(), o);
    ASSERT_NE(engine_, nullptr);
    worker::WorkerIdentity id;
    id.name = "prefill-0";
    id.role = "prefill";
    id.epoch = engine_->events().epoch();
    service_ = std::make_unique<worker::WorkerService>(
        id, *engine_,
        [this] {
          worker::LoadSample s;
          s.free_blocks = engine_->stats().free_blocks;
          return s;
        },
        nullptr, std::chrono::milliseconds(20));
    service_->SetOnWatchCancelled([this] {
      cancels_.fetch_add(1);
      std::lock_guard lock(mu_);
      cv_.notify_all();
    });
    worker::WatchTcpOptions wo;
    wo.address = "127.0.0.1:0";
    wo.tls = Tls(Identity(ca_, "prefill-0"));
    wo.on_connection = [this] { connections_.fetch_add(1); };
    auto server = worker::ServeWatchTcp(*service_, std::move(wo));
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    service_->Start();
  }
  void TearDown() override {
    if (service_) service_->Stop();
    if (server_) server_->Stop();
  }
  bool WaitCancels(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(20), [&] { return cancels_.load() >= n; });
  }

  CertKeyPem ca_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<worker::WorkerService> service_;
  std::unique_ptr<FrameServer> server_;
  std::atomic<int> connections_{0};
  std::atomic<int> cancels_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

TEST_F(WatchTcpTest, SnapshotThenEventsInOrderThenAGracefulEnd) {
  // A block cached before the watch starts is in its snapshot.
  engine::GenerateRequest first;
  first.request_id = "before";
  first.prompt_ids = Prompt(20, 1);
  first.sampling.max_tokens = 1;
  ASSERT_TRUE(engine_->Submit(std::move(first)).ok());
  engine_->RunUntilIdle();

  Seen seen;
  auto client = proxy::WatchTcpClient::Create(server_->address(), Tls(Identity(ca_, "proxy")),
                                              Batched());
  client->Start(seen.Callbacks());
  ASSERT_TRUE(seen.WaitFor([&] { return !seen.updates.empty() || seen.ended; }));
  uint64_t snapshot_id = 0;
  {
    std::lock_guard lock(seen.mu);
    ASSERT_FALSE(seen.ended) << seen.why.ToString();
    const pb::WorkerUpdate& s = seen.updates.front();
    ASSERT_TRUE(s.has_snapshot());
    EXPECT_EQ(s.epoch(), engine_->events().epoch());
    EXPECT_EQ(s.snapshot().block_hashes_size(), 1);
    snapshot_id = s.snapshot_event_id();
    EXPECT_EQ(snapshot_id, engine_->events().last_event_id());
  }
  EXPECT_EQ(connections_.load(), 1);

  // Three requests of 2-4 blocks each: their stored events arrive in id
  // order, every hash once.
  for (uint32_t i = 0; i < 3; ++i) {
    engine::GenerateRequest r;
    r.request_id = "r" + std::to_string(i);
    r.prompt_ids = Prompt(40 + 16 * i, 10 + i);
    r.sampling.max_tokens = 1;
    ASSERT_TRUE(engine_->Submit(std::move(r)).ok());
    engine_->RunUntilIdle();
  }
  const uint64_t last = engine_->events().last_event_id();
  ASSERT_GT(last, snapshot_id);
  ASSERT_TRUE(seen.WaitFor([&] {
    for (const auto& u : seen.updates) {
      for (const auto& e : u.events()) {
        if (e.event_id() == last) return true;
      }
    }
    return false;
  }));
  {
    std::lock_guard lock(seen.mu);
    bool consecutive = false;
    const auto stored = seen.Stored(snapshot_id, &consecutive);
    EXPECT_TRUE(consecutive);
    EXPECT_EQ(stored.size(), 2u + 3u + 4u);
    // A load report came with the updates (its first at the first sample).
    bool load = false;
    for (const auto& u : seen.updates) load |= u.has_batched_load();
    EXPECT_TRUE(load);
  }

  // The worker leaves: the watch ends gracefully and the worker's cancel
  // hook does not run (nobody cancelled it).
  service_->Leave();
  ASSERT_TRUE(seen.WaitFor([&] { return seen.ended; }));
  EXPECT_TRUE(seen.graceful) << seen.why.ToString();
  EXPECT_EQ(cancels_.load(), 0);
  // A new watch is refused once the worker has left: it ends, not gracefully.
  Seen late;
  auto again = proxy::WatchTcpClient::Create(server_->address(), Tls(Identity(ca_, "proxy")),
                                             Batched());
  again->Start(late.Callbacks());
  ASSERT_TRUE(late.WaitFor([&] { return late.ended; }));
  EXPECT_FALSE(late.graceful);
  EXPECT_TRUE(late.updates.empty());
}

TEST_F(WatchTcpTest, TheProxyClosingItRunsTheCancelHookAndABrokenListenerEndsIt) {
  Seen seen;
  auto client = proxy::WatchTcpClient::Create(server_->address(), Tls(Identity(ca_, "proxy")),
                                              Batched());
  client->Start(seen.Callbacks());
  ASSERT_TRUE(seen.WaitFor([&] { return !seen.updates.empty(); }));
  client->Stop(CancelledError("replaced by a new registration"));
  ASSERT_TRUE(seen.WaitFor([&] { return seen.ended; }));
  EXPECT_FALSE(seen.graceful);
  // The worker notices and registers again (ProxyRegistrar::Kick).
  EXPECT_TRUE(WaitCancels(1));

  // The worker's listener goes away under an open watch: broken, not graceful.
  Seen second;
  auto other = proxy::WatchTcpClient::Create(server_->address(), Tls(Identity(ca_, "proxy")),
                                             Batched());
  other->Start(second.Callbacks());
  ASSERT_TRUE(second.WaitFor([&] { return !second.updates.empty(); }));
  server_->Stop();
  ASSERT_TRUE(second.WaitFor([&] { return second.ended; }));
  EXPECT_FALSE(second.graceful);
  EXPECT_NE(second.why.message().find("watch connection to"), std::string::npos)
      << second.why.ToString();
}

TEST_F(WatchTcpTest, AClientWithoutAFleetCertificateIsRefused) {
  const TlsPem stranger = frame_testing::Stranger(ca_, "stranger");  // it trusts the fleet's worker
  for (const std::shared_ptr<FrameTls>& tls : {Tls(stranger), std::shared_ptr<FrameTls>()}) {
    Seen seen;
    auto client = proxy::WatchTcpClient::Create(server_->address(), tls, Batched());
    client->Start(seen.Callbacks());
    ASSERT_TRUE(seen.WaitFor([&] { return seen.ended; }));
    EXPECT_FALSE(seen.graceful);
    EXPECT_TRUE(seen.updates.empty());
  }
  EXPECT_TRUE(server_->WaitForRefused(2, std::chrono::seconds(20)));
  EXPECT_EQ(server_->accepted(), 0u);
  EXPECT_EQ(connections_.load(), 0);
  EXPECT_EQ(cancels_.load(), 0);
}

// The Watch reader's parser (issue 23, session 9): updates parsed on its
// arena read back exactly what was sent, frame after frame, including one
// larger than the arena's first block (a snapshot) and a smaller one after
// it; a payload that is not a WorkerUpdate gives nullptr.
TEST(WorkerUpdateParserTest, ParsesFrameAfterFrameOnItsArena) {
  const auto batch = [](uint64_t first_id, int events, int hashes) {
    pb::WorkerUpdate u;
    u.set_epoch(7);
    for (int e = 0; e < events; ++e) {
      auto* ev = u.add_events();
      ev->set_epoch(7);
      ev->set_event_id(first_id + static_cast<uint64_t>(e));
      auto* hs = e % 2 == 0 ? ev->mutable_stored()->mutable_block_hashes_fixed64()
                            : ev->mutable_removed()->mutable_block_hashes_fixed64();
      for (int i = 0; i < hashes; ++i) hs->Add(first_id * 1'000'003u + static_cast<uint64_t>(e * hashes + i));
    }
    u.mutable_batched_load()->set_free_blocks(static_cast<uint32_t>(first_id));
    return u;
  };
  pb::WorkerUpdate snapshot;
  snapshot.set_epoch(7);
  snapshot.set_snapshot_event_id(41);
  for (uint64_t i = 0; i < 20'000; ++i) snapshot.mutable_snapshot()->add_block_hashes_fixed64(i * 77 + 1);
  ASSERT_GT(snapshot.ByteSizeLong(), proxy::WorkerUpdateParser::kBlockBytes);

  proxy::WorkerUpdateParser parser;
  for (const pb::WorkerUpdate& sent : {batch(1, 4, 500), snapshot, batch(42, 1, 3), batch(43, 8, 125)}) {
    const std::string wire = sent.SerializeAsString();
    const pb::WorkerUpdate* got = parser.Parse(wire);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->SerializeAsString(), wire);
    EXPECT_EQ(got->events_size(), sent.events_size());
  }
  EXPECT_EQ(parser.Parse(std::string_view("\xff\xff\xff", 3)), nullptr);
  // Still usable after a bad frame.
  const std::string wire = batch(51, 2, 10).SerializeAsString();
  const pb::WorkerUpdate* got = parser.Parse(wire);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->events(1).event_id(), 52u);
  EXPECT_EQ(got->events(1).removed().block_hashes_fixed64(9), 51u * 1'000'003u + 19u);
}

}  // namespace
}  // namespace tandem
