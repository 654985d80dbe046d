// The conformance suite every Transport backend passes (TEST_P over
// "loopback", "ucx" — whatever transports UCX picks here, shared memory on
// one host — and "ucx_tcp", UCX restricted to TCP with UCX_TLS=tcp).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>

#include "../captured_log.h"
#include "kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using testing::Checksum;
using testing::ChildProcess;
using testing::FillRandom;
using testing::WaitFor;
using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1ull << 20;

class ConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "ucx_tcp") setenv("UCX_TLS", "tcp", 1);
  }
  void TearDown() override {
    if (GetParam() == "ucx_tcp") unsetenv("UCX_TLS");
  }
  std::string backend() const { return GetParam() == "loopback" ? "loopback" : "ucx"; }

  std::unique_ptr<Transport> Make(const std::string& name, uint64_t block_bytes, uint32_t blocks,
                                  uint64_t max_put_bytes = 4 * kMiB, uint32_t delay_us = 0,
                                  KvFaultOptions fault = {}) {
    TransportOptions o;
    o.fault = fault;
    o.backend = backend();
    o.agent_name = name + "-" + GetParam();
    o.block_bytes = block_bytes;
    o.num_blocks = blocks;
    o.max_put_bytes = max_put_bytes;
    o.loopback_delay_per_put_us = delay_us;
    o.peer_timeout_s = 1.5;
    auto t = CreateTransport(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  static XferStatus WaitDone(Transport& t, XferId x, std::chrono::milliseconds timeout = 30s) {
    WaitFor([&] { return IsTerminal(t.Poll(x)); }, timeout);
    return t.Poll(x);
  }

  // The descriptor a started kvtransfer_peer target prints.
  static Result<std::string> PeerDescriptor(ChildProcess& child) {
    auto hex = child.Expect("DESC ");
    if (!hex.has_value()) return UnavailableError("the peer did not start");
    return FromHex(*hex);
  }

  // Writes `segments` with an optional notice and waits for the outcome.
  static XferStatus WriteAndWait(Transport& t, PeerId peer, std::vector<Segment> segments,
                                 std::optional<std::string> notice = std::nullopt) {
    auto x = t.PrepareWrite(peer, std::move(segments), std::move(notice));
    EXPECT_TRUE(x.ok()) << x.status().ToString();
    if (!x.ok()) return XferStatus::kErrInvalidArgument;
    EXPECT_TRUE(t.Post(*x).ok());
    const XferStatus st = WaitDone(t, *x);
    Status detail;
    t.Poll(*x, &detail);
    EXPECT_EQ(st, XferStatus::kSuccess) << detail.ToString();
    EXPECT_TRUE(t.Release(*x).ok());
    return st;
  }
};

TEST_P(ConformanceTest, CapabilitiesNameTheBackend) {
  auto a = Make("caps", 4096, 4);
  ASSERT_NE(a, nullptr);
  const Capabilities c = a->capabilities();
  EXPECT_EQ(c.backend, backend());
  EXPECT_TRUE(c.one_sided_write && c.notifications && c.abort && c.peer_failure_detection);
  EXPECT_GE(c.max_notification_bytes, 256u);
  EXPECT_EQ(c.cross_process, backend() == "ucx");
  ASSERT_NE(a->pool(), nullptr);
  EXPECT_EQ(a->pool_bytes(), 4 * 4096u);
}

// Checksums over random data, sizes from 1 byte to 64 MiB, unaligned offsets
// on both sides, and untouched bytes right outside each destination.
TEST_P(ConformanceTest, DataIntegrityAcrossSizes) {
  const uint64_t pool = 66 * kMiB;
  auto a = Make("integ-a", kMiB, 66);
  auto b = Make("integ-b", kMiB, 66);
  ASSERT_TRUE(a && b);
  FillRandom(a->pool(), pool, 42);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  const std::vector<uint64_t> sizes = {
      1,        2,    3,     7,        63,       64,           1000,
      4095,     4097, 65537, kMiB - 1, kMiB + 3, 4 * kMiB + 1, 17 * kMiB - 5,
      64 * kMiB};
  uint64_t expect_written = a->stats().bytes_written;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t n = sizes[i];
    const uint64_t lo = 1 + 7 * i, ro = 3 + 13 * i;
    std::byte* dst = b->pool() + ro;
    dst[-1] = std::byte{0xAB};
    dst[n] = std::byte{0xCD};
    ASSERT_EQ(WriteAndWait(*a, *peer, {{lo, ro, n}}), XferStatus::kSuccess) << "size " << n;
    EXPECT_EQ(Checksum(dst, n), Checksum(a->pool() + lo, n)) << "size " << n;
    EXPECT_EQ(dst[-1], std::byte{0xAB}) << "byte before the destination was written, size " << n;
    EXPECT_EQ(dst[n], std::byte{0xCD}) << "byte after the destination was written, size " << n;
    expect_written += n;
  }
  EXPECT_EQ(a->stats().bytes_written, expect_written);
}

TEST_P(ConformanceTest, BlockWritesCoalesceContiguousRuns) {
  const uint64_t bb = 1024;
  auto a = Make("blocks-a", bb, 16);
  auto b = Make("blocks-b", bb, 16);
  ASSERT_TRUE(a && b);
  FillRandom(a->pool(), a->pool_bytes(), 7);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  // Runs: 0-2 -> 5-7, 9 -> 1, 4 -> 3 (local 3 would continue 0-2, remote 8 does not follow 3).
  const std::vector<BlockPair> pairs = {{0, 5}, {1, 6}, {2, 7}, {9, 1}, {4, 3}};
  const uint64_t puts_before = a->stats().puts_posted;
  auto x = a->PrepareBlockWrite(*peer, pairs, "blocks");
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  ASSERT_TRUE(a->Post(*x).ok());
  ASSERT_EQ(WaitDone(*a, *x), XferStatus::kSuccess);
  EXPECT_EQ(a->stats().puts_posted - puts_before, 3u);
  for (const BlockPair& p : pairs) {
    EXPECT_EQ(Checksum(b->block(p.remote_slot), bb), Checksum(a->block(p.local_block), bb))
        << p.local_block << " -> " << p.remote_slot;
  }
  // Out-of-range slots are refused before anything moves.
  const std::vector<BlockPair> bad = {{0, 16}};
  EXPECT_EQ(a->PrepareBlockWrite(*peer, bad, std::nullopt).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(a->Release(*x).ok());
}

// The receiver checks, inside its notification callback, that the data the
// notice describes is already in its pool.
TEST_P(ConformanceTest, NotificationArrivesAfterItsData) {
  const uint64_t bb = kMiB;
  constexpr int kRounds = 40;
  auto a = Make("order-a", bb, 4);
  auto b = Make("order-b", bb, 4);
  ASSERT_TRUE(a && b);
  std::mutex mu;
  int received = 0, mismatched = 0;
  b->SetNotificationCallback([&](Notification n) {
    const uint64_t want = std::stoull(n.payload);
    const bool ok = Checksum(b->pool(), 4 * bb) == want;
    std::lock_guard lock(mu);
    ++received;
    mismatched += ok ? 0 : 1;
    EXPECT_EQ(n.sender, a->agent_name());
    EXPECT_EQ(n.sender_generation, a->generation());
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  for (int r = 0; r < kRounds; ++r) {
    FillRandom(a->pool(), 4 * bb, 100 + r);
    const uint64_t sum = Checksum(a->pool(), 4 * bb);
    ASSERT_EQ(WriteAndWait(*a, *peer, {{0, 0, 4 * bb}}, std::to_string(sum)), XferStatus::kSuccess);
    // The next round overwrites the same bytes: wait for this notice first.
    ASSERT_TRUE(WaitFor([&] {
      std::lock_guard l(mu);
      return received == r + 1;
    })) << "round "
        << r;
  }
  std::lock_guard lock(mu);
  EXPECT_EQ(received, kRounds);
  EXPECT_EQ(mismatched, 0);
  EXPECT_EQ(b->stats().notifications_received, static_cast<uint64_t>(kRounds));
}

// A KV notice carries a checksum (and with transport.encrypt a tag) for
// every pushed block: a 128k-token prompt's is over 64 KiB. One as large as
// the backend allows arrives whole, after its data.
TEST_P(ConformanceTest, ANoticeAsLargeAsTheLimitArrivesWhole) {
  auto a = Make("bignotice-a", 4096, 4);
  auto b = Make("bignotice-b", 4096, 4);
  ASSERT_TRUE(a && b);
  const uint64_t limit = a->capabilities().max_notification_bytes;
  EXPECT_GE(limit, kTransportNoticeBytes);
  std::string notice(limit, '\0');
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (char& c : notice) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<char>(x);
  }
  std::mutex mu;
  std::optional<std::string> got;
  b->SetNotificationCallback([&](Notification n) {
    std::lock_guard lock(mu);
    got = std::move(n.payload);
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  FillRandom(a->pool(), 4096, 7);
  ASSERT_EQ(WriteAndWait(*a, *peer, {{0, 0, 4096}}, notice), XferStatus::kSuccess);
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return got.has_value();
  }));
  std::lock_guard lock(mu);
  EXPECT_EQ(got->size(), notice.size());
  EXPECT_TRUE(*got == notice);
  EXPECT_EQ(Checksum(b->pool(), 4096), Checksum(a->pool(), 4096));
}

TEST_P(ConformanceTest, ThousandConcurrentRequests) {
  constexpr uint32_t kRequests = 1000;
  const uint64_t bb = 4096;
  auto a = Make("many-a", bb, kRequests);
  auto b = Make("many-b", bb, kRequests);
  ASSERT_TRUE(a && b);
  FillRandom(a->pool(), a->pool_bytes(), 9);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  std::vector<uint32_t> slot(kRequests);
  std::iota(slot.begin(), slot.end(), 0u);
  std::shuffle(slot.begin(), slot.end(), std::mt19937(3));
  std::atomic<int> done{0}, succeeded{0};
  std::vector<XferId> ids;
  for (uint32_t i = 0; i < kRequests; ++i) {
    const BlockPair pair{i, slot[i]};
    auto x = a->PrepareBlockWrite(*peer, std::span(&pair, 1), std::to_string(i));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    ids.push_back(*x);
  }
  for (XferId id : ids) {
    ASSERT_TRUE(a->Post(id, [&](XferId, XferStatus st, const Status&) {
                   succeeded += st == XferStatus::kSuccess ? 1 : 0;
                   ++done;
                 }).ok());
  }
  ASSERT_TRUE(WaitFor([&] { return done.load() == static_cast<int>(kRequests); }, 60s))
      << done.load() << " of " << kRequests << " finished";
  EXPECT_EQ(succeeded.load(), static_cast<int>(kRequests));
  std::set<std::string> payloads;
  ASSERT_TRUE(WaitFor([&] {
    for (auto& n : b->TakeNotifications()) payloads.insert(n.payload);
    return payloads.size() == kRequests;
  }));
  EXPECT_EQ(payloads.size(), kRequests);
  int bad_blocks = 0;
  for (uint32_t i = 0; i < kRequests; ++i) {
    bad_blocks += Checksum(b->block(slot[i]), bb) != Checksum(a->block(i), bb);
  }
  EXPECT_EQ(bad_blocks, 0);
  for (XferId id : ids) EXPECT_TRUE(a->Release(id).ok());
  EXPECT_EQ(a->stats().live_requests, 0u);
  EXPECT_EQ(a->stats().inflight_requests, 0u);
}

// The fault hook (KvFaultOptions), on every backend: every 2nd data write
// fails before a byte moves (notice-only writes do not count), and the 3rd
// block written reaches the receiver with exactly one byte changed, before
// the write's notice; the sender's pool stays as it was.
TEST_P(ConformanceTest, FaultHookFailsWritesAndFlipsOneByte) {
  const uint64_t bb = 4096;
  KvFaultOptions fault;
  fault.fail_every = 2;
  fault.flip_block = 3;
  auto a = Make("fault-a", bb, 8, 4 * kMiB, 0, fault);
  auto b = Make("fault-b", bb, 8);
  ASSERT_TRUE(a && b);
  FillRandom(a->pool(), a->pool_bytes(), 21);
  const uint64_t source_sum = Checksum(a->pool(), a->pool_bytes());
  std::memset(b->pool(), 0, b->pool_bytes());
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  auto post = [&](std::vector<BlockPair> pairs, std::optional<std::string> notice) {
    auto x = pairs.empty() ? a->PrepareWrite(*peer, {}, notice)
                           : a->PrepareBlockWrite(*peer, pairs, notice);
    EXPECT_TRUE(x.ok()) << x.status().ToString();
    EXPECT_TRUE(a->Post(*x).ok());
    const XferStatus st = WaitDone(*a, *x);
    EXPECT_TRUE(a->Release(*x).ok());
    return st;
  };
  EXPECT_EQ(post({{0, 0}, {1, 1}}, "w1"), XferStatus::kSuccess);  // data write 1: blocks 1-2
  EXPECT_EQ(post({}, "notice-only"), XferStatus::kSuccess);      // not a data write
  EXPECT_EQ(post({{2, 2}}, "w2"), XferStatus::kErrBackend);       // data write 2: fails
  std::vector<std::byte> zero(bb);
  EXPECT_EQ(std::memcmp(b->block(2), zero.data(), bb), 0) << "the failed write moved bytes";
  // Data write 3 carries block 3 of the count (the failed one did not count).
  std::optional<uint64_t> sum_at_notice;
  std::mutex mu;
  b->SetNotificationCallback([&](Notification n) {
    if (n.payload != "w3") return;
    std::lock_guard lock(mu);
    sum_at_notice = Checksum(b->block(4), bb);
  });
  EXPECT_EQ(post({{4, 4}, {5, 5}}, "w3"), XferStatus::kSuccess);
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return sum_at_notice.has_value();
  }));
  int differing = 0, first_diff = -1;
  for (uint64_t i = 0; i < bb; ++i) {
    if (b->block(4)[i] != a->block(4)[i]) {
      ++differing;
      if (first_diff < 0) first_diff = static_cast<int>(i);
    }
  }
  EXPECT_EQ(differing, 1);
  EXPECT_EQ(first_diff, 0);
  EXPECT_EQ(*sum_at_notice, Checksum(b->block(4), bb)) << "the flip landed after the notice";
  EXPECT_EQ(Checksum(b->block(5), bb), Checksum(a->block(5), bb));
  EXPECT_EQ(Checksum(b->block(0), 2 * bb), Checksum(a->block(0), 2 * bb));
  EXPECT_EQ(post({{6, 6}}, "w4"), XferStatus::kErrBackend);  // data write 4
  EXPECT_EQ(post({{6, 6}}, "w5"), XferStatus::kSuccess);     // the flip happens once
  EXPECT_EQ(Checksum(b->block(6), bb), Checksum(a->block(6), bb));
  EXPECT_EQ(Checksum(a->pool(), a->pool_bytes()), source_sum) << "the sender's pool changed";
  EXPECT_EQ(a->stats().faults_injected, 3u);
  EXPECT_EQ(a->stats().inflight_requests, 0u);
}

// A delayed write (delay_ms, only the first data write) moves no byte while
// it waits and cannot be recalled: an abort meanwhile ends it ERR_CANCELED
// only after its data landed, without its notice. The next write is not
// delayed and overtakes it.
TEST_P(ConformanceTest, FaultHookDelaysAWriteThatLandsDespiteAnAbort) {
  const uint64_t bb = 4096;
  KvFaultOptions fault;
  fault.delay_ms = 300;
  fault.delay_writes = 1;
  auto a = Make("delay-a", bb, 4, 4 * kMiB, 0, fault);
  auto b = Make("delay-b", bb, 4);
  ASSERT_TRUE(a && b);
  FillRandom(a->pool(), a->pool_bytes(), 5);
  std::memset(b->pool(), 0, b->pool_bytes());
  std::vector<std::string> notices;
  std::mutex mu;
  b->SetNotificationCallback([&](Notification n) {
    std::lock_guard lock(mu);
    notices.push_back(n.payload);
  });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  auto x = a->PrepareWrite(*peer, {{0, 0, 2 * bb}}, "delayed");
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(a->Post(*x).ok());
  ASSERT_TRUE(a->Abort(*x).ok());  // cannot recall it: it is on the wire
  EXPECT_EQ(WaitDone(*a, *x), XferStatus::kErrCanceled);
  EXPECT_EQ(a->BytesDone(*x), 2 * bb) << "the write on the wire did not land";
  EXPECT_EQ(Checksum(b->pool(), 2 * bb), Checksum(a->pool(), 2 * bb));
  EXPECT_TRUE(a->Release(*x).ok());
  // The next write is not delayed; its notice is the only one (notices on
  // one endpoint are ordered: the aborted write's would have come first).
  ASSERT_EQ(WriteAndWait(*a, *peer, {{2 * bb, 2 * bb, bb}}, "second"), XferStatus::kSuccess);
  EXPECT_EQ(Checksum(b->block(2), bb), Checksum(a->block(2), bb));
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return !notices.empty();
  }));
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(notices, std::vector<std::string>{"second"});
  }
  EXPECT_EQ(a->stats().faults_injected, 1u);
  EXPECT_EQ(a->stats().inflight_requests, 0u);
}

// Abort takes effect between puts: a 64 MiB write in 64 KiB puts is stopped
// part way, reports ERR_CANCELED, sends no notice, and the transport goes on.
TEST_P(ConformanceTest, AbortMidTransfer) {
  const uint64_t total = 64 * kMiB;
  auto a = Make("abort-a", kMiB, 64, 64 * 1024, /*delay_us=*/100);
  auto b = Make("abort-b", kMiB, 64);
  ASSERT_TRUE(a && b);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  bool canceled_mid_way = false;
  std::set<std::string> canceled_notices;
  for (int attempt = 0; attempt < 5 && !canceled_mid_way; ++attempt) {
    const std::string notice = "aborted-" + std::to_string(attempt);
    auto x = a->PrepareWrite(*peer, {{0, 0, total}}, notice);
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE(a->Post(*x).ok());
    ASSERT_TRUE(WaitFor([&] { return a->BytesDone(*x) > 0 || IsTerminal(a->Poll(*x)); }));
    ASSERT_TRUE(a->Abort(*x).ok());
    const XferStatus st = WaitDone(*a, *x, 10s);
    const uint64_t moved = a->BytesDone(*x);
    if (st == XferStatus::kErrCanceled) {
      EXPECT_GT(moved, 0u);
      EXPECT_LT(moved, total);
      canceled_mid_way = true;
      canceled_notices.insert(notice);
    } else {
      EXPECT_EQ(st, XferStatus::kSuccess);  // finished before the abort landed; try again
    }
    EXPECT_TRUE(a->Release(*x).ok());
  }
  EXPECT_TRUE(canceled_mid_way);
  // A later write works; notices on one endpoint are ordered, so once its
  // notice is in, a canceled attempt's notice would have been too.
  ASSERT_EQ(WriteAndWait(*a, *peer, {{0, 0, 4096}}, "after"), XferStatus::kSuccess);
  std::vector<std::string> seen;
  ASSERT_TRUE(WaitFor([&] {
    for (auto& n : b->TakeNotifications()) seen.push_back(n.payload);
    return !seen.empty() && seen.back() == "after";
  }));
  for (const auto& s : seen) EXPECT_EQ(canceled_notices.count(s), 0u) << s;
  EXPECT_EQ(a->stats().inflight_requests, 0u);
  EXPECT_EQ(a->stats().live_requests, 0u);
}

// The peer dies while writes stream to it: an error surfaces within 5 s and
// nothing stays registered once the peer and requests are released. For ucx
// the peer is another process killed with SIGKILL.
// A peer killed while its endpoint is idle (no transfer in flight): the
// keepalive declares it dead and the peer-failure callback names its agent
// and generation — what a decoder watching a prefiller relies on to end a
// quarantine (docs/failure-handling.md).
TEST_P(ConformanceTest, IdlePeerKilledIsReportedByTheKeepalive) {
  if (backend() != "ucx") GTEST_SKIP() << "loopback has no keepalive (its peers die only by LoopbackDropPeer)";
  tandem::testing::CapturedLog log;
  auto a = Make("idle-a", 4096, 4);
  ASSERT_TRUE(a);
  auto child = std::make_unique<ChildProcess>(std::vector<std::string>{
      KV_PEER_BIN, "target", "backend=ucx", "name=idle-b-" + GetParam(), "block_bytes=4096",
      "blocks=4"});
  ASSERT_TRUE(child->ok());
  auto bytes = PeerDescriptor(*child);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto desc = ParseDescriptor(*bytes);
  ASSERT_TRUE(desc.ok());
  std::mutex mu;
  std::vector<std::pair<std::string, uint64_t>> lost;
  a->SetPeerFailureCallback([&](const std::string& agent, uint64_t generation, const Status&) {
    std::lock_guard lock(mu);
    lost.emplace_back(agent, generation);
  });
  auto peer = a->ImportPeer(*bytes);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  child->Kill();
  const bool reported = WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return !lost.empty();
      },
      30s);
  a->SetPeerFailureCallback({});
  ASSERT_TRUE(reported) << "an idle dead peer was never reported";
  std::lock_guard lock(mu);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].first, desc->agent_name);
  EXPECT_EQ(lost[0].second, desc->generation);
  // Nothing was in flight to it: logged at info, not as a warning (a fleet
  // whose workers stop together must not warn, Fleet.AnOrderlyStopLogsNoWarning).
  auto levels = log.Take("failed with 0 transfers in flight");
  EXPECT_EQ(levels["warning"], 0);
  EXPECT_EQ(levels["info"], 1);
}

// A peer that does not answer the connection handshake (here: stopped
// before the import) is declared lost after peer_timeout_s when this host
// cannot vouch for its process: its descriptor here names another host's
// boot id, as a peer on another machine's does. UCX's keep-alive cannot see
// that endpoint until the peer answers (docs/kvtransfer.md, "Peer loss").
// A write posted meanwhile, which UCX holds behind the wire-up, ends with
// the peer's error and leaves nothing behind. (A stopped peer on this host:
// handshake_test.cc.)
TEST_P(ConformanceTest, PeerThatNeverAnswersTheHandshakeIsDeclaredLost) {
  if (backend() != "ucx") GTEST_SKIP() << "loopback has no handshake";
  std::mutex mu;  // declared before the transport: its callbacks may run until it is gone
  std::vector<std::string> lost;
  std::optional<std::pair<XferStatus, Status>> ended;
  auto a = Make("mute-a", 4096, 4);  // peer_timeout_s 1.5
  ASSERT_TRUE(a);
  ChildProcess child({KV_PEER_BIN, "target", "backend=ucx", "name=mute-b-" + GetParam(),
                      "block_bytes=4096", "blocks=4"});
  ASSERT_TRUE(child.ok());
  auto bytes = PeerDescriptor(child);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto remote = ParseDescriptor(*bytes);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  remote->process.boot_id = "00000000-0000-4000-8000-000000000000";  // another host
  *bytes = SerializeDescriptor(*remote);
  a->SetPeerFailureCallback([&](const std::string& agent, uint64_t, const Status& why) {
    std::lock_guard lock(mu);
    lost.push_back(agent + ": " + why.ToString());
  });
  ASSERT_TRUE(child.Stop());
  const auto imported_at = std::chrono::steady_clock::now();
  auto peer = a->ImportPeer(*bytes);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  auto x = a->PrepareWrite(*peer, {{0, 0, 4096}}, "held");
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  ASSERT_TRUE(a->Post(*x, [&](XferId, XferStatus st, const Status& d) {
                 std::lock_guard lock(mu);
                 ended.emplace(st, d);
               }).ok());
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return !lost.empty() && ended.has_value();
  })) << "a peer that never answered was not declared lost";
  const double after_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - imported_at).count();
  std::printf("[conformance] %s: mute peer declared lost %.2f s after the import\n",
              GetParam().c_str(), after_s);
  EXPECT_GE(after_s, 1.5);  // not before the bound
  {
    std::lock_guard lock(mu);
    ASSERT_EQ(lost.size(), 1u);
    EXPECT_NE(lost[0].find("mute-b-" + GetParam() + ": UNAVAILABLE"), std::string::npos) << lost[0];
    EXPECT_NE(lost[0].find("handshake"), std::string::npos) << lost[0];
    EXPECT_NE(lost[0].find("peer_timeout_seconds = 1.5 s"), std::string::npos) << lost[0];
    EXPECT_EQ(ended->first, XferStatus::kErrRemoteDisconnect) << ended->second.ToString();
  }
  EXPECT_EQ(a->PrepareWrite(*peer, {{0, 0, 4096}}, "again").status().code(),
            StatusCode::kUnavailable);
  EXPECT_TRUE(a->Release(*x).ok());
  EXPECT_TRUE(WaitFor([&] { return a->stats().live_requests == 0; }));
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
  a->SetPeerFailureCallback({});
  const TransportStats s = a->stats();
  EXPECT_EQ(s.live_peers, 0u);
  EXPECT_EQ(s.live_remote_keys, 0u);
  EXPECT_EQ(s.inflight_requests, 0u);
  child.Kill();
}

TEST_P(ConformanceTest, PeerKilledMidTransfer) {
  const uint64_t bb = kMiB;
  const uint32_t blocks = 16;
  auto a = Make("kill-a", bb, blocks);
  ASSERT_TRUE(a);
  std::unique_ptr<ChildProcess> child;
  std::unique_ptr<Transport> local_peer;
  std::string desc;
  if (backend() == "ucx") {
    child = std::make_unique<ChildProcess>(std::vector<std::string>{
        KV_PEER_BIN, "target", "backend=ucx", "name=kill-b-" + GetParam(),
        "block_bytes=" + std::to_string(bb), "blocks=" + std::to_string(blocks)});
    ASSERT_TRUE(child->ok());
    auto bytes = PeerDescriptor(*child);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    desc = *bytes;
  } else {
    local_peer = Make("kill-b", bb, blocks);
    ASSERT_TRUE(local_peer);
    desc = local_peer->LocalDescriptor();
  }
  auto peer = a->ImportPeer(desc);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  ASSERT_EQ(WriteAndWait(*a, *peer, {{0, 0, blocks * bb}}, "first"), XferStatus::kSuccess);

  std::vector<XferId> ids;
  std::chrono::steady_clock::time_point killed_at;
  XferStatus failure = XferStatus::kSuccess;
  Status failure_detail;
  for (int i = 0; i < 100000 && failure == XferStatus::kSuccess; ++i) {
    auto x = a->PrepareWrite(*peer, {{0, 0, blocks * bb}}, std::to_string(i));
    if (!x.ok()) {  // the peer is already known dead
      failure = XferStatus::kErrRemoteDisconnect;
      failure_detail = x.status();
      break;
    }
    ids.push_back(*x);
    if (!a->Post(*x).ok()) {
      failure = a->Poll(*x, &failure_detail);
      break;
    }
    if (i == 2) {  // kill while transfers stream
      killed_at = std::chrono::steady_clock::now();
      if (child)
        child->Kill();
      else
        local_peer.reset();
    }
    if (i >= 2) {
      const XferStatus st = WaitDone(*a, *x, 10s);
      if (st != XferStatus::kSuccess) failure = a->Poll(*x, &failure_detail);
      if (std::chrono::steady_clock::now() - killed_at > 10s) break;
    }
  }
  const auto noticed_after = std::chrono::steady_clock::now() - killed_at;
  // The event is the error itself (the loop gives up after 10 s so that a
  // transport that never notices fails here rather than hangs); how fast it
  // comes is the keepalive's business, printed, not asserted.
  EXPECT_EQ(failure, XferStatus::kErrRemoteDisconnect) << failure_detail.ToString();
  std::printf("[conformance] %s: peer loss surfaced after %.2f s\n", GetParam().c_str(),
              std::chrono::duration<double>(noticed_after).count());
  for (XferId id : ids) {
    EXPECT_TRUE(IsTerminal(WaitDone(*a, id, 10s)));
    EXPECT_TRUE(a->Release(id).ok());
  }
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
  const TransportStats s = a->stats();
  EXPECT_EQ(s.live_peers, 0u);
  EXPECT_EQ(s.live_remote_keys, 0u);
  EXPECT_EQ(s.live_requests, 0u);
  EXPECT_EQ(s.inflight_requests, 0u);
}

// A peer that stops answering with writes queued to it, and is then killed:
// every write still ends (delivered, or with an error within about
// peer_timeout_s), and nothing of it stays behind. The stopped peer no
// longer drains its shared-memory receive FIFO (64 slots), so the notices
// after the first 64 cannot be sent as short messages. Without the
// connection handshake (ucx_transport.cc SendHello) the first of them makes
// UCX 1.13 resolve the peer's endpoint id: it puts a wire-up proxy on the
// endpoint's keep-alive lane and sends a wire-up request the stopped peer
// never answers, and until that reply the keep-alive skips the lane, so the
// peer's death is never reported and those writes never end
// (docs/kvtransfer.md, "Peer loss"). A busy peer that dies with its FIFO
// full got there too (StagedTwoProcess.PeerKilledMidTransferSurfacesAnError,
// 1 run in ~10 under load). With the handshake the id is known from the
// import on, and the keep-alive reports the death.
TEST_P(ConformanceTest, WritesQueuedToAStoppedPeerEndWhenItDies) {
  if (GetParam() != "ucx") {
    GTEST_SKIP() << "the keep-alive gap is shared memory's; over TCP the stopped peer's kernel "
                    "resets the connection when it is killed";
  }
  // Declared before the transport: its callbacks may run until it is gone.
  std::mutex mu;
  std::vector<std::string> lost;
  std::map<XferStatus, int> ended;
  int ended_count = 0;
  auto a = Make("stall-a", 4096, 4);  // peer_timeout_s 1.5
  ASSERT_TRUE(a);
  ChildProcess child({KV_PEER_BIN, "target", "backend=ucx", "name=stall-b-" + GetParam(),
                      "block_bytes=4096", "blocks=4"});
  ASSERT_TRUE(child.ok());
  auto bytes = PeerDescriptor(child);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  a->SetPeerFailureCallback([&](const std::string& agent, uint64_t, const Status&) {
    std::lock_guard lock(mu);
    lost.push_back(agent);
  });
  auto peer = a->ImportPeer(*bytes);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  ASSERT_EQ(WriteAndWait(*a, *peer, {{0, 0, 4096}}, "short"), XferStatus::kSuccess);

  tandem::testing::CapturedLog log;
  ASSERT_TRUE(child.Stop());
  constexpr int kWrites = 256;  // 4x the receive FIFO
  std::vector<XferId> xfers;
  for (int i = 0; i < kWrites; ++i) {
    auto x = a->PrepareWrite(*peer, {{0, 0, 4096}}, "queued " + std::to_string(i));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    xfers.push_back(*x);
    ASSERT_TRUE(a->Post(*x, [&](XferId, XferStatus s, const Status&) {
                   std::lock_guard lock(mu);
                   ended[s]++;
                   ended_count++;
                 }).ok());
  }
  // Killed with the writes queued: the stopped peer drained none of its
  // FIFO, so whatever the progress thread has reached by now, the notices
  // past the 64th find it full (the dead peer never drains it either).
  child.Kill();
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return ended_count == kWrites;
  })) << "writes to a dead peer never ended (" << a->stats().inflight_requests << " in flight)";
  {
    std::lock_guard lock(mu);
    std::printf("[conformance] %s: %d writes queued to a stopped peer ended %.2f s after its "
                "kill: %d delivered, %d remote-disconnect\n",
                GetParam().c_str(), kWrites,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count(),
                ended[XferStatus::kSuccess], ended[XferStatus::kErrRemoteDisconnect]);
    EXPECT_GT(ended[XferStatus::kErrRemoteDisconnect], 0);
    EXPECT_EQ(ended[XferStatus::kSuccess] + ended[XferStatus::kErrRemoteDisconnect], kWrites);
  }
  // The peer-failure callback runs right after the transfers' callbacks.
  EXPECT_TRUE(WaitFor([&] {
    std::lock_guard lock(mu);
    return !lost.empty();
  }));
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(lost, std::vector<std::string>{"stall-b-" + GetParam()});
  }
  // Writes were in flight to it and failed: a warning.
  EXPECT_EQ(log.Take("kvtransfer: peer")["warning"], 1);
  EXPECT_EQ(a->PrepareWrite(*peer, {{0, 0, 4096}}, "again").status().code(),
            StatusCode::kUnavailable);
  for (XferId x : xfers) EXPECT_TRUE(a->Release(x).ok());
  // Nothing of them stays: their operations were ended, not abandoned.
  EXPECT_TRUE(WaitFor([&] { return a->stats().live_requests == 0; }));
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
  a->SetPeerFailureCallback({});
  const TransportStats s = a->stats();
  EXPECT_EQ(s.live_peers, 0u);
  EXPECT_EQ(s.live_remote_keys, 0u);
  EXPECT_EQ(s.inflight_requests, 0u);
}

// A peer restarts under the same name: its old descriptor and the PeerId
// made from it are refused; the new one works.
TEST_P(ConformanceTest, StaleDescriptorRejected) {
  const uint64_t bb = 4096;
  auto a = Make("stale-a", bb, 4);
  auto b1 = Make("stale-b", bb, 4);
  ASSERT_TRUE(a && b1);
  const std::string old_desc = b1->LocalDescriptor();
  auto old_peer = a->ImportPeer(old_desc);
  ASSERT_TRUE(old_peer.ok()) << old_peer.status().ToString();
  ASSERT_EQ(WriteAndWait(*a, *old_peer, {{0, 0, bb}}), XferStatus::kSuccess);
  EXPECT_EQ(*a->ImportPeer(old_desc), *old_peer);  // endpoints are cached per peer

  b1.reset();  // "restart"
  auto b2 = Make("stale-b", bb, 4);
  ASSERT_TRUE(b2);
  EXPECT_GT(b2->generation(), ParseDescriptor(old_desc)->generation);
  auto new_peer = a->ImportPeer(b2->LocalDescriptor());
  ASSERT_TRUE(new_peer.ok()) << new_peer.status().ToString();

  auto again = a->ImportPeer(old_desc);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("stale"), std::string::npos) << again.status().ToString();
  auto stale_write = a->PrepareWrite(*old_peer, {{0, 0, bb}}, "stale");
  EXPECT_EQ(stale_write.status().code(), StatusCode::kFailedPrecondition);

  FillRandom(a->pool(), bb, 5);
  ASSERT_EQ(WriteAndWait(*a, *new_peer, {{0, 0, bb}}, "fresh"), XferStatus::kSuccess);
  EXPECT_EQ(Checksum(b2->pool(), bb), Checksum(a->pool(), bb));
  ASSERT_TRUE(WaitFor([&] { return b2->stats().notifications_received == 1; }));
  EXPECT_EQ(b2->TakeNotifications().at(0).payload, "fresh");
  EXPECT_TRUE(a->ReleasePeer(*old_peer).ok());
  EXPECT_TRUE(a->ReleasePeer(*new_peer).ok());
  EXPECT_EQ(a->stats().live_remote_keys, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, ConformanceTest, ::testing::Values("loopback", "ucx", "ucx_tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::kvtransfer
