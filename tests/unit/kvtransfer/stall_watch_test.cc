// TransportBase's stall watch (docs/kvtransfer.md, "Peer loss"): a peer with
// backend operations outstanding and none of them completed for
// peer_timeout_s is declared lost; a slow peer that keeps completing, and an
// idle one, are not. A scripted backend whose operations complete only when
// the test says so, and whose stall clock the test moves, makes every case
// deterministic (no sleeps: each step waits for a progress round).
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>

#include "kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transport_base.h"

namespace tandem::kvtransfer {
namespace {

using detail::Phase;
using detail::Xfer;
using testing::WaitFor;
using namespace std::chrono_literals;

constexpr uint64_t kBlockBytes = 64;
constexpr uint32_t kBlocks = 4;

// Each write is `ops_per_write` backend operations, at most 2 outstanding at
// a time; they complete when the test calls Complete.
class ScriptedTransport final : public detail::TransportBase {
 public:
  ScriptedTransport(const TransportOptions& o, int ops_per_write)
      : TransportBase(o), ops_per_write_(ops_per_write), pool_(o.block_bytes * o.num_blocks) {
    set_pool(pool_.data());
    StartProgressThread();
  }
  ~ScriptedTransport() override { Shutdown(); }

  Capabilities capabilities() const override {
    Capabilities c;
    c.backend = "scripted";
    c.max_notification_bytes = 1024;
    return c;
  }
  std::string LocalDescriptor() const override { return Descriptor(agent_name()); }
  static std::string Descriptor(const std::string& agent) {
    return SerializeDescriptor({"scripted", agent, 1, kBlockBytes, kBlocks, 0, "", ""});
  }

  // Moves the stall watch's clock.
  void Tick(std::chrono::milliseconds d) { offset_ns_ += std::chrono::nanoseconds(d).count(); }
  // Lets `d` pass on the stall clock in steps of 100 ms (the watch's check
  // period here), one progress round each.
  void Pass(std::chrono::milliseconds d) {
    for (auto left = d; left.count() > 0; left -= 100ms) {
      Tick(std::min(left, std::chrono::milliseconds(100)));
      Round();
    }
  }
  // Completes up to `n` outstanding operations to `peer`, then waits for a
  // full progress round after it (so the watch has looked).
  void Complete(PeerId peer, int n) {
    ASSERT_TRUE(RunOnProgressThread([this, peer, n] {
                  int left = n;
                  for (Xfer* x : open_) {
                    while (left > 0 && x->peer == peer && x->outstanding > 0) {
                      x->OpCompleted();
                      --left;
                    }
                  }
                  return Status::Ok();
                }).ok());
    Round();
  }
  // Returns after the progress loop went once round (commands run at the
  // top of an iteration: the second one runs after the first's whole pass).
  void Round() {
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(RunOnProgressThread([] { return Status::Ok(); }).ok());
  }
  int abandoned() const { return abandoned_.load(); }

 protected:
  Result<std::unique_ptr<detail::PeerState>> ConnectPeer(PeerId, const PeerDescriptor&) override {
    return std::make_unique<detail::PeerState>();
  }
  void DisconnectPeer(detail::PeerState&) override {}
  void Advance(Xfer& x, detail::PeerEntry&) override {
    if (x.phase != Phase::kPut) return;
    if (issued_[x.id] == 0) open_.push_back(&x);
    if (x.abort.load()) {  // issue nothing more; ends once nothing is outstanding
      if (x.outstanding == 0) {
        std::erase(open_, &x);
        Finish(x, XferStatus::kErrCanceled, CancelledError("aborted"));
      }
      return;
    }
    while (x.outstanding < 2 && issued_[x.id] < ops_per_write_) {
      ++x.outstanding;
      ++issued_[x.id];
    }
    if (issued_[x.id] == ops_per_write_ && x.outstanding == 0) {
      std::erase(open_, &x);
      Finish(x, XferStatus::kSuccess, Status::Ok());
    }
  }
  // The peer's operations end (as UCX's forced close ends them).
  void AbandonPeer(detail::PeerState&) override {
    ++abandoned_;
    for (Xfer* x : open_) {
      while (x->finished && x->outstanding > 0) x->OpCompleted();
    }
    std::erase_if(open_, [](Xfer* x) { return x->finished; });
  }
  bool ProgressOnce() override { return false; }
  void WaitForEvents(int timeout_ms) override {
    std::unique_lock lock(wake_mu_);
    wake_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms < 0 ? 1000 : timeout_ms),
                      [&] { return woken_; });
    woken_ = false;
  }
  void Wake() override {
    {
      std::lock_guard lock(wake_mu_);
      woken_ = true;
    }
    wake_cv_.notify_one();
  }
  Result<std::string> DescribePeerTransports(detail::PeerState&) override {
    return std::string("scripted");
  }
  std::chrono::steady_clock::time_point StallClock() const override {
    return start_ + std::chrono::nanoseconds(offset_ns_.load());
  }

 private:
  const int ops_per_write_;
  std::vector<std::byte> pool_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> offset_ns_{0};
  std::map<XferId, int> issued_;  // [progress]
  std::vector<Xfer*> open_;       // [progress] transfers with operations issued
  std::atomic<int> abandoned_{0};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
};

struct Fixture {
  explicit Fixture(int ops_per_write) {
    TransportOptions o;
    o.agent_name = "writer";
    o.block_bytes = kBlockBytes;
    o.num_blocks = kBlocks;
    o.peer_timeout_s = 3.0;
    t = std::make_unique<ScriptedTransport>(o, ops_per_write);
    t->SetPeerFailureCallback([this](const std::string& agent, uint64_t, const Status& why) {
      std::lock_guard lock(mu);
      lost.emplace_back(agent, why);
    });
  }
  ~Fixture() { t->SetPeerFailureCallback({}); }
  PeerId Import(const std::string& agent) {
    auto p = t->ImportPeer(ScriptedTransport::Descriptor(agent));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.value_or(0);
  }
  XferId Post(PeerId peer) {
    auto x = t->PrepareWrite(peer, {{0, 0, kBlockBytes}}, std::nullopt);
    EXPECT_TRUE(x.ok()) << x.status().ToString();
    EXPECT_TRUE(t->Post(*x, {}).ok());
    t->Round();  // issued, and seen by the watch at this clock
    return *x;
  }
  size_t lost_count() {
    std::lock_guard lock(mu);
    return lost.size();
  }

  std::unique_ptr<ScriptedTransport> t;
  std::mutex mu;
  std::vector<std::pair<std::string, Status>> lost;
};

TEST(StallWatch, NoCompletionForTheBoundDeclaresThePeerLostAndEndsItsWrites) {
  Fixture f(4);
  const PeerId peer = f.Import("decode-0");
  const XferId x = f.Post(peer);
  f.t->Pass(2900ms);
  EXPECT_EQ(f.t->Poll(x, nullptr), XferStatus::kInProgress) << "failed before the bound";
  f.t->Pass(200ms);
  Status detail;
  ASSERT_EQ(f.t->Poll(x, &detail), XferStatus::kErrRemoteDisconnect) << detail.ToString();
  EXPECT_EQ(detail.code(), StatusCode::kUnavailable);
  for (const char* part : {"decode-0", "2 operation(s) outstanding", "peer_timeout_s = 3 s"}) {
    EXPECT_NE(detail.message().find(part), std::string::npos) << part << ": " << detail.ToString();
  }
  ASSERT_EQ(f.lost_count(), 1u);
  EXPECT_EQ(f.lost[0].first, "decode-0");
  EXPECT_EQ(f.t->abandoned(), 1);
  EXPECT_EQ(f.t->PrepareWrite(peer, {{0, 0, kBlockBytes}}, std::nullopt).status().code(),
            StatusCode::kUnavailable);
  EXPECT_TRUE(f.t->Release(x).ok());
  EXPECT_TRUE(WaitFor([&] { return f.t->stats().live_requests == 0; }));
  EXPECT_EQ(f.t->stats().inflight_requests, 0u);
}

// 40 operations, one completing every 2 s of the stall clock: 80 s in all,
// far past the 3 s bound, and each operation waits ~4 s (two are
// outstanding), but there is never 3 s without a completion. ("An operation
// older than the bound" would have killed it; "no completion for the bound"
// does not.)
TEST(StallWatch, SlowPeerThatKeepsCompletingIsNotFailed) {
  Fixture f(40);
  const PeerId peer = f.Import("decode-0");
  const XferId x = f.Post(peer);
  for (int i = 0; i < 40 && f.t->Poll(x, nullptr) == XferStatus::kInProgress; ++i) {
    f.t->Pass(2000ms);
    f.t->Complete(peer, 1);
  }
  Status detail;
  EXPECT_EQ(f.t->Poll(x, &detail), XferStatus::kSuccess) << detail.ToString();
  EXPECT_EQ(f.lost_count(), 0u);
  EXPECT_EQ(f.t->abandoned(), 0);
}

// The bound is per peer: one peer's completions do not keep another alive,
// and a peer with nothing outstanding (idle, or between writes) is not
// watched at all, however long.
TEST(StallWatch, ThePeerThatStallsIsFailedAloneAndIdlePeersAreNotWatched) {
  Fixture f(1000);
  const PeerId busy = f.Import("decode-busy");
  const PeerId stalled = f.Import("decode-stalled");
  const PeerId idle = f.Import("decode-idle");
  f.t->Tick(60s);  // idle peers only: nothing is watched
  f.t->Round();
  EXPECT_EQ(f.lost_count(), 0u);
  const XferId xb = f.Post(busy);
  const XferId xs = f.Post(stalled);
  for (int i = 0; i < 4; ++i) {
    f.t->Pass(1000ms);
    f.t->Complete(busy, 1);
  }
  EXPECT_EQ(f.t->Poll(xb, nullptr), XferStatus::kInProgress);
  EXPECT_EQ(f.t->Poll(xs, nullptr), XferStatus::kErrRemoteDisconnect);
  ASSERT_EQ(f.lost_count(), 1u);
  EXPECT_EQ(f.lost[0].first, "decode-stalled");
  // The idle peer still takes writes.
  EXPECT_TRUE(f.t->PrepareWrite(idle, {{0, 0, kBlockBytes}}, std::nullopt).ok());
  EXPECT_TRUE(f.t->Abort(xb).ok());
  f.t->Complete(busy, 2);
  EXPECT_TRUE(WaitFor([&] { return f.t->Poll(xb, nullptr) == XferStatus::kErrCanceled; }));
  EXPECT_EQ(f.lost_count(), 1u);
}

// A stall clock jump between two checks (this process was stopped, e.g.
// SIGSTOP, or its progress thread starved) is this side's silence, not the
// peer's: the wait restarts, and the peer is failed only after a full bound
// of checks without a completion.
TEST(StallWatch, TimeThisThreadDidNotRunIsNotHeldAgainstThePeer) {
  Fixture f(4);
  const PeerId peer = f.Import("decode-0");
  const XferId x = f.Post(peer);
  f.t->Tick(10s);
  f.t->Round();
  EXPECT_EQ(f.t->Poll(x, nullptr), XferStatus::kInProgress);
  f.t->Pass(2900ms);
  EXPECT_EQ(f.t->Poll(x, nullptr), XferStatus::kInProgress);
  f.t->Pass(200ms);
  EXPECT_EQ(f.t->Poll(x, nullptr), XferStatus::kErrRemoteDisconnect);
  EXPECT_EQ(f.lost_count(), 1u);
}

}  // namespace
}  // namespace tandem::kvtransfer
