// Issue 23: the proxy's native HTTP/2 gRPC front end (proxy.grpc_server:
// native, docs/grpc-frontend.md) on a real CPU 1P1D fleet. gRPC C++ clients
// get the same tokens as `tandem generate`; a client's RST_STREAM frees
// everything at the workers; what gRPC clients never send (a wrong
// content-type, a compressed, truncated or oversized message, an unknown
// method, a malformed grpc-timeout) gets a status that says what is wrong,
// health Check and Watch answer SERVING;
// a client that stops reading neither blocks other streams nor loses
// tokens (its backlog is merged, not queued message by message); a small
// window the client reopens as it reads stalls no stream and delays no
// request or PING (grpc_native_flow_test.cc has more on flow control).
// The other fleet suites run against this front end with
// TANDEM_TEST_GRPC_SERVER=native (fleet_harness.cc).
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "raw_h2_client.h"
#include "shared_fleet_test.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

namespace pb = ::tandem::v1;
constexpr uint32_t kVocab = 4096;
constexpr auto kWait = std::chrono::seconds(60);

class GrpcNative : public SharedFleetTest<GrpcNative> {
 public:
  static Result<FleetOptions> SuiteOptions() {
    FleetOptions o;  // 1P1D, CPU
    o.proxy_yaml =
        "  grpc_server: native\n  limits:\n    max_request_bytes: 4096\n"
        "    max_connections: 16\n    handshake_timeout_seconds: 2\n";
    return o;
  }
};

std::vector<uint32_t> Prompt(uint32_t i) { return PromptIds(900 + i, 10 + (i * 7) % 40, kVocab); }

const std::vector<std::pair<std::string, std::string>> kGrpcHeaders = {
    {"content-type", "application/grpc"}, {"te", "trailers"}};

TEST_F(GrpcNative, GrpcClientsGetTheTokensOfTandemGenerateAndTheModelList) {
  static constexpr uint32_t kStreams = 8, kMaxTokens = 20;
  std::vector<std::future<Result<Completion>>> futures;
  for (uint32_t i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [i] {
      GenerateArgs a;
      a.prompt_ids = Prompt(i);
      a.max_tokens = kMaxTokens;
      return Generate(fleet_->proxy_grpc(), a);
    }));
  }
  for (uint32_t i = 0; i < kStreams; ++i) {
    auto got = futures[i].get();
    ASSERT_TRUE(got.ok()) << "stream " << i << ": " << got.status().ToString();
    auto ref = ReferenceGenerate(Prompt(i), kMaxTokens);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    EXPECT_EQ(got->token_ids, *ref) << "stream " << i;
  }
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(fleet_->proxy_grpc(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  pb::ListModelsResponse models;
  ASSERT_TRUE(stub->ListModels(&ctx, pb::ListModelsRequest(), &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_GT(models.models(0).vocab_size(), 0u);
  EXPECT_EQ(models.models(0).block_size(), 16u);
}

TEST_F(GrpcNative, ClientCancelFreesEverythingAtTheWorkers) {
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(fleet_->proxy_grpc(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  pb::GenerateRequest req;
  for (uint32_t t : Prompt(1)) req.add_prompt_token_ids(t);
  req.set_max_tokens(500);
  req.set_ignore_eos(true);
  auto reader = stub->Generate(&ctx, req);
  pb::GenerateResponse resp;
  size_t tokens = 0;
  int messages = 0;
  while (reader->Read(&resp)) {
    tokens += resp.token_ids_size();
    if (++messages == 3) ctx.TryCancel();  // RST_STREAM(CANCEL) on the wire
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(tokens, 500u);
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(20)), "");
}

TEST_F(GrpcNative, WhatGrpcClientsNeverSendGetsAStatusNamingTheProblem) {
  RawH2Client c(fleet_->proxy_grpc());
  ASSERT_TRUE(c.ok());
  const std::string gen = "/tandem.v1.Generation/Generate";
  const std::string small = GreedyGenerateRequest(Prompt(2), 4);
  const int32_t text_plain = c.Post(gen, {{"content-type", "text/plain"}}, RawH2Client::Frame(small));
  const int32_t oversized = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(std::string(5000, 'x')));
  const int32_t compressed = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(small, true));
  const int32_t truncated = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(small).substr(0, 9));
  const int32_t empty = c.Post(gen, kGrpcHeaders, "");
  const int32_t two = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(small) + RawH2Client::Frame(small));
  const int32_t unknown = c.Post("/tandem.v1.Generation/Nope", kGrpcHeaders, RawH2Client::Frame(""));
  auto timeout_headers = kGrpcHeaders;
  timeout_headers.push_back({"grpc-timeout", "10 seconds"});
  const int32_t bad_timeout = c.Post(gen, timeout_headers, RawH2Client::Frame(small));
  // The longest timeout the header can say (~11,400 years: past int64
  // nanoseconds) is no deadline, not an overflowed one (session 47).
  auto longest_headers = kGrpcHeaders;
  longest_headers.push_back({"grpc-timeout", "99999999H"});
  const int32_t longest = c.Post(gen, longest_headers, RawH2Client::Frame(small));
  const int32_t health = c.Post("/grpc.health.v1.Health/Check", kGrpcHeaders, RawH2Client::Frame(""));
  const int32_t fine = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(small));
  const int32_t watch = c.Post("/grpc.health.v1.Health/Watch", kGrpcHeaders, RawH2Client::Frame(""));
  const std::vector<int32_t> all = {text_plain, oversized,   compressed, truncated, empty, two,
                                    unknown,    bad_timeout, longest,    health,    fine};
  ASSERT_TRUE(c.RunUntil(
      [&] {
        for (int32_t id : all) {
          if (!c.response(id).closed) return false;
        }
        return true;
      },
      kWait));
  auto expect = [&](int32_t id, const char* status, const char* needle) {
    const auto& r = c.response(id);
    EXPECT_EQ(r.GrpcStatus(), status) << "stream " << id << ": " << r.GrpcMessage();
    EXPECT_NE(r.GrpcMessage().find(needle), std::string::npos)
        << "stream " << id << ": " << r.GrpcMessage();
  };
  {
    const auto& h = c.response(text_plain).headers;
    auto it = h.find(":status");
    EXPECT_EQ(it == h.end() ? "none" : it->second, "415");
  }
  expect(text_plain, "3", "content-type 'text/plain' is not application/grpc");
  expect(oversized, "3", "5000 bytes; the limit is 4096 (proxy.limits.max_request_bytes)");
  expect(compressed, "12", "compressed messages are not supported");
  expect(truncated, "3", "ended inside its gRPC message");
  expect(empty, "3", "carries no gRPC message");
  expect(two, "3", "more than one message");
  expect(unknown, "12", "/tandem.v1.Generation/Nope");
  expect(bad_timeout, "3", "grpc-timeout '10 seconds' is malformed");
  // Health: SERVING (1), and a normal request on the same connection works.
  EXPECT_EQ(c.response(health).GrpcStatus(), "0");
  EXPECT_EQ(RawH2Client::Messages(c.response(health).data), std::vector<std::string>{"\x08\x01"});
  // Watch: the current status (SERVING) at once; the stream stays open.
  ASSERT_TRUE(c.RunUntil([&] { return !c.response(watch).data.empty(); }, kWait));
  EXPECT_EQ(RawH2Client::Messages(c.response(watch).data), std::vector<std::string>{"\x08\x01"});
  EXPECT_FALSE(c.response(watch).closed);
  EXPECT_EQ(c.response(fine).GrpcStatus(), "0") << c.response(fine).GrpcMessage();
  EXPECT_EQ(GenerateTokens(c.response(fine)).size(), 4u);
  EXPECT_EQ(c.response(longest).GrpcStatus(), "0") << c.response(longest).GrpcMessage();
  EXPECT_EQ(GenerateTokens(c.response(longest)).size(), 4u);
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(20)), "");
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo, as
// grpcurl uses it: list the services, then the file that declares one
// (with its imports), each answered on the open stream.
TEST_F(GrpcNative, ReflectionListsTheServicesAndServesTheirFiles) {
  RawH2Client c(fleet_->proxy_grpc());
  ASSERT_TRUE(c.ok());
  const std::string list = std::string("\x3a\x00", 2);  // list_services = ""
  const std::string symbol = "tandem.v1.Generation";
  const std::string by_symbol = "\x22" + std::string(1, static_cast<char>(symbol.size())) + symbol;
  const std::string nope = "no.such.Symbol";
  const std::string missing = "\x22" + std::string(1, static_cast<char>(nope.size())) + nope;
  const int32_t id = c.Post("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                            kGrpcHeaders,
                            RawH2Client::Frame(list) + RawH2Client::Frame(by_symbol) +
                                RawH2Client::Frame(missing));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(id).closed; }, kWait));
  EXPECT_EQ(c.response(id).GrpcStatus(), "0") << c.response(id).GrpcMessage();
  const auto answers = RawH2Client::Messages(c.response(id).data);
  ASSERT_EQ(answers.size(), 3u);
  for (const char* service : {"tandem.v1.Generation", "grpc.health.v1.Health",
                              "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_NE(answers[0].find(service), std::string::npos) << service;
  }
  // The file declaring the service, as a FileDescriptorProto.
  EXPECT_NE(answers[1].find("tandem/v1/generation.proto"), std::string::npos);
  EXPECT_NE(answers[1].find("GenerateRequest"), std::string::npos);
  // An unknown symbol: error_response NOT_FOUND (5) naming it.
  EXPECT_NE(answers[2].find("symbol 'no.such.Symbol' not found"), std::string::npos);
}

TEST_F(GrpcNative, AClientThatStopsReadingBlocksNoOneAndLosesNoToken) {
  constexpr uint32_t kMaxTokens = 300;
  // A 64-byte stream window that the client does not reopen: the proxy can
  // send about one message, then must hold the rest.
  RawH2Client slow(fleet_->proxy_grpc(), /*window=*/64, /*auto_window=*/false);
  ASSERT_TRUE(slow.ok());
  const int32_t id = slow.Post("/tandem.v1.Generation/Generate", kGrpcHeaders,
                               RawH2Client::Frame(GreedyGenerateRequest(Prompt(5), kMaxTokens)));
  ASSERT_TRUE(slow.RunUntil([&] { return !slow.response(id).data.empty(); }, kWait));
  // Meanwhile other clients are served to the end.
  for (uint32_t i = 0; i < 3; ++i) {
    GenerateArgs a;
    a.prompt_ids = Prompt(10 + i);
    a.max_tokens = 16;
    auto got = Generate(fleet_->proxy_grpc(), a);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->token_ids.size(), 16u);
  }
  // The slow stream's request ends at the workers although the client has
  // read almost nothing: the proxy holds its tokens, not the decoder.
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(30)), "");
  EXPECT_FALSE(slow.response(id).closed);
  // Now it reads: every token arrives, in far fewer messages than tokens.
  slow.Consume(id);
  ASSERT_TRUE(slow.RunUntil([&] { return slow.response(id).closed; }, kWait));
  EXPECT_EQ(slow.response(id).GrpcStatus(), "0") << slow.response(id).GrpcMessage();
  const std::vector<uint32_t> tokens = GenerateTokens(slow.response(id));
  const auto messages = RawH2Client::Messages(slow.response(id).data);
  auto ref = ReferenceGenerate(Prompt(5), kMaxTokens);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(tokens, *ref);
  EXPECT_LT(messages.size(), kMaxTokens / 4) << "the held tokens were not merged";
}

// Flow control is the proxy's (docs/grpc-frontend.md "Response DATA and
// flow control"): a 512-byte stream window that the client reopens as it
// reads (nghttp2's automatic updates, at half the window) holds the stream
// back and lets it go on at each update: every token still arrives, in
// order; a PING and a new request on the busy connection are answered
// while the first stream still runs.
TEST_F(GrpcNative, ASmallWindowReopenedAsTheClientReadsStallsNoStreamAndDelaysNoRequestOrPing) {
  constexpr uint32_t kLong = 400, kShort = 8;
  RawH2Client c(fleet_->proxy_grpc(), /*window=*/512);
  ASSERT_TRUE(c.ok());
  const std::string gen = "/tandem.v1.Generation/Generate";
  const int32_t long_id = c.Post(gen, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(6), kLong)));
  // Well past the first window: the proxy has had acknowledgements to hold.
  ASSERT_TRUE(c.RunUntil([&] { return c.response(long_id).data.size() > 2048; }, kWait));
  c.Ping();
  ASSERT_TRUE(c.RunUntil([&] { return c.pings_acked() == 1; }, kWait));
  EXPECT_FALSE(c.response(long_id).closed) << "the PING was answered only after the stream";
  const int32_t short_id =
      c.Post(gen, kGrpcHeaders, RawH2Client::Frame(GreedyGenerateRequest(Prompt(7), kShort)));
  ASSERT_TRUE(c.RunUntil([&] { return c.response(short_id).closed; }, kWait));
  EXPECT_FALSE(c.response(long_id).closed) << "the new request was answered only after the stream";
  EXPECT_EQ(c.response(short_id).GrpcStatus(), "0") << c.response(short_id).GrpcMessage();
  auto short_ref = ReferenceGenerate(Prompt(7), kShort);
  ASSERT_TRUE(short_ref.ok()) << short_ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(short_id)), *short_ref);

  ASSERT_TRUE(c.RunUntil([&] { return c.response(long_id).closed; }, kWait));
  EXPECT_EQ(c.response(long_id).GrpcStatus(), "0") << c.response(long_id).GrpcMessage();
  auto long_ref = ReferenceGenerate(Prompt(6), kLong);
  ASSERT_TRUE(long_ref.ok()) << long_ref.status().ToString();
  EXPECT_EQ(GenerateTokens(c.response(long_id)), *long_ref);
  EXPECT_EQ(WaitFleetIdle(fleet_->workers(), fleet_->proxy_metrics(), std::chrono::seconds(20)), "");
}

// A health Check on a connection of its own: true when the proxy served it
// (OK), false when it closed the connection first.
bool ServedOnNewConnection(const std::string& address, std::unique_ptr<RawH2Client>& c) {
  c = std::make_unique<RawH2Client>(address);
  if (!c->ok()) return false;
  const int32_t id = c->Post("/grpc.health.v1.Health/Check", kGrpcHeaders, RawH2Client::Frame(""));
  (void)c->RunUntil([&] { return c->response(id).closed; }, kWait);
  return c->response(id).closed && c->response(id).GrpcStatus() == "0";
}

// proxy.limits on the native front end: a peer that connects and sends
// nothing is closed after handshake_timeout_seconds (2 s here); past
// max_connections (16 here) a new connection is closed at once, and one
// closing makes room again.
TEST_F(GrpcNative, ConnectionsAreCappedAndSilentOnesClosed) {
  const std::string addr = fleet_->proxy_grpc();
  {
    const size_t colon = addr.rfind(':');
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    ASSERT_EQ(getaddrinfo(addr.substr(0, colon).c_str(), addr.substr(colon + 1).c_str(), &hints, &res), 0);
    const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(connect(fd, res->ai_addr, res->ai_addrlen), 0);
    freeaddrinfo(res);
    // Bounded: a proxy that never closes it fails the test after 60 s.
    timeval tv{.tv_sec = 60, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[4096];
    ssize_t n;
    size_t got = 0;
    while ((n = recv(fd, buf, sizeof buf, 0)) > 0) got += static_cast<size_t>(n);  // its SETTINGS
    const int err = errno;
    close(fd);
    EXPECT_TRUE(n == 0 || err == ECONNRESET) << "the silent connection was not closed: " << std::strerror(err);
    EXPECT_LT(got, sizeof buf);
  }
  std::vector<std::unique_ptr<RawH2Client>> open;
  bool refused = false;
  for (int i = 0; i < 24 && !refused; ++i) {
    std::unique_ptr<RawH2Client> c;
    if (ServedOnNewConnection(addr, c)) {
      open.push_back(std::move(c));
    } else {
      refused = true;
    }
  }
  EXPECT_TRUE(refused) << open.size() << " connections were all served";
  EXPECT_LE(open.size(), 16u);
  ASSERT_FALSE(open.empty());
  open.pop_back();  // one closes: the next may open
  bool served = false;
  // Until the proxy has read that close: each try is answered at once
  // (served, or closed while the proxy is still full). Bounded in time, not
  // in tries: 50 quick tries were not enough while CI loaded both cores.
  const auto until = std::chrono::steady_clock::now() + kWait;
  for (int i = 0; i < 100000 && !served && std::chrono::steady_clock::now() < until; ++i) {
    std::unique_ptr<RawH2Client> c;
    served = ServedOnNewConnection(addr, c);
    if (served) open.push_back(std::move(c));
  }
  EXPECT_TRUE(served) << "no connection was served after one closed";
}

}  // namespace
}  // namespace tandem::testing
