// Issue 23: the multiplexed decoder -> proxy stream (Decoder.DecodeStream)
// on a real 1P1D fleet. 32 concurrent streams through one decoder arrive
// token-exact equal to `tandem generate`, a step's tokens travel together
// (fewer messages than items on the decoder's stream), and cancelling one
// request mid-stream neither disturbs the others nor leaves anything held.
// The stream travels over the decoder's framed TCP listener by default and
// over gRPC with proxy.decode_transport grpc, with the same outputs.
// With proxy.decode_stream off the proxy uses one Decode RPC per request
// (the decoder sends nothing on a DecodeStream) and the output is the same.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kStreams = 32;
constexpr uint32_t kMaxTokens = 24;
constexpr uint32_t kCancelled = 7;  // this stream is cancelled after a few messages
constexpr uint32_t kCancelledMaxTokens = 400;

bool HaveModel() { return std::filesystem::exists(BundledModel() + "/model.safetensors"); }

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(500 + i, 8 + (i * 13) % 90, kVocab); }

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

double DecoderMetric(const Fleet& fleet, const std::string& name) {
  double v = 0;
  for (const auto& w : fleet.workers()) {
    if (w.role != "decode") continue;
    auto m = Scrape(w.metrics);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) v += MetricValue(*m, name);
  }
  return v;
}

struct Outcome {
  std::vector<uint32_t> tokens;
  int messages = 0;
  grpc::Status status;
};

// One Generate stream; with `cancel_after` > 0 the client cancels it after
// that many messages.
Outcome Stream(const std::string& proxy, const std::vector<uint32_t>& prompt, uint32_t max_tokens,
               int cancel_after) {
  auto stub = tandem::v1::Generation::NewStub(
      grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  tandem::v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  Outcome o;
  tandem::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    o.tokens.insert(o.tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    if (++o.messages == cancel_after) ctx.TryCancel();
  }
  o.status = reader->Finish();
  return o;
}

void RunStreams(const Fleet& fleet, bool cancel_one) {
  const auto& refs = References();
  std::vector<std::future<Outcome>> futures;
  for (uint32_t i = 0; i < kStreams; ++i) {
    const bool cancel = cancel_one && i == kCancelled;
    futures.push_back(std::async(std::launch::async, [&, i, cancel] {
      return Stream(fleet.proxy_grpc(), Prompt(i), cancel ? kCancelledMaxTokens : kMaxTokens,
                    cancel ? 3 : 0);
    }));
  }
  for (uint32_t i = 0; i < kStreams; ++i) {
    Outcome o = futures[i].get();
    if (cancel_one && i == kCancelled) {
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::CANCELLED) << o.status.error_message();
      EXPECT_LT(o.tokens.size(), kCancelledMaxTokens);
      // What it got before the cancel is the start of the same completion.
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

TEST(DecodeStream, ThirtyTwoStreamsThroughOneDecoderEqualGenerateAndACancelDisturbsNone) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;  // proxy.decode_stream defaults to true
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const double messages0 = DecoderMetric(**fleet, "tandem_decode_stream_messages_total");
  const double items0 = DecoderMetric(**fleet, "tandem_decode_stream_items_total");

  RunStreams(**fleet, /*cancel_one=*/true);

  const double messages = DecoderMetric(**fleet, "tandem_decode_stream_messages_total") - messages0;
  const double items = DecoderMetric(**fleet, "tandem_decode_stream_items_total") - items0;
  // Every request went over the stream (each has at least a `registered`
  // and a final item), and steps of several requests shared messages.
  EXPECT_GE(items, 2.0 * kStreams);
  EXPECT_GT(messages, 0);
  EXPECT_LT(messages, items) << "no message carried more than one request's items";
  // ... over the decoder's framed TCP listener (proxy.decode_transport tcp,
  // the default; mutual TLS as every internal connection of the fleet).
  EXPECT_GE(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 1.0);

  // The stream stays usable after the cancel.
  auto again = Generate((*fleet)->proxy_grpc(), [] {
    GenerateArgs a;
    a.prompt_ids = Prompt(3);
    a.max_tokens = kMaxTokens;
    return a;
  }());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->token_ids, References()[3]);
}

TEST(DecodeStream, GrpcTransportCarriesTheSameStreamWithTheSameOutput) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  decode_transport: grpc\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/true);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 0);
}

TEST(DecodeStream, ADecoderWithoutATcpListenerGetsTheGrpcStream) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.decode_yaml = "  mux_listen: off\n";  // the proxy asks for tcp; the decoder offers none
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/false);
  EXPECT_GT(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_mux_tcp_connections_total"), 0);
}

TEST(DecodeStream, OffUsesOneDecodeCallPerRequestWithTheSameOutput) {
  if (!HaveModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  References();
  FleetOptions o;
  o.proxy_yaml = "  decode_stream: false\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  RunStreams(**fleet, /*cancel_one=*/false);
  EXPECT_EQ(DecoderMetric(**fleet, "tandem_decode_stream_messages_total"), 0);
}

}  // namespace
}  // namespace tandem::testing
