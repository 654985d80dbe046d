// Issue 19, hostile input (docs/security.md "Hostile input"), on real
// fleets started by `tandem launch`:
//   - every proxy.limits key refused with its name, on both APIs where it
//     applies, nothing left in flight or on a worker, the fleet serving on;
//   - per-tenant rate limits: RESOURCE_EXHAUSTED with `retry-after`
//     trailing metadata on gRPC, 429 with Retry-After on HTTP;
//   - a client's request id is a label: another tenant reusing it (or
//     variations of it) does not disturb the first request;
//   - the fleet salt: random per launch, and a worker without it cannot join.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "fleet_harness.h"
#include "shared_fleet_test.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

namespace pb = ::tandem::v1;
constexpr uint32_t kVocab = 4096;

// A connected socket to "host:port" (-1 on failure), with a receive timeout.
int Connect(const std::string& address) {
  const auto colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// Everything until the server closes (or the receive timeout).
std::string ReadToClose(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

// One request on a fresh connection; the whole response.
std::string HttpCall(const std::string& address, const std::string& request) {
  const int fd = Connect(address);
  if (fd < 0) return "";
  std::string out = SendAll(fd, request) ? ReadToClose(fd) : "";
  close(fd);
  return out;
}

std::string Post(const std::string& body, const std::string& key = "",
                 const std::string& extra_headers = "", bool close = true) {
  return "POST /v1/completions HTTP/1.1\r\nHost: t\r\n" +
         std::string(close ? "Connection: close\r\n" : "") +
         "Content-Type: application/json\r\n" +
         (key.empty() ? "" : "Authorization: Bearer " + key + "\r\n") + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string ChatPost(const std::string& body, const std::string& key) {
  return "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
         "Content-Type: application/json\r\nAuthorization: Bearer " + key +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

int StatusOf(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0) return -1;
  return std::stoi(response.substr(9, 3));
}

// Counts "HTTP/1.1 CODE" status lines in a stream of responses, in order.
std::vector<int> StatusLines(const std::string& stream) {
  std::vector<int> codes;
  for (size_t at = stream.find("HTTP/1.1 "); at != std::string::npos;
       at = stream.find("HTTP/1.1 ", at + 1)) {
    codes.push_back(std::stoi(stream.substr(at + 9, 3)));
  }
  return codes;
}

// A gRPC Generate whose status and trailing metadata we keep.
struct RawCall {
  grpc::Status status;
  std::string retry_after;  // trailing metadata `retry-after`
  std::string echoed_id;
  uint32_t completion_tokens = 0;
};
RawCall CallGrpc(const std::string& proxy, const pb::GenerateRequest& req, const std::string& key) {
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  auto reader = stub->Generate(&ctx, req);
  RawCall out;
  pb::GenerateResponse r;
  while (reader->Read(&r)) {
    out.echoed_id = r.request_id();
    out.completion_tokens = std::max(out.completion_tokens, r.usage().completion_tokens());
  }
  out.status = reader->Finish();
  const auto& md = ctx.GetServerTrailingMetadata();
  if (auto it = md.find("retry-after"); it != md.end()) {
    out.retry_after.assign(it->second.data(), it->second.size());
  }
  return out;
}

pb::GenerateRequest IdsRequest(uint32_t seed, uint32_t n, uint32_t max_tokens) {
  pb::GenerateRequest r;
  for (uint32_t t : PromptIds(seed, n, kVocab)) r.add_prompt_token_ids(t);
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0);
  r.set_ignore_eos(true);
  return r;
}

void ExpectNothingLeft(const Fleet& fleet) {
  double inflight = -1;
  WaitUntil(
      [&] {
        auto m = Scrape(fleet.proxy_metrics());
        inflight = m.ok() ? MetricValue(*m, "tandem_requests_inflight") : -1;
        return inflight == 0;
      },
      std::chrono::seconds(20));
  EXPECT_EQ(inflight, 0) << "a refused request stayed in flight at the proxy";
  for (const auto& w : fleet.workers()) {
    double running = -1, reserved = -1, waiting = -1;
    WaitUntil(
        [&] {
          auto m = Scrape(w.metrics);
          if (!m.ok()) return false;
          running = MetricValue(*m, "tandem_num_requests_running");
          waiting = MetricValue(*m, "tandem_num_requests_waiting");
          reserved = MetricValue(*m, "tandem_kv_reservations");
          return running == 0 && waiting == 0 && reserved == 0;
        },
        std::chrono::seconds(20));
    EXPECT_EQ(running, 0) << w.name;
    EXPECT_EQ(waiting, 0) << w.name;
    EXPECT_EQ(reserved, 0) << w.name << " still holds a reservation";
  }
}

class HostileInput : public SharedFleetTest<HostileInput> {
 public:
  static Result<FleetOptions> SuiteOptions() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("tandem-hostile-" + std::to_string(getpid())));
    std::filesystem::create_directories(*dir_);
    {
      std::ofstream keys(*dir_ + "/keys.yaml");
      keys << "- key: key-alice\n  tenant: alice\n"
           << "- key: key-bob\n  tenant: bob\n"
           << "- key: key-slow\n  tenant: slow\n  requests_per_second: 0.01\n"
           << "  burst_requests: 2\n"
           << "- key: key-thrifty\n  tenant: thrifty\n  tokens_per_second: 0.1\n"
           << "  burst_tokens: 60\n";
    }
    FleetOptions o;  // 1P1D
    o.proxy_yaml =
        "  limits:\n    max_request_bytes: 4096\n    max_prompt_tokens: 100\n"
        "    max_stop_strings: 2\n    max_stop_string_bytes: 8\n    max_stop_token_ids: 3\n"
        "    max_http_header_bytes: 2048\n    max_http_body_bytes: 3000\n"
        "    max_connections: 4\n    max_pipelined_requests: 2\n";
    o.extra_yaml = "security:\n  api_keys_file: " + *dir_ + "/keys.yaml\n";
    return o;
  }
  static void TearDownTestSuite() {
    SharedFleetTest::TearDownTestSuite();
    if (dir_) std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }

 protected:
  static inline std::string* dir_ = nullptr;
};

TEST_F(HostileInput, EveryLimitIsRefusedWithItsNameOnBothApis) {
  const std::string proxy = fleet_->proxy_grpc(), http = fleet_->proxy_http();
  struct GrpcCase {
    const char* limit;
    pb::GenerateRequest req;
  };
  std::vector<GrpcCase> grpc_cases;
  {
    pb::GenerateRequest r = IdsRequest(1, 8, 2);
    r.clear_prompt_token_ids();
    r.set_prompt(std::string(5000, 'a'));
    grpc_cases.push_back({"proxy.limits.max_request_bytes", r});
  }
  grpc_cases.push_back({"proxy.limits.max_prompt_tokens", IdsRequest(2, 101, 2)});
  {
    pb::GenerateRequest r = IdsRequest(3, 8, 2);
    for (const char* s : {"a", "b", "c"}) r.add_stop(s);
    grpc_cases.push_back({"proxy.limits.max_stop_strings", r});
  }
  {
    pb::GenerateRequest r = IdsRequest(4, 8, 2);
    r.add_stop("123456789");
    grpc_cases.push_back({"proxy.limits.max_stop_string_bytes", r});
  }
  {
    pb::GenerateRequest r = IdsRequest(5, 8, 2);
    for (uint32_t t : {1, 2, 3, 4}) r.add_stop_token_ids(t);
    grpc_cases.push_back({"proxy.limits.max_stop_token_ids", r});
  }
  for (const auto& c : grpc_cases) {
    RawCall r = CallGrpc(proxy, c.req, "key-alice");
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.limit << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(c.limit), std::string::npos)
        << c.limit << ": " << r.status.error_message();
  }
  // Just inside every limit: served.
  {
    pb::GenerateRequest r = IdsRequest(6, 100, 2);
    r.add_stop("12345678");
    r.add_stop("x");
    for (uint32_t t : {1, 2, 3}) r.add_stop_token_ids(t);
    RawCall ok = CallGrpc(proxy, r, "key-alice");
    EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
    EXPECT_EQ(ok.completion_tokens, 2u);
  }

  std::string words;
  for (int i = 0; i < 150; ++i) words += "and the ";
  struct HttpCase {
    const char* limit;
    int code;
    std::string request;
  };
  const std::vector<HttpCase> http_cases = {
      {"proxy.limits.max_prompt_tokens", 400,
       Post(R"({"prompt": ")" + words + R"(", "max_tokens": 2})", "key-alice")},
      {"proxy.limits.max_prompt_tokens", 400,
       ChatPost(R"({"messages": [{"role": "user", "content": ")" + words +
                    R"("}], "max_tokens": 2})", "key-alice")},
      {"proxy.limits.max_stop_strings", 400,
       Post(R"({"prompt": "In the", "max_tokens": 2, "stop": ["a", "b", "c"]})", "key-alice")},
      {"proxy.limits.max_stop_string_bytes", 400,
       Post(R"({"prompt": "In the", "max_tokens": 2, "stop": ["123456789"]})", "key-alice")},
      {"proxy.limits.max_stop_token_ids", 400,
       Post(R"({"prompt": "In the", "max_tokens": 2, "stop_token_ids": [1, 2, 3, 4]})",
            "key-alice")},
      {"proxy.limits.max_http_body_bytes", 413,
       Post(R"({"prompt": ")" + std::string(3500, 'a') + R"(", "max_tokens": 2})", "key-alice")},
      {"proxy.limits.max_http_header_bytes", 431,
       Post(R"({"prompt": "In the", "max_tokens": 2})", "key-alice",
            "X-Padding: " + std::string(3000, 'p') + "\r\n")},
  };
  for (const auto& c : http_cases) {
    const std::string resp = HttpCall(http, c.request);
    EXPECT_EQ(StatusOf(resp), c.code) << c.limit << ": " << resp;
    EXPECT_NE(resp.find(c.limit), std::string::npos) << c.limit << ": " << resp;
  }

  // Pipelining: one request served and two waiting are allowed; the fourth
  // read ahead is answered 429 in its turn and the connection closes.
  {
    std::string batch;
    for (int i = 0; i < 6; ++i) {
      batch += Post(R"({"prompt": "In the beginning", "max_tokens": 48, "ignore_eos": true})",
                    "key-alice", "", /*close=*/false);
    }
    const int fd = Connect(http);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, batch));
    const std::string stream = ReadToClose(fd);
    close(fd);
    EXPECT_EQ(StatusLines(stream), (std::vector<int>{200, 200, 200, 429})) << stream;
    EXPECT_NE(stream.find("proxy.limits.max_pipelined_requests"), std::string::npos) << stream;
  }

  // Connections: four open (each answered once, so the proxy holds them),
  // the fifth is answered 429; once one closes, new ones are served again.
  {
    std::vector<int> open_fds;
    for (int i = 0; i < 4; ++i) {
      const int fd = Connect(http);
      ASSERT_GE(fd, 0);
      ASSERT_TRUE(SendAll(fd, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n"));
      char buf[512];
      ASSERT_GT(recv(fd, buf, sizeof buf, 0), 0);
      open_fds.push_back(fd);
    }
    const std::string refused = HttpCall(http, Post(R"({"prompt": "In", "max_tokens": 2})", "key-alice"));
    EXPECT_EQ(StatusOf(refused), 429) << refused;
    EXPECT_NE(refused.find("proxy.limits.max_connections"), std::string::npos) << refused;
    for (int fd : open_fds) close(fd);
    std::string again;
    EXPECT_TRUE(WaitUntil(
        [&] {
          again = HttpCall(http, Post(R"({"prompt": "In", "max_tokens": 2})", "key-alice"));
          return StatusOf(again) == 200;
        },
        std::chrono::seconds(20)))
        << again;
  }

  // Nothing leaked; the fleet still serves gRPC correctly.
  ExpectNothingLeft(*fleet_);
  GenerateArgs a;
  a.prompt_ids = PromptIds(7, 40, kVocab);
  a.max_tokens = 8;
  a.api_key = "key-bob";
  auto c = Generate(proxy, a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto ref = ReferenceGenerate(a.prompt_ids, 8);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(c->token_ids, *ref);
}

TEST_F(HostileInput, TenantRateLimitsSayWhenToRetryOnBothApis) {
  const std::string proxy = fleet_->proxy_grpc(), http = fleet_->proxy_http();
  // `slow`: a burst of 2 requests, then one per 100 s.
  for (int i = 0; i < 2; ++i) {
    RawCall ok = CallGrpc(proxy, IdsRequest(10 + i, 8, 2), "key-slow");
    ASSERT_TRUE(ok.status.ok()) << i << ": " << ok.status.error_message();
  }
  RawCall refused = CallGrpc(proxy, IdsRequest(12, 8, 2), "key-slow");
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("requests_per_second"), std::string::npos)
      << refused.status.error_message();
  ASSERT_FALSE(refused.retry_after.empty()) << "no retry-after trailing metadata";
  EXPECT_GE(std::stoi(refused.retry_after), 90);
  EXPECT_LE(std::stoi(refused.retry_after), 100);
  const std::string http_refused =
      HttpCall(http, Post(R"({"prompt": "In the", "max_tokens": 2})", "key-slow"));
  EXPECT_EQ(StatusOf(http_refused), 429) << http_refused;
  EXPECT_NE(http_refused.find("requests_per_second"), std::string::npos) << http_refused;
  const auto ra = http_refused.find("Retry-After: ");
  ASSERT_NE(ra, std::string::npos) << http_refused;
  EXPECT_GE(std::stoi(http_refused.substr(ra + 13)), 90) << http_refused;

  // `thrifty`: 60 tokens of burst (prompt + max_tokens), 0.1 per second.
  RawCall first = CallGrpc(proxy, IdsRequest(13, 40, 4), "key-thrifty");  // 44 tokens
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  RawCall second = CallGrpc(proxy, IdsRequest(14, 40, 4), "key-thrifty");
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << second.status.error_message();
  EXPECT_NE(second.status.error_message().find("tokens_per_second"), std::string::npos)
      << second.status.error_message();
  EXPECT_GE(std::stoi(second.retry_after.empty() ? "0" : second.retry_after), 200);
  const std::string http_tokens =
      HttpCall(http, Post(R"({"prompt": "In the beginning", "max_tokens": 30})", "key-thrifty"));
  EXPECT_EQ(StatusOf(http_tokens), 429) << http_tokens;
  EXPECT_NE(http_tokens.find("tokens_per_second"), std::string::npos) << http_tokens;
  EXPECT_NE(http_tokens.find("Retry-After: "), std::string::npos) << http_tokens;

  // Other tenants are not affected.
  RawCall other = CallGrpc(proxy, IdsRequest(15, 8, 2), "key-bob");
  EXPECT_TRUE(other.status.ok()) << other.status.error_message();
  ExpectNothingLeft(*fleet_);
}

TEST_F(HostileInput, ReusedRequestIdsDisturbNoOneElsesRequest) {
  const std::string proxy = fleet_->proxy_grpc();
  GenerateArgs victim;
  victim.prompt_ids = PromptIds(20, 40, kVocab);
  victim.max_tokens = 200;
  victim.request_id = "shared-7";
  victim.api_key = "key-alice";
  auto running = std::async(std::launch::async, [&] { return Generate(proxy, victim); });
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto m = Scrape(fleet_->proxy_metrics());
        return m.ok() && MetricValue(*m, "tandem_requests_inflight") >= 1;
      },
      std::chrono::seconds(20)));
  // Another tenant reuses the id, and ids shaped like the workers' keys of it.
  for (const std::string id : {"shared-7", "shared-7#1", "shared-7#1@r1", "shared-7~0"}) {
    GenerateArgs other;
    other.prompt_ids = PromptIds(21, 24, kVocab);
    other.max_tokens = 3;
    other.request_id = id;
    other.api_key = "key-bob";
    auto r = Generate(proxy, other);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status().ToString();
    EXPECT_EQ(r->completion_tokens, 3u) << id;
    EXPECT_EQ(r->request_id, id);
  }
  // The same tenant may reuse it too (the id is a label).
  GenerateArgs same = victim;
  same.max_tokens = 2;
  auto s = Generate(proxy, same);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->request_id, "shared-7");
  auto done = running.get();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->request_id, "shared-7");
  auto ref = ReferenceGenerate(victim.prompt_ids, 200);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_EQ(done->token_ids, *ref) << "the victim's tokens were disturbed";
  ExpectNothingLeft(*fleet_);
}

// The fleet salt (cache.salt) defaults to a random one per launch, handed
// to the children; a worker joining by hand needs it.
TEST(FleetSalt, EachLaunchMakesItsOwnAndAWorkerWithoutItCannotJoin) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  o.prefill = 0;
  o.decode = 0;
  o.both = 1;
  auto a = Fleet::Launch(o);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = Fleet::Launch(o);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*a)->cache_salt().size(), 32u);
  EXPECT_EQ((*b)->cache_salt().size(), 32u);
  EXPECT_NE((*a)->cache_salt(), (*b)->cache_salt());

  int attempt = 0;
  for (const std::string& env :
       std::vector<std::string>{"TANDEM_CACHE_SALT=", "TANDEM_CACHE_SALT=" + (*b)->cache_salt()}) {
    ++attempt;
    const std::string log = (*a)->log_path() + ".join" + std::to_string(attempt);
    auto w = JoinWorker(**a, "both", "both-wrong-" + std::to_string(attempt), log, {env},
                        std::chrono::seconds(60));
    ASSERT_FALSE(w.ok()) << env << ": a worker with another salt joined";
    EXPECT_NE(w.status().message().find("fleet salt (cache.salt) differs"), std::string::npos)
        << w.status().message();
    EXPECT_NE(w.status().message().find("TANDEM_CACHE_SALT"), std::string::npos)
        << w.status().message();
  }
  // With the salt (JoinWorker passes the state file's): it joins and serves.
  auto w = JoinWorker(**a, "both", "both-salted", (*a)->log_path() + ".join");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  GenerateArgs g;
  g.prompt_ids = PromptIds(30, 24, kVocab);
  g.max_tokens = 4;
  auto r = Generate((*a)->proxy_grpc(), g);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  StopProcess(w->pid, std::chrono::seconds(20));
}

}  // namespace
}  // namespace tandem::testing
