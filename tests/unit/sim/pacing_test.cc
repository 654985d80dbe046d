// Transport pacing (TransportOptions::pace_*): a paced write lands no sooner
// than the modelled link allows, writes queue on the link, notices alone
// are not paced, and an abort does not wait for the link.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::unique_ptr<Transport> Make(const std::string& name, double bits_per_s, double scale,
                                double latency_s) {
  TransportOptions o;
  o.backend = "loopback";
  o.agent_name = name;
  o.block_bytes = 4096;
  o.num_blocks = 64;
  o.pace_bits_per_s = bits_per_s;
  o.pace_byte_scale = scale;
  o.pace_latency_s = latency_s;
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

bool WaitTerminal(Transport& t, XferId x, std::chrono::milliseconds limit = 10s) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (IsTerminal(t.Poll(x))) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

TEST(Pacing, WriteTakesTheModelledLinkTimeAndQueues) {
  // 64 KiB stand for 64 KiB * 100 = 6,553,600 B = 52,428,800 bits: at 1 Gb/s
  // that is 52.4 ms, plus 5 ms latency.
  auto a = Make("pace-a", 1e9, 100, 0.005);
  auto b = Make("pace-b", 0, 1, 0);
  std::memset(a->pool(), 0x5a, a->pool_bytes());
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  const uint64_t n = 16 * 4096;
  auto x = a->PrepareWrite(*peer, {{0, 0, n}}, "one");
  auto y = a->PrepareWrite(*peer, {{n, n, n}}, "two");
  ASSERT_TRUE(x.ok() && y.ok());
  const auto t0 = Clock::now();
  ASSERT_TRUE(a->Post(*x).ok());
  ASSERT_TRUE(a->Post(*y).ok());
  ASSERT_TRUE(WaitTerminal(*a, *x));
  const double tx = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_TRUE(WaitTerminal(*a, *y));
  const double ty = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(a->Poll(*x), XferStatus::kSuccess);
  EXPECT_EQ(a->Poll(*y), XferStatus::kSuccess);
  EXPECT_GE(tx, 0.0524 + 0.005);
  EXPECT_GE(ty, 2 * 0.0524 + 0.005);  // the second waited for the first on the link
  EXPECT_EQ(static_cast<unsigned char>(b->pool()[2 * n - 1]), 0x5a);  // the bytes moved
  EXPECT_TRUE(a->Release(*x).ok());
  EXPECT_TRUE(a->Release(*y).ok());
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
}

TEST(Pacing, NoticesAloneAndAbortsDoNotWaitForTheLink) {
  // 256 KiB * 1e7 at 1 Gb/s would take ~6 hours on the modelled link: a
  // notice paced like data, or an abort that waited for the link, would
  // not end within WaitTerminal's 10 s bound, so ending at all shows they
  // do not (no wall-clock assertion).
  auto a = Make("pace-c", 1e9, 1e7, 0);
  auto b = Make("pace-d", 0, 1, 0);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  auto notice = a->PrepareWrite(*peer, {}, "just a notice");
  ASSERT_TRUE(notice.ok());
  ASSERT_TRUE(a->Post(*notice).ok());
  ASSERT_TRUE(WaitTerminal(*a, *notice));
  EXPECT_EQ(a->Poll(*notice), XferStatus::kSuccess);
  auto big = a->PrepareWrite(*peer, {{0, 0, 64 * 4096}}, "big");
  ASSERT_TRUE(big.ok());
  ASSERT_TRUE(a->Post(*big).ok());
  EXPECT_EQ(a->Poll(*big), XferStatus::kInProgress);  // hours to go
  ASSERT_TRUE(a->Abort(*big).ok());
  ASSERT_TRUE(WaitTerminal(*a, *big));
  EXPECT_EQ(a->Poll(*big), XferStatus::kErrCanceled);
  EXPECT_EQ(b->stats().notifications_received, 1u);  // the aborted write sent none
  EXPECT_TRUE(a->Release(*notice).ok());
  EXPECT_TRUE(a->Release(*big).ok());
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
}

}  // namespace
}  // namespace tandem::kvtransfer
