// Two real processes over UCX on this host: this test process and
// kvtransfer_peer (tests/unit/kvtransfer/kv_peer_main.cc), started with
// fork/exec. Covers the UCX traps named in issue 4:
//   - fork: the helper is spawned before this process touches UCX (the order
//     `tandem launch` uses), and also after (exec right away is safe);
//   - shared memory silently skipped for TCP: with tandem's defaults the
//     endpoint must use shared memory; with the operator forcing shared-memory
//     error handling off, it must not (and the operator's choice wins);
//   - active messages over shared memory after a peer was killed
//     (openucx/ucx#10370): a writer is SIGKILLed mid-stream and a restarted
//     writer's notices must still arrive.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <sstream>

#include "../../unit/kvtransfer/kv_test_util.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using testing::Checksum;
using testing::ChildProcess;
using testing::FillRandom;
using testing::WaitFor;
using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1ull << 20;

std::unique_ptr<Transport> Make(const std::string& name, uint64_t block_bytes, uint32_t blocks) {
  TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = blocks;
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

std::vector<std::string> TargetArgs(const std::string& name, uint64_t block_bytes,
                                    uint32_t blocks) {
  return {KV_PEER_BIN,
          "target",
          "backend=ucx",
          "name=" + name,
          "block_bytes=" + std::to_string(block_bytes),
          "blocks=" + std::to_string(blocks)};
}

std::string ReadDescriptor(ChildProcess& child) {
  auto hex = child.Expect("DESC ");
  EXPECT_TRUE(hex.has_value()) << "helper did not print its descriptor";
  if (!hex) return "";
  auto bytes = FromHex(*hex);
  EXPECT_TRUE(bytes.ok());
  return bytes.ok() ? *bytes : "";
}

// Writes unaligned byte ranges and whole blocks into the helper's pool and
// checks them there by checksum, plus notices. Returns the transports used.
std::string WriteIntoHelperAndVerify(Transport& t, ChildProcess& helper, const std::string& desc) {
  auto peer = t.ImportPeer(desc);
  EXPECT_TRUE(peer.ok()) << peer.status().ToString();
  if (!peer.ok()) return "";
  FillRandom(t.pool(), t.pool_bytes(), 77);
  const std::vector<Segment> segments = {{1, 5, 1},
                                         {100, 3000, 4097},
                                         {3 * kMiB + 7, 1 * kMiB + 1, 5 * kMiB + 3},
                                         {0, 10 * kMiB, 6 * kMiB}};
  int n = 0;
  for (const Segment& s : segments) {
    auto x = t.PrepareWrite(*peer, {s}, "seg" + std::to_string(n++));
    EXPECT_TRUE(x.ok()) << x.status().ToString();
    if (!x.ok()) continue;
    EXPECT_TRUE(t.Post(*x).ok());
    WaitFor([&] { return IsTerminal(t.Poll(*x)); }, 20s);
    Status detail;
    EXPECT_EQ(t.Poll(*x, &detail), XferStatus::kSuccess) << detail.ToString();
    EXPECT_TRUE(t.Release(*x).ok());
    helper.Send("SUM " + std::to_string(s.remote_offset_bytes) + " " +
                std::to_string(s.length_bytes));
    auto sum = helper.Expect("SUM ");
    EXPECT_TRUE(sum.has_value());
    EXPECT_EQ(*sum, std::to_string(Checksum(t.pool() + s.local_offset_bytes, s.length_bytes)))
        << "segment of " << s.length_bytes << " bytes";
  }
  helper.Send("NOTICES 4 10000");
  auto notices = helper.Expect("NOTICES ");
  EXPECT_EQ(notices.value_or(""), "4 seg0,seg1,seg2,seg3");
  auto tl = t.TransportsInUse(*peer);
  EXPECT_TRUE(tl.ok());
  EXPECT_TRUE(t.ReleasePeer(*peer).ok());
  EXPECT_EQ(t.stats().live_remote_keys, 0u);
  return tl.value_or("");
}

bool UsesSharedMemory(const std::string& transports) {
  return transports.find("posix") != std::string::npos ||
         transports.find("sysv") != std::string::npos;
}

// `tandem launch` order: fork/exec the other process, then start UCX here.
TEST(TwoProcesses, HelperSpawnedBeforeUcxInit) {
  if (std::getenv("UCX_TLS") != nullptr) GTEST_SKIP() << "UCX_TLS is set by the environment";
  ChildProcess helper(TargetArgs("ip-target-1", kMiB, 20));
  ASSERT_TRUE(helper.ok());
  auto t = Make("ip-writer-1", kMiB, 20);
  ASSERT_TRUE(t);
  const std::string transports = WriteIntoHelperAndVerify(*t, helper, ReadDescriptor(helper));
  std::cout << "transports in use: " << transports << "\n";
  EXPECT_TRUE(UsesSharedMemory(transports)) << "shared memory was skipped: " << transports;
  helper.Send("QUIT");
  int code = -1;
  EXPECT_TRUE(helper.Reap(10s, &code));
  EXPECT_EQ(code, 0);
}

// UCX initialised first, then fork/exec: exec discards the copied UCX state.
TEST(TwoProcesses, HelperSpawnedAfterUcxInit) {
  auto t = Make("ip-writer-2", kMiB, 20);
  ASSERT_TRUE(t);
  ChildProcess helper(TargetArgs("ip-target-2", kMiB, 20));
  ASSERT_TRUE(helper.ok());
  const std::string transports = WriteIntoHelperAndVerify(*t, helper, ReadDescriptor(helper));
  EXPECT_FALSE(transports.empty());
}

// The trap itself: shared-memory transports refuse peer error handling unless
// told otherwise, and UCX then falls back to other transports without a word.
// An operator who sets the variables gets exactly that, and the bench and
// TransportsInUse say so.
TEST(TwoProcesses, OperatorSettingWinsAndShowsTheFallback) {
  setenv("UCX_POSIX_ERROR_HANDLING", "n", 1);
  setenv("UCX_SYSV_ERROR_HANDLING", "n", 1);
  ChildProcess helper(TargetArgs("ip-target-3", kMiB, 20));
  ASSERT_TRUE(helper.ok());
  auto t = Make("ip-writer-3", kMiB, 20);
  ASSERT_TRUE(t);
  const std::string transports = WriteIntoHelperAndVerify(*t, helper, ReadDescriptor(helper));
  std::cout << "transports without shared-memory error handling: " << transports << "\n";
  EXPECT_FALSE(UsesSharedMemory(transports)) << transports;
  EXPECT_FALSE(transports.empty());
  unsetenv("UCX_POSIX_ERROR_HANDLING");
  unsetenv("UCX_SYSV_ERROR_HANDLING");
}

// openucx/ucx#10370 shape: a writer is killed while it streams writes and
// notices into this process; a restarted writer must still get its data and
// notices through.
TEST(TwoProcesses, RestartedWriterAfterKillStillDelivers) {
  const uint64_t bb = 256 * 1024;
  const uint32_t blocks = 16;
  auto t = Make("ip-decoder", bb, blocks);
  ASSERT_TRUE(t);
  const std::string desc_hex = ToHex(t->LocalDescriptor());
  auto writer_args = [&](const std::string& requests, const std::string& seed) {
    return std::vector<std::string>{KV_PEER_BIN,
                                    "writer",
                                    "backend=ucx",
                                    "name=ip-prefill",
                                    "block_bytes=" + std::to_string(bb),
                                    "blocks=" + std::to_string(blocks),
                                    "target=" + desc_hex,
                                    "requests=" + requests,
                                    "seed=" + seed};
  };
  {
    ChildProcess first(writer_args("0", "1"));
    ASSERT_TRUE(first.ok());
    ASSERT_TRUE(first.Expect("DONE 3 SUCCESS").has_value()) << "first writer did not stream";
    first.Kill();
  }
  ChildProcess second(writer_args("5", "2"));
  ASSERT_TRUE(second.ok());
  auto sum = second.Expect("SUM ");
  ASSERT_TRUE(sum.has_value());
  for (int r = 0; r < 5; ++r) {
    EXPECT_TRUE(second.Expect("DONE " + std::to_string(r) + " SUCCESS", 10s).has_value()) << r;
  }
  auto transports = second.Expect("TRANSPORTS ");
  std::cout << "writer transports: " << transports.value_or("?") << "\n";
  std::set<std::string> from_second;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (auto& n : t->TakeNotifications()) {
          if (n.payload.rfind("ip-prefill:", 0) == 0 && n.sender_generation != 0) {
            from_second.insert(n.payload + "@" + std::to_string(n.sender_generation));
          }
        }
        std::set<std::string> latest;
        for (const auto& p : from_second) latest.insert(p.substr(0, p.find('@')));
        return latest.count("ip-prefill:4") > 0;
      },
      10s));
  EXPECT_EQ(*sum, std::to_string(Checksum(t->pool(), t->pool_bytes())))
      << "the restarted writer's data is not what this process holds";
  second.Send("QUIT");
}

}  // namespace
}  // namespace tandem::kvtransfer
