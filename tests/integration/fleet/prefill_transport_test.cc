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

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kStreams = 16;
constexpr uint32_t kMaxTokens = 12;
constexpr uint32_t kCancelled = 5;  // cancelled after its first message (the prefill's token)

bool HaveModel() { return std::filesystem::exists(BundledModel() + "/model.safetensors"); }

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(900 + i, 5 + (i * 37) % 200, kVocab); }

const std::vector<std::vector<uint32_t>>& References() {
  static std::vector<std::vector<uint32_t>> refs = [] {
    std::vector<std::vector<uint32_t>> r;
    for (uint32_t i = 0; i < kStreams; ++i) {
      auto ids = ReferenceGenerate(Prompt(i), kMaxTokens);
      EXPECT_TRUE(ids.ok()) << ids.status().ToString();
      r.push_back(ids.ok() ? *ids : std::vector<uint32_t>{});
    }
    return r;
  }();
  return refs;
}

double PrefillerMetric(const Fleet& fleet, const std::string& name) {
  double v = 0;
  for (const auto& w : fleet.workers()) {
    if (w.role != "prefill") continue;
    auto m = Scrape(w.metrics);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) v += MetricValue(*m, name);
  }
  return v;
}

// Whether the suite runs with proxy.prefill_transport grpc (the ctest re-run).
bool GrpcByEnv() {
  const char* env = getenv("TANDEM_TEST_PREFILL_TRANSPORT");
  return env != nullptr && std::string(env) == "grpc";
}

struct Outcome {
  std::vector<uint32_t> tokens;
  grpc::Status status;
};

Outcome Stream(const std::string& proxy, const std::vector<uint32_t>& prompt, bool cancel) {
  auto stub = tandem::v1::Generation::NewStub(
      grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  tandem::v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(cancel ? 400 : kMaxTokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  Outcome o;
  tandem::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    o.tokens.insert(o.tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    if (cancel) ctx.TryCancel();
  }
  o.status = reader->Finish();
  return o;
}

void RunStreams(const Fleet& fleet) {
  const auto& refs = References();
  std::vector<std::future<Outcome>> futures;
  for (uint32_t i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      return Stream(fleet.proxy_grpc(), Prompt(i), i == kCancelled);
    }));
  }
  for (uint32_t i = 0; i < kStreams; ++i) {
    Outcome o = futures[i].get();
    if (i == kCancelled) {
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::CANCELLED) << o.status.error_message();
      const size_t n = std::min<size_t>(o.tokens.size(), refs[i].size());
      EXPECT_EQ(std::vector<uint32_t>(o.tokens.begin(), o.tokens.begin() + n),
                std::vector<uint32_t>(refs[i].begin(), refs[i].begin() + n));
      continue;
    }
    ASSERT_TRUE(o.status.ok()) << "stream " << i << ": " << o.status.error_message();
    EXPECT_EQ(o.tokens, refs[i]) << "stream " << i;
  }
  // Nothing is held anywhere once they ended (the cancelled one included).
  EXPECT_EQ(WaitFleetIdle(fleet.workers(), fleet.proxy_metrics(), std::chrono::seconds(20)), "");
}

TEST(PrefillTransport, TcpByDefaultEqualsGenerateAndACancelDisturbsNone) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
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
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  prefill_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet);
  EXPECT_EQ(PrefillerMetric(**fleet, "tandem_prefill_tcp_connections_total"), 0);
}

TEST(PrefillTransport, APrefillerWithoutAListenerGetsGrpc) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
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
