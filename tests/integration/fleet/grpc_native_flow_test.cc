// The native front end writes the response DATA frames itself and counts the
// client's flow-control windows (docs/grpc-frontend.md "Response DATA and
// flow control"), on a real CPU 1P1D fleet with the gRPC C++ client as the
// peer: long streams through a small client window (BDP probe off) arrive
// token for token, a stream cancelled mid-way ends without disturbing the
// others, many streams share one connection; the client's WINDOW_UPDATEs
// are counted by the proxy, not by nghttp2 (which never sent that DATA
// and would refuse a window it saw grow past 2^31-1); windows pushed past
// 2^31-1 end the stream or the connection, and a SETTINGS change of the
// initial window moves the open streams' windows (raw frames).
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "raw_h2_client.h"
#include "shared_fleet_test.h"
#include "stream_suite.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::testing {
namespace {

namespace pb = ::tandem::v1;
constexpr uint32_t kVocab = 4096;
constexpr auto kWait = std::chrono::seconds(60);

class GrpcNativeFlow : public SharedFleetTest<GrpcNativeFlow> {
 public:
  static Result<FleetOptions> SuiteOptions() {
    FleetOptions o;  // 1P1D, CPU
    o.proxy_yaml = "  grpc_server: native\n";
    return o;
  }
};

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(700 + i, 12 + (i * 5) % 30, kVocab); }

// One channel (one HTTP/2 connection); `window` > 0: the client's stream
// window that small, not grown by BDP probes.
std::shared_ptr<grpc::Channel> Channel(const std::string& address, int window) {
  grpc::ChannelArguments args;
  if (window > 0) {
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, window);
  }
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

TEST_F(GrpcNativeFlow, LongStreamsThroughASmallClientWindowArriveExactAndACancelEndsOnlyItsOwn) {
  // 500 tokens per stream: ~10 KB and more of messages, many windows of 1 KB.
  auto suite = CancellingSuite(4, 500, Prompt, /*cancelled=*/2, /*cancel_after=*/5);
  suite.channel = Channel(fleet_->proxy_grpc(), 1024);
  suite.Run(*fleet_, /*cancel_one=*/true);
}

// Quiet reading (docs/grpc-frontend.md): a gRPC C++ client acknowledges
// every batch, so with 4 streams on its connection and room in the windows
// the batches' flushes read its acknowledgements every other batch; every
// token still arrives, and a cancel (RST_STREAM, below the mark) ends only
// its own stream, within those batches.
TEST_F(GrpcNativeFlow, FourStreamsReadEveryOtherBatchArriveExactAndACancelEndsOnlyItsOwn) {
  auto suite = CancellingSuite(4, 300, Prompt, /*cancelled=*/1, /*cancel_after=*/5);
  suite.channel = Channel(fleet_->proxy_grpc(), 0);
  suite.Run(*fleet_, /*cancel_one=*/true);
}

TEST_F(GrpcNativeFlow, ManyStreamsOnOneConnectionArriveExact) {
  auto suite = CancellingSuite(32, 40, Prompt, /*cancelled=*/7, /*cancel_after=*/2);
  suite.channel = Channel(fleet_->proxy_grpc(), 0);
  suite.Run(*fleet_, /*cancel_one=*/true);
}

// The client reads nothing until the request has ended at the workers: the
// proxy sends what the 1 KB window allows and holds the rest (merged into
// one message larger than the window), which arrives in window-sized DATA
// frames as the client reads.
TEST_F(GrpcNativeFlow, AGrpcClientThatReadsLateGetsEveryTokenThroughItsSmallWindow) {
  constexpr uint32_t kTokens = 300;  // merged: one message of ~1.5 KB
  auto stub = pb::Generation::NewStub(Channel(fleet_->proxy_grpc(), 1024));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(240));
  pb::GenerateRequest req;
  for (uint32_t t : Prompt(30)) req.add_prompt_token_ids(t);
  req.set_max_tokens(kTokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  // The request is in flight first (else the fleet looks idle before it
  // arrived), then has ended at the workers.
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto m = Scrape(fleet_->proxy_metrics());
        return m.ok() && MetricValue(*m, "tandem_requests_inflight") > 0;
      },
      std::chrono::seconds(60)));
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(120)), "");
  std::vector<uint32_t> tokens;
  pb::GenerateResponse resp;
  int messages = 0;
  while (reader->Read(&resp)) {
    tokens.insert(tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    ++messages;
  }
  const grpc::Status st = reader->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  auto ref = ReferenceGenerate(Prompt(30), kTokens);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(tokens, *ref);
  EXPECT_LT(messages, static_cast<int>(kTokens / 4)) << "the held tokens were not merged";
}

// The client opens the connection window to 2^31-1 at once, gets a
// response, then acknowledges that response's bytes: the proxy's count is
// back at 2^31-1, not above (had nghttp2 counted the updates without the
// DATA, that acknowledgement would have passed the limit, and it would
// have ended the connection with FLOW_CONTROL_ERROR). A second request on
// the connection is served.
TEST_F(GrpcNativeFlow, TheClientsUpdatesAreCountedWithTheDataTheyAcknowledge) {
  const std::vector<std::pair<std::string, std::string>> headers = {
      {"content-type", "application/grpc"}, {"te", "trailers"}};
  const std::string gen = "/tandem.v1.Generation/Generate";
  RawH2Client c(fleet_->proxy_grpc());
  ASSERT_TRUE(c.ok());
  c.UpdateWindow(0, 0x7fffffff - 65535);
  const int32_t first = c.Post(gen, headers, RawH2Client::Frame(GreedyGenerateRequest(Prompt(40), 64)));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(first).closed; }, kWait));
  ASSERT_EQ(c.response(first).GrpcStatus(), "0") << c.response(first).GrpcMessage();
  const size_t got = c.response(first).data.size();
  ASSERT_GT(got, 64u * 3);
  c.UpdateWindow(0, static_cast<int32_t>(got));
  const int32_t second = c.Post(gen, headers, RawH2Client::Frame(GreedyGenerateRequest(Prompt(41), 16)));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(second).closed; }, kWait))
      << "the connection ended after the acknowledgement";
  EXPECT_EQ(c.response(second).GrpcStatus(), "0") << c.response(second).GrpcMessage();
  auto ref = ReferenceGenerate(Prompt(41), 16);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(second)), *ref);
  auto ref_first = ReferenceGenerate(Prompt(40), 64);
  ASSERT_TRUE(ref_first.ok()) << ref_first.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(first)), *ref_first);
}

const std::vector<std::pair<std::string, std::string>> kGrpcHeaders = {
    {"content-type", "application/grpc"}, {"te", "trailers"}};
constexpr char kGenerate[] = "/tandem.v1.Generation/Generate";

// RFC 9113 6.9.1: a WINDOW_UPDATE that takes the connection's window past
// 2^31-1 is a connection error: GOAWAY FLOW_CONTROL_ERROR, and the
// connection closes; its request is cancelled at the workers and the proxy
// serves on. (nghttp2 refuses to send such an update: it goes raw.)
TEST_F(GrpcNativeFlow, AConnectionWindowPastTheLimitEndsTheConnectionWithFlowControlError) {
  RawH2Client c(fleet_->proxy_grpc());
  ASSERT_TRUE(c.ok());
  const int32_t id = c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(50), 400)));
  ASSERT_TRUE(c.RunUntil([&] { return !c.response(id).data.empty(); }, kWait));
  // The proxy's count of the window is 65,535 less the DATA it wrote plus the
  // client's updates: above 0, so this increment passes the limit.
  c.SendRaw(RawH2Client::WindowUpdateFrame(0, 0x7fffffff));
  ASSERT_TRUE(c.RunUntil([&] { return c.goaway(); }, kWait)) << "no GOAWAY";
  EXPECT_EQ(c.goaway_code(), static_cast<uint32_t>(NGHTTP2_FLOW_CONTROL_ERROR));
  EXPECT_TRUE(c.RunUntil([&] { return c.ended(); }, kWait)) << "the connection stayed open";
  EXPECT_FALSE(c.response(id).GrpcStatus() == "0") << "the stream ran to its end";
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(30)), "");
  GenerateArgs a;
  a.prompt_ids = Prompt(53);
  a.max_tokens = 8;
  auto got = Generate(fleet_->proxy_grpc(), a);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->token_ids.size(), 8u);
}

// ... and one that takes a stream's window past it is a stream error:
// RST_STREAM FLOW_CONTROL_ERROR for that stream only; another stream on the
// same connection runs to its end, token for token.
TEST_F(GrpcNativeFlow, AStreamWindowPastTheLimitResetsOnlyThatStream) {
  // 64-byte stream windows the client does not reopen by itself.
  RawH2Client c(fleet_->proxy_grpc(), /*window=*/64, /*auto_window=*/false);
  ASSERT_TRUE(c.ok());
  const int32_t bad = c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(54), 300)));
  const int32_t good = c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(55), 40)));
  ASSERT_TRUE(c.RunUntil([&] { return !c.response(bad).data.empty(); }, kWait));
  // `bad`'s window is 64 less what was written (0..64): the first update
  // takes it to at most 2^31-1, the second past it whatever it was. One
  // write, so no DATA can come between them (the client's own 64-byte
  // window would refuse it).
  c.SendRaw(RawH2Client::WindowUpdateFrame(bad, 0x7fffffff - 64) + RawH2Client::WindowUpdateFrame(bad, 65));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(bad).closed; }, kWait));
  EXPECT_EQ(c.response(bad).close_code, static_cast<uint32_t>(NGHTTP2_FLOW_CONTROL_ERROR));
  EXPECT_FALSE(c.goaway()) << "a stream error ended the connection";
  c.Consume(good);
  ASSERT_TRUE(c.RunUntil([&] { return c.response(good).closed; }, kWait));
  EXPECT_EQ(c.response(good).GrpcStatus(), "0") << c.response(good).GrpcMessage();
  auto ref = ReferenceGenerate(Prompt(55), 40);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(good)), *ref);
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(30)), "");
}

// SETTINGS_INITIAL_WINDOW_SIZE changed mid-connection moves the window of
// every open stream by the difference (RFC 9113 6.9.2): a stream held at
// its 64-byte window goes on to its end once the client raises the setting,
// without a single WINDOW_UPDATE for the stream. (A byte past the window
// would make the client's nghttp2 end the connection.)
TEST_F(GrpcNativeFlow, ASettingsChangeOfTheInitialWindowMovesTheOpenStreamsWindows) {
  constexpr uint32_t kTokens = 120;
  RawH2Client c(fleet_->proxy_grpc(), /*window=*/64, /*auto_window=*/false);
  ASSERT_TRUE(c.ok());
  const int32_t id = c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(56), kTokens)));
  ASSERT_TRUE(c.RunUntil([&] { return !c.response(id).data.empty(); }, kWait));
  // The request ends at the workers; the proxy holds what the window does not allow.
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(60)), "");
  c.Ping();
  ASSERT_TRUE(c.RunUntil([&] { return c.pings_acked() == 1; }, kWait));
  EXPECT_LE(c.response(id).data.size(), 64u);
  ASSERT_FALSE(c.response(id).closed);
  c.SetInitialWindow(1 << 20);
  ASSERT_TRUE(c.RunUntil([&] { return c.response(id).closed; }, kWait)) << "the stream stayed held";
  EXPECT_FALSE(c.goaway());
  EXPECT_EQ(c.response(id).GrpcStatus(), "0") << c.response(id).GrpcMessage();
  auto ref = ReferenceGenerate(Prompt(56), kTokens);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(id)), *ref);
}

// A client that acknowledges lazily (nghttp2: at half its 64 KB window)
// while one long stream runs on its connection: a PING and a new request
// are answered while the stream still runs (the connection reads one batch
// at a time: nothing it sends waits for acknowledgements that never come).
TEST_F(GrpcNativeFlow, ALazyAcknowledgerGetsItsPingAndNewRequestAnsweredMidStream) {
  constexpr uint32_t kLong = 400, kShort = 8;
  RawH2Client c(fleet_->proxy_grpc());
  ASSERT_TRUE(c.ok());
  const int32_t long_id = c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(60), kLong)));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(long_id).data.size() > 512; }, kWait));
  c.Ping();
  ASSERT_TRUE(c.RunUntil([&] { return c.pings_acked() == 1; }, kWait));
  EXPECT_FALSE(c.response(long_id).closed) << "the PING was answered only after the stream";
  const int32_t short_id =
      c.Post(kGenerate, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(61), kShort)));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(short_id).closed; }, kWait));
  EXPECT_FALSE(c.response(long_id).closed) << "the new request was answered only after the stream";
  EXPECT_EQ(c.response(short_id).GrpcStatus(), "0") << c.response(short_id).GrpcMessage();
  ASSERT_TRUE(c.RunUntil([&] { return c.response(long_id).closed; }, kWait));
  EXPECT_EQ(c.response(long_id).GrpcStatus(), "0") << c.response(long_id).GrpcMessage();
  auto ref = ReferenceGenerate(Prompt(60), kLong);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(long_id)), *ref);
  auto ref_short = ReferenceGenerate(Prompt(61), kShort);
  ASSERT_TRUE(ref_short.ok()) << ref_short.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(short_id)), *ref_short);
}

}  // namespace
}  // namespace tandem::testing
