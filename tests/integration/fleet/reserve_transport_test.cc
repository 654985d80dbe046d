// Issue 23 (docs/serving-workers.md "Reserve transport"): the prefiller's
// Decoder.Reserve on a real 1P1D fleet. By default it travels over the
// decoder's framed TCP listener (decode.reserve_listen, the fleet's mutual
// TLS): 16 concurrent requests of different prompt lengths arrive
// token-exact equal to `tandem generate`, a cancelled one disturbs none and
// nothing stays held. With prefill.reserve_transport grpc, and with a
// decoder whose listener is off, the prefiller uses the gRPC
// Decoder.Reserve with the same outputs. Also: a default fleet's proxy
// runs no gRPC thread (its credentials' gRPC objects are made on first
// use, which a default fleet never has). (The failure, retry, migration
// and security suites run over the default transport; ctest re-runs
// retry_test with TANDEM_TEST_RESERVE_TRANSPORT=grpc, which this suite also
// honours.)
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "stream_suite.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(1300 + i, 5 + (i * 41) % 200, kVocab); }

// 16 streams of different prompt lengths; stream 6 is cancelled after its
// first message (the prefill's token).
const StreamSuite& Suite() {
  static const StreamSuite suite = CancellingSuite(16, 12, Prompt, 6, 1);
  return suite;
}

double Connections(const Fleet& fleet) {
  return RoleMetric(fleet, "decode", "tandem_reserve_tcp_connections_total");
}

// Whether the suite runs with reserve_transport grpc (a ctest re-run).
bool GrpcByEnv() {
  const char* env = getenv("TANDEM_TEST_RESERVE_TRANSPORT");
  return env != nullptr && std::string(env) == "grpc";
}

// The names of the process's threads.
std::vector<std::string> ThreadNames(pid_t pid) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid))) {
    std::ifstream in(e.path() / "comm");
    std::string name;
    std::getline(in, name);
    out.push_back(name);
  }
  return out;
}

TEST(ReserveTransport, TcpByDefaultEqualsGenerateAndTheProxyRunsNoGrpc) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  Suite().References();
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Suite().Run(**fleet, /*cancel_one=*/true);
  // Over the decoder's framed TCP listener (one connection from the
  // prefiller), unless this run asked for gRPC.
  EXPECT_EQ(Connections(**fleet), GrpcByEnv() ? 0 : 1);
  // gRPC is never initialised in the proxy: none of its threads (the iomgr
  // timer, the EventEngine's timer manager, the callback CQ's) exists.
  for (const std::string& name : ThreadNames((*fleet)->proxy_pid())) {
    EXPECT_EQ(name.rfind("grpc", 0), std::string::npos) << name;
    EXPECT_NE(name, "timer_manager");
    EXPECT_NE(name, "nexting_thread");
  }
}

TEST(ReserveTransport, GrpcTransportGivesTheSameOutput) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  Suite().References();
  FleetOptions o;
  o.prefill_yaml = "  reserve_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Suite().Run(**fleet, /*cancel_one=*/true);
  EXPECT_EQ(Connections(**fleet), 0);
}

TEST(ReserveTransport, ADecoderWithoutAListenerGetsGrpc) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  Suite().References();
  FleetOptions o;
  o.decode_yaml = "  reserve_listen: off\n";  // the prefiller asks for tcp; the decoder offers none
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Suite().Run(**fleet, /*cancel_one=*/true);
  EXPECT_EQ(Connections(**fleet), 0);
}

}  // namespace
}  // namespace tandem::testing
