// Unit tests below the conformance suite: descriptor format, coalescing,
// notices, loopback fault injection and the fork guard (idle progress: bench/kvtransfer).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>

#include "kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "kvtransfer/transport.h"
#include "kvtransfer/transport_base.h"

namespace tandem::kvtransfer {
namespace {

using testing::Checksum;
using testing::FillRandom;
using testing::WaitFor;
using namespace std::chrono_literals;

std::unique_ptr<Transport> Make(const std::string& backend, const std::string& name,
                                uint64_t block_bytes, uint32_t blocks, uint32_t delay_us = 0) {
  TransportOptions o;
  o.backend = backend;
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = blocks;
  o.loopback_delay_per_put_us = delay_us;
  o.max_put_bytes = 64 * 1024;
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

TEST(Descriptor, RoundTripsAndRejectsCorruption) {
  PeerDescriptor d{"ucx", "decode-0", 12345, 4096, 100, 0xdeadbeef, std::string("\0addr", 5), "rk"};
  const std::string bytes = SerializeDescriptor(d);
  auto back = ParseDescriptor(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->agent_name, "decode-0");
  EXPECT_EQ(back->generation, 12345u);
  EXPECT_EQ(back->pool_bytes(), 409600u);
  EXPECT_EQ(back->address, std::string("\0addr", 5));
  EXPECT_EQ(back->remote_base, 0xdeadbeefu);
  for (size_t i = 0; i < bytes.size(); i += 7) {  // any flipped byte is caught
    std::string bad = bytes;
    bad[i] ^= 0x5a;
    EXPECT_FALSE(ParseDescriptor(bad).ok()) << "flip at " << i;
  }
  EXPECT_FALSE(ParseDescriptor(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(ParseDescriptor("").ok());
  auto hex = FromHex(ToHex(bytes));
  ASSERT_TRUE(hex.ok());
  EXPECT_EQ(*hex, bytes);
  EXPECT_FALSE(FromHex("abc").ok());
  EXPECT_FALSE(FromHex("zz").ok());
}

TEST(Coalesce, MergesOnlyRunsContiguousOnBothSides) {
  const std::vector<BlockPair> pairs = {{0, 10}, {1, 11}, {2, 12}, {3, 20},
                                        {5, 21}, {6, 22}, {6, 23}};
  const auto segs = CoalesceBlocks(pairs, 100);
  ASSERT_EQ(segs.size(), 4u);
  EXPECT_EQ(segs[0].length_bytes, 300u);
  EXPECT_EQ(segs[0].remote_offset_bytes, 1000u);
  EXPECT_EQ(segs[1].local_offset_bytes, 300u);
  EXPECT_EQ(segs[1].length_bytes, 100u);
  EXPECT_EQ(segs[2].local_offset_bytes, 500u);
  EXPECT_EQ(segs[2].length_bytes, 200u);
  EXPECT_EQ(segs[3].local_offset_bytes, 600u);
  EXPECT_TRUE(CoalesceBlocks({}, 100).empty());
}

TEST(Notice, EncodesAndDecodes) {
  const std::string w = detail::EncodeNotice(7, 9, "prefill-1", std::string("a\0b", 3));
  auto d = detail::DecodeNotice(w);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->target_generation, 7u);
  EXPECT_EQ(d->notification.sender_generation, 9u);
  EXPECT_EQ(d->notification.sender, "prefill-1");
  EXPECT_EQ(d->notification.payload, std::string("a\0b", 3));
  EXPECT_FALSE(detail::DecodeNotice(w.substr(0, 10)).ok());
}

// A notice addressed to an older generation of this agent (written by a
// prefiller that has not seen the restart) is dropped and counted.
TEST(Notice, StaleGenerationIsDropped) {
  for (const std::string backend : {"loopback", "ucx"}) {
    auto t = Make(backend, "notice-" + backend, 4096, 2);
    ASSERT_TRUE(t);
    auto* base = dynamic_cast<detail::TransportBase*>(t.get());
    ASSERT_NE(base, nullptr);
    base->DeliverNotice(detail::EncodeNotice(t->generation() - 1, 1, "old-writer", "x"));
    base->DeliverNotice(detail::EncodeNotice(t->generation(), 1, "writer", "y"));
    const auto got = t->TakeNotifications();
    ASSERT_EQ(got.size(), 1u) << backend;
    EXPECT_EQ(got[0].payload, "y");
    EXPECT_EQ(t->stats().stale_notifications_dropped, 1u);
  }
}

TEST(Transport, RejectsBadOptionsAndArguments) {
  TransportOptions o;
  o.agent_name = "x";
  EXPECT_EQ(CreateTransport(o).status().code(), StatusCode::kInvalidArgument);  // empty pool
  o.block_bytes = 16;
  o.num_blocks = 1;
  o.backend = "carrier-pigeon";
  EXPECT_EQ(CreateTransport(o).status().code(), StatusCode::kInvalidArgument);
  auto a = Make("loopback", "args-a", 64, 2);
  auto b = Make("loopback", "args-b", 64, 2);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  EXPECT_EQ(a->PrepareWrite(*peer, {{0, 0, 129}}, std::nullopt).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a->PrepareWrite(*peer, {{100, 0, 64}}, std::nullopt).status().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a->PrepareWrite(*peer, {}, std::nullopt).status().code(), StatusCode::kInvalidArgument);
  // A notice over the backend's limit (kTransportNoticeBytes).
  EXPECT_EQ(a->PrepareWrite(*peer, {}, std::string(a->capabilities().max_notification_bytes + 1, 'n'))
                .status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(a->PrepareWrite(99, {{0, 0, 1}}, std::nullopt).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(a->Post(12345).code(), StatusCode::kNotFound);
  auto x = a->PrepareWrite(*peer, {}, std::string("notice only"));
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(a->Post(*x).ok());
  EXPECT_EQ(a->Post(*x).code(), StatusCode::kFailedPrecondition);  // posted twice
  ASSERT_TRUE(WaitFor([&] { return a->Poll(*x) == XferStatus::kSuccess; }));
  ASSERT_TRUE(WaitFor([&] { return b->stats().notifications_received == 1; }));
  EXPECT_TRUE(a->Release(*x).ok());
  EXPECT_EQ(a->Release(*x).code(), StatusCode::kNotFound);
  EXPECT_FALSE(a->ImportPeer("garbage").ok());
}

// Loopback fault injection: delay, drop the peer, stale handle.
TEST(KvFault, ParsesTheSpecAndNamesBadKeysAndValues) {
  auto f = ParseKvFault("fail_every=5,delay_ms=2000,delay_writes=1,flip_block=3,agent=prefill-0");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->fail_every, 5u);
  EXPECT_EQ(f->delay_ms, 2000u);
  EXPECT_EQ(f->delay_writes, 1u);
  EXPECT_EQ(f->flip_block, 3u);
  EXPECT_EQ(f->agent, "prefill-0");
  EXPECT_TRUE(f->enabled());
  EXPECT_FALSE(ParseKvFault("")->enabled());
  EXPECT_FALSE(ParseKvFault("off")->enabled());
  EXPECT_FALSE(ParseKvFault("delay_writes=4")->enabled());  // nothing to delay
  auto bad_key = ParseKvFault("fail_every=2,explode=1");
  ASSERT_FALSE(bad_key.ok());
  EXPECT_EQ(bad_key.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_key.status().message().find("explode"), std::string::npos);
  EXPECT_NE(bad_key.status().message().find("TANDEM_KV_FAULT"), std::string::npos);
  for (const char* v : {"delay_ms=", "delay_ms=-1", "delay_ms=1x", "delay_ms=3600001", "flip_block"}) {
    auto r = ParseKvFault(v);
    EXPECT_FALSE(r.ok()) << v;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << v;
  }
}

// TANDEM_KV_FAULT reaches every transport the process creates; a bad value
// refuses to create one, naming the variable.
TEST(KvFault, EnvironmentVariableEnablesOrRefuses) {
  TransportOptions o;
  o.backend = "loopback";
  o.agent_name = "env-fault";
  o.block_bytes = 64;
  o.num_blocks = 2;
  setenv(kKvFaultEnv, "fail_every=1", 1);
  {
    auto a = CreateTransport(o);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    o.agent_name = "env-fault-b";
    auto b = CreateTransport(o);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    auto peer = (*a)->ImportPeer((*b)->LocalDescriptor());
    ASSERT_TRUE(peer.ok());
    auto x = (*a)->PrepareWrite(*peer, {{0, 0, 64}}, std::nullopt);
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE((*a)->Post(*x).ok());
    ASSERT_TRUE(testing::WaitFor([&] { return IsTerminal((*a)->Poll(*x)); }));
    EXPECT_EQ((*a)->Poll(*x), XferStatus::kErrBackend);
    EXPECT_TRUE((*a)->Release(*x).ok());
  }
  // agent=: only the named transport takes the faults.
  setenv(kKvFaultEnv, "fail_every=1,agent=someone-else", 1);
  {
    o.agent_name = "env-fault-d";
    auto d = CreateTransport(o);
    ASSERT_TRUE(d.ok());
    o.agent_name = "env-fault-e";
    auto e = CreateTransport(o);
    ASSERT_TRUE(e.ok());
    auto peer = (*d)->ImportPeer((*e)->LocalDescriptor());
    ASSERT_TRUE(peer.ok());
    auto x = (*d)->PrepareWrite(*peer, {{0, 0, 64}}, std::nullopt);
    ASSERT_TRUE(x.ok());
    ASSERT_TRUE((*d)->Post(*x).ok());
    ASSERT_TRUE(testing::WaitFor([&] { return IsTerminal((*d)->Poll(*x)); }));
    EXPECT_EQ((*d)->Poll(*x), XferStatus::kSuccess);
    EXPECT_TRUE((*d)->Release(*x).ok());
  }
  setenv(kKvFaultEnv, "fail_evry=1", 1);
  o.agent_name = "env-fault-c";
  auto bad = CreateTransport(o);
  unsetenv(kKvFaultEnv);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fail_evry"), std::string::npos);
}

// lose_peer_at=N (peer-lost, session 13): the Nth data write declares its
// peer lost while the peer is alive; the peer-failure callback runs, later
// writes to that PeerId are refused, and importing the same descriptor
// again gives a fresh endpoint that works.
TEST(KvFault, LosePeerAtDeclaresALivePeerLostAndAFreshImportWorks) {
  auto spec = ParseKvFault("lose_peer_at=2,agent=lose-a");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->lose_peer_at, 2u);
  EXPECT_TRUE(spec->enabled());
  EXPECT_NE(spec->ToString().find("lose_peer_at=2"), std::string::npos);
  TransportOptions o;
  o.backend = "loopback";
  o.agent_name = "lose-a";
  o.block_bytes = 64;
  o.num_blocks = 4;
  o.fault = *spec;
  auto a = CreateTransport(o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  o.agent_name = "lose-b";
  o.fault = {};
  auto b = CreateTransport(o);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::atomic<int> lost{0};
  (*a)->SetPeerFailureCallback([&](const std::string& agent, uint64_t, const Status&) {
    if (agent == "lose-b") ++lost;
  });
  auto peer = (*a)->ImportPeer((*b)->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  auto write = [&](PeerId p) {
    auto x = (*a)->PrepareWrite(p, {{0, 0, 64}}, std::string("n"));
    if (!x.ok()) return XferStatus::kErrInvalidArgument;
    EXPECT_TRUE((*a)->Post(*x).ok());
    EXPECT_TRUE(testing::WaitFor([&] { return IsTerminal((*a)->Poll(*x)); }));
    const XferStatus st = (*a)->Poll(*x);
    EXPECT_TRUE((*a)->Release(*x).ok());
    return st;
  };
  EXPECT_EQ(write(*peer), XferStatus::kSuccess);
  EXPECT_EQ(write(*peer), XferStatus::kErrRemoteDisconnect);  // the 2nd data write
  EXPECT_TRUE(testing::WaitFor([&] { return lost.load() == 1; }));
  auto refused = (*a)->PrepareWrite(*peer, {{0, 0, 64}}, std::nullopt);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("lose_peer_at"), std::string::npos);
  auto fresh = (*a)->ImportPeer((*b)->LocalDescriptor());
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_NE(*fresh, *peer);
  EXPECT_EQ(write(*fresh), XferStatus::kSuccess);  // once only
  EXPECT_EQ((*b)->stats().notifications_received, 2u);
  EXPECT_EQ((*a)->stats().faults_injected, 1u);
  EXPECT_TRUE((*a)->ReleasePeer(*peer).ok());
  EXPECT_TRUE((*a)->ReleasePeer(*fresh).ok());
  (*a)->SetPeerFailureCallback({});
}

TEST(LoopbackFaults, DropPeerFailsInFlightWrite) {
  auto a = Make("loopback", "drop-a", 65536, 64, /*delay_us=*/500);
  auto b = Make("loopback", "drop-b", 65536, 64);
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  auto x = a->PrepareWrite(*peer, {{0, 0, a->pool_bytes()}}, "never");
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(a->Post(*x).ok());
  ASSERT_TRUE(WaitFor([&] { return a->BytesDone(*x) > 0; }));
  ASSERT_TRUE(LoopbackDropPeer("drop-b").ok());
  ASSERT_TRUE(WaitFor([&] { return IsTerminal(a->Poll(*x)); }, 5s));
  EXPECT_EQ(a->Poll(*x), XferStatus::kErrRemoteDisconnect);
  EXPECT_LT(a->BytesDone(*x), a->pool_bytes());
  EXPECT_EQ(b->stats().notifications_received, 0u);
  // Later writes to the dropped peer fail at once.
  auto y = a->PrepareWrite(*peer, {{0, 0, 1}}, std::nullopt);
  EXPECT_EQ(y.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(a->Release(*x).ok());
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
  EXPECT_EQ(a->stats().live_remote_keys, 0u);
}

TEST(LoopbackFaults, RestartMakesHandleStaleMidTransfer) {
  auto a = Make("loopback", "restart-a", 65536, 64, /*delay_us=*/500);
  auto b = Make("loopback", "restart-b", 65536, 64);
  const std::string old_desc = b->LocalDescriptor();
  auto peer = a->ImportPeer(old_desc);
  ASSERT_TRUE(peer.ok());
  auto x = a->PrepareWrite(*peer, {{0, 0, a->pool_bytes()}}, "never");
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(a->Post(*x).ok());
  ASSERT_TRUE(WaitFor([&] { return a->BytesDone(*x) > 0; }));
  auto gen = LoopbackRestartPeer("restart-b");
  ASSERT_TRUE(gen.ok());
  ASSERT_TRUE(WaitFor([&] { return IsTerminal(a->Poll(*x)); }, 5s));
  EXPECT_EQ(a->Poll(*x), XferStatus::kErrStaleDescriptor);
  EXPECT_EQ(b->stats().notifications_received, 0u);
  // The new descriptor carries the new generation and works.
  auto fresh = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_NE(*fresh, *peer);
  EXPECT_EQ(a->ImportPeer(old_desc).status().code(), StatusCode::kFailedPrecondition);
  auto y = a->PrepareWrite(*fresh, {{0, 0, 100}}, "fresh");
  ASSERT_TRUE(y.ok());
  ASSERT_TRUE(a->Post(*y).ok());
  ASSERT_TRUE(WaitFor([&] { return a->Poll(*y) == XferStatus::kSuccess; }));
  ASSERT_TRUE(WaitFor([&] { return b->stats().notifications_received == 1; }));
  EXPECT_EQ(b->TakeNotifications().at(0).payload, "fresh");
}

// UCX state does not survive fork(): a transport used from a forked child
// refuses cleanly instead of touching UCX.
TEST(Fork, ChildOfAProcessWithATransportIsRefused) {
  auto a = Make("ucx", "fork-a", 4096, 2);
  ASSERT_TRUE(a);
  const std::string desc = a->LocalDescriptor();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto r = a->ImportPeer(desc);
    const bool refused = r.status().code() == StatusCode::kFailedPrecondition &&
                         r.status().message().find("fork") != std::string::npos;
    _exit(refused ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
  // The parent's transport is unaffected.
  auto self = a->ImportPeer(desc);
  EXPECT_TRUE(self.ok()) << self.status().ToString();
}

// The progress thread polls after a notice arrives (a burst is drained
// without a wake-up per notice) but a writer whose own writes completed,
// with nothing arriving, goes to sleep at once: it never polls.
TEST(Progress, AWriterSleepsOnceItsWritesCompleteAndAReceiverPollsAfterNotices) {
  auto a = Make("ucx", "poll-a", 4096, 4);
  auto b = Make("ucx", "poll-b", 4096, 4);
  ASSERT_TRUE(a && b);
  std::atomic<int> received{0};
  b->SetNotificationCallback([&](Notification) { received.fetch_add(1); });
  auto peer = a->ImportPeer(b->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  constexpr int kWrites = 8;
  for (int i = 0; i < kWrites; ++i) {
    const std::vector<BlockPair> pairs = {{static_cast<uint32_t>(i % 4), 0}};
    auto x = a->PrepareBlockWrite(*peer, pairs, "n");
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    ASSERT_TRUE(a->Post(*x).ok());
    ASSERT_TRUE(WaitFor([&] { return received.load() == i + 1 && IsTerminal(a->Poll(*x)); }))
        << "write " << i;
    EXPECT_EQ(a->Poll(*x), XferStatus::kSuccess);
    EXPECT_TRUE(a->Release(*x).ok());
  }
  // The writer's thread went to sleep after its last write.
  const uint64_t sleeps = a->stats().progress_sleeps;
  ASSERT_TRUE(WaitFor([&] { return a->stats().progress_sleeps > sleeps; }));
  EXPECT_EQ(a->stats().progress_idle_polls, 0u);
  EXPECT_GT(b->stats().progress_idle_polls, 0u);
  EXPECT_TRUE(a->ReleasePeer(*peer).ok());
}

// How much CPU idle transports use (their progress threads sleep on the
// worker's event fd) is measured by bench/kvtransfer/idle_bench.cc.

}  // namespace
}  // namespace tandem::kvtransfer
