// The staging path between two real processes over UCX on this host: this
// test process is a StagedTransport writer (host stand-in copy engine), the
// kvtransfer_peer helper a StagedTransport target (`staged=1`) whose SUM
// reads its "device" pool, i.e. what its host->device copies delivered after
// the notice arrived. The unit tests (tests/unit/kvtransfer/
// staged_transport_test.cc) cover the same pipeline over loopback.
#include <gtest/gtest.h>

#include <future>
#include <numeric>
#include <random>

#include "../../unit/kvtransfer/kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/staging/host_copy_engine.h"
#include "kvtransfer/staging/staged_transport.h"

namespace tandem::kvtransfer {
namespace {

using testing::Checksum;
using testing::ChildProcess;
using testing::FillRandom;
using namespace std::chrono_literals;

constexpr uint64_t kBlockBytes = 512;
constexpr uint32_t kBlocks = 4096 + 16;

std::vector<std::string> TargetArgs(const std::string& name) {
  return {KV_PEER_BIN, "target", "backend=ucx", "staged=1", "name=" + name,
          "block_bytes=" + std::to_string(kBlockBytes), "blocks=" + std::to_string(kBlocks)};
}

std::string ReadDescriptor(ChildProcess& child) {
  auto hex = child.Expect("DESC ");
  EXPECT_TRUE(hex.has_value()) << "helper did not print its descriptor";
  if (!hex) return "";
  auto bytes = FromHex(*hex);
  EXPECT_TRUE(bytes.ok());
  return bytes.ok() ? *bytes : "";
}

std::unique_ptr<StagedTransport> MakeWriter(const std::string& name, HostCopyEngineOptions eo,
                                            StagedTransportOptions so = {}) {
  TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = kBlockBytes;
  o.num_blocks = kBlocks;
  o.peer_timeout_s = 3.0;
  auto t = CreateStagedTransport(o, std::make_unique<HostCopyEngine>(eo), std::move(so));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

std::pair<XferStatus, Status> WaitDone(std::future<std::pair<XferStatus, Status>>& f,
                                       std::chrono::seconds bound) {
  if (f.wait_for(bound) != std::future_status::ready) {
    return {XferStatus::kInProgress, DeadlineExceededError("no completion within the bound")};
  }
  return f.get();
}

TEST(StagedTwoProcess, IntegrityByChecksumFromOneTo4096BlocksAtRandomSlots) {
  // The helper first, before this process touches UCX (as `tandem launch` does).
  ChildProcess helper(TargetArgs("staged-target"));
  ASSERT_TRUE(helper.ok());
  const std::string desc = ReadDescriptor(helper);
  ASSERT_FALSE(desc.empty());
  auto w = MakeWriter("staged-writer", {});
  ASSERT_TRUE(w);
  auto peer = w->ImportPeer(desc);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  FillRandom(w->pool(), w->pool_bytes(), 5);
  std::vector<std::byte> expect(uint64_t{kBlocks} * kBlockBytes, std::byte{0});
  std::mt19937_64 rng(9);
  size_t notices = 0;
  for (uint32_t n : {1u, 5u, 64u, 4096u}) {
    SCOPED_TRACE(n);
    std::vector<uint32_t> local(kBlocks), remote(kBlocks);
    std::iota(local.begin(), local.end(), 0u);
    std::iota(remote.begin(), remote.end(), 0u);
    std::shuffle(local.begin(), local.end(), rng);
    std::shuffle(remote.begin(), remote.end(), rng);
    std::vector<BlockPair> pairs;
    for (uint32_t i = 0; i < n; ++i) {
      pairs.push_back({local[i], remote[i]});
      std::memcpy(expect.data() + uint64_t{remote[i]} * kBlockBytes,
                  w->pool() + uint64_t{local[i]} * kBlockBytes, kBlockBytes);
    }
    auto x = w->PrepareBlockWrite(*peer, pairs, "n" + std::to_string(n));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    std::promise<std::pair<XferStatus, Status>> p;
    auto f = p.get_future();
    ASSERT_TRUE(w->Post(*x, [&p](XferId, XferStatus s, const Status& d) { p.set_value({s, d}); }).ok());
    const auto [st, detail] = WaitDone(f, 30s);
    ASSERT_EQ(st, XferStatus::kSuccess) << detail.ToString();
    w->Release(*x).IgnoreError();
    // The helper checksums its device pool only once the notice is there.
    ++notices;
    ASSERT_TRUE(helper.Send("NOTICES " + std::to_string(notices) + " 20000"));
    auto got = helper.Expect("NOTICES ");
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->substr(0, got->find(' ')), std::to_string(notices)) << *got;
    ASSERT_TRUE(helper.Send("SUM 0 " + std::to_string(expect.size())));
    auto sum = helper.Expect("SUM ");
    ASSERT_TRUE(sum.has_value());
    EXPECT_EQ(*sum, std::to_string(Checksum(expect.data(), expect.size())));
  }
  const StagingStats s = w->staging_stats();
  EXPECT_EQ(s.free_buffers, s.buffers);
  helper.Send("QUIT");
}

// The target is SIGKILLed while the write is mid-pipeline (copies slowed so
// the write is long): the write ends with an error, reported by its
// callback, within the bound below (peer_timeout_s = 3 s plus margin), and
// every staging buffer is free again.
TEST(StagedTwoProcess, PeerKilledMidTransferSurfacesAnError) {
  ChildProcess helper(TargetArgs("staged-victim"));
  ASSERT_TRUE(helper.ok());
  const std::string desc = ReadDescriptor(helper);
  ASSERT_FALSE(desc.empty());
  std::promise<void> first_put;
  std::atomic<bool> seen{false};
  StagedTransportOptions so;
  so.blocks_per_buffer = 1;
  so.trace = [&](const StageEvent& e) {
    if (e.kind == StageEvent::Kind::kPutDone && !seen.exchange(true)) first_put.set_value();
  };
  HostCopyEngineOptions eo;
  eo.delay_per_batch_us = 2000;  // 4096 chunks: ~8 s of copies, far longer than the test
  auto w = MakeWriter("staged-killer", eo, std::move(so));
  ASSERT_TRUE(w);
  auto peer = w->ImportPeer(desc);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  std::vector<BlockPair> pairs;
  for (uint32_t b = 0; b < 4096; ++b) pairs.push_back({b, b});
  auto x = w->PrepareBlockWrite(*peer, pairs, "never");
  ASSERT_TRUE(x.ok());
  std::promise<std::pair<XferStatus, Status>> p;
  auto f = p.get_future();
  auto started = first_put.get_future();
  ASSERT_TRUE(w->Post(*x, [&p](XferId, XferStatus s, const Status& d) { p.set_value({s, d}); }).ok());
  ASSERT_EQ(started.wait_for(20s), std::future_status::ready);
  helper.Kill();
  const auto [st, detail] = WaitDone(f, 10s);
  EXPECT_TRUE(st == XferStatus::kErrRemoteDisconnect || st == XferStatus::kErrBackend)
      << XferStatusName(st) << " " << detail.ToString();
  const StagingStats s = w->staging_stats();
  EXPECT_EQ(s.free_buffers, s.buffers);
  EXPECT_LT(w->BytesDone(*x), 4096 * kBlockBytes);
  EXPECT_TRUE(w->Release(*x).ok());
  EXPECT_TRUE(testing::WaitFor([&] { return w->host_transport().stats().live_requests == 0; }));
}

}  // namespace
}  // namespace tandem::kvtransfer
