// Issue 23 (docs/serving-workers.md "Prefill transport"): the proxy's
// Prefill call on a real 1P1D fleet. By default it travels over the
// prefiller's framed TCP listener (prefill.frame_listen, the fleet's mutual
// TLS): 16 concurrent requests of different prompt lengths arrive
// token-exact equal to `tandem generate`, a cancelled one disturbs none and
// nothing stays held. With proxy.prefill_transport grpc, and with a
// prefiller whose listener is off, the proxy uses Prefiller.Prefill over
// gRPC with the same outputs. (The failure, retry, migration and security
// suites run over the default transport; ctest re-runs retry_test with
// TANDEM_TEST_PREFILL_TRANSPORT=grpc, which this suite also honours.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "stream_suite.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(900 + i, 5 + (i * 37) % 200, kVocab); }

// 16 streams of different prompt lengths; stream 5 is cancelled after its
// first message (the prefill's token).
const StreamSuite& Suite() {
  static const StreamSuite suite = CancellingSuite(16, 12, Prompt, 5, 1);
  return suite;
}

const std::vector<std::vector<uint32_t>>& References() { return Suite().References(); }

double PrefillerMetric(const Fleet& fleet, const std::string& name) {
  return RoleMetric(fleet, "prefill", name);
}

// Whether the suite runs with proxy.prefill_transport grpc (the ctest re-run).
bool GrpcByEnv() {
  const char* env = getenv("TANDEM_TEST_PREFILL_TRANSPORT");
  return env != nullptr && std::string(env) == "grpc";
}

void RunStreams(const Fleet& fleet) { Suite().Run(fleet, /*cancel_one=*/true); }

TEST(PrefillTransport, TcpByDefaultEqualsGenerateAndACancelDisturbsNone) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  auto fleet = Fleet::Launch(FleetOptions{});
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet);
  // Over the prefiller's framed TCP listener (one connection from the
  // proxy), unless this run asked for gRPC.
  const double connections = PrefillerMetric(**fleet, "tandem_prefill_tcp_connections_total");
  if (GrpcByEnv()) {
    EXPECT_EQ(connections, 0);
  } else {
    EXPECT_EQ(connections, 1);
  }
}

TEST(PrefillTransport, GrpcTransportGivesTheSameOutput) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  prefill_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet);
  EXPECT_EQ(PrefillerMetric(**fleet, "tandem_prefill_tcp_connections_total"), 0);
}

TEST(PrefillTransport, APrefillerWithoutAListenerGetsGrpc) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.prefill_yaml = "  frame_listen: off\n";  // the proxy asks for tcp; the prefiller offers none
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet);
  EXPECT_EQ(PrefillerMetric(**fleet, "tandem_prefill_tcp_connections_total"), 0);
}

}  // namespace
}  // namespace tandem::testing
