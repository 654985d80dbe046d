// Issue 5's acceptance tests: greedy output through 1P1D, 2P2D and the
// aggregated topology equals `tandem generate` token for token, sent one at
// a time and all at once; 64 concurrent streams; cancels at random points
// leave no KV block held; every bad input gets its status and the fleet
// keeps serving.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "cli/supervisor.h"
#include "fleet_harness.h"
#include "common/tls_certs.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 16;

// 64 prompts: lengths 1 .. ~300 tokens, groups of four sharing a 64-token
// prefix, several longer than one 128-token chunk.
std::vector<std::vector<uint32_t>> Prompts() {
  std::vector<std::vector<uint32_t>> p;
  for (uint32_t i = 0; i < 64; ++i) {
    const uint32_t len = 1 + (i * 37) % 300;
    const bool shared = i % 2 == 0 && len > 64;
    p.push_back(PromptIds(i + 1, len, kVocab, shared ? 1 + (i / 8) : 0, shared ? 64 : 0));
  }
  return p;
}

// `tandem generate` once per prompt, shared by every test of this binary.
const std::vector<std::vector<uint32_t>>& References() {
  static std::vector<std::vector<uint32_t>> refs = [] {
    std::vector<std::vector<uint32_t>> r;
    for (const auto& p : Prompts()) {
      auto ids = ReferenceGenerate(p, kMaxTokens);
      r.push_back(ids.ok() ? *ids : std::vector<uint32_t>{});
      EXPECT_TRUE(ids.ok()) << ids.status().ToString();
    }
    return r;
  }();
  return refs;
}

struct Topology {
  const char* name;
  int prefill, decode, both;
};

class FleetEquivalence : public ::testing::TestWithParam<Topology> {};

void ExpectMatches(const Result<Completion>& c, const std::vector<uint32_t>& prompt,
                   const std::vector<uint32_t>& ref, size_t i) {
  ASSERT_TRUE(c.ok()) << "prompt " << i << ": " << c.status().ToString();
  EXPECT_EQ(c->token_ids, ref) << "prompt " << i << " (" << prompt.size() << " tokens)";
  EXPECT_EQ(c->finish_reason, 2) << "prompt " << i;  // LENGTH
  EXPECT_EQ(c->prompt_tokens, prompt.size()) << "prompt " << i;
  EXPECT_EQ(c->completion_tokens, kMaxTokens) << "prompt " << i;
}

TEST_P(FleetEquivalence, GreedyOutputEqualsGenerate) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing at " << BundledModel();
  const auto& refs = References();
  const auto prompts = Prompts();
  FleetOptions o;
  o.prefill = GetParam().prefill;
  o.decode = GetParam().decode;
  o.both = GetParam().both;
  // Room for all 64 at once on one decoder (at most 20 blocks each): this
  // test is about tokens, not a full KV pool. With the harness's 512, a
  // decoder holding ~50 of them refused the rest (RESOURCE_EXHAUSTED, the
  // only decoder excluded) when CI's load slowed decoding (session 23).
  o.num_blocks = 2048;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();

  // One at a time (the first 50).
  for (size_t i = 0; i < 50; ++i) {
    GenerateArgs a;
    a.prompt_ids = prompts[i];
    a.max_tokens = kMaxTokens;
    ExpectMatches(Generate(proxy, a), prompts[i], refs[i], i);
  }
  // All 64 at once.
  std::vector<std::future<Result<Completion>>> futures;
  for (size_t i = 0; i < prompts.size(); ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      GenerateArgs a;
      a.prompt_ids = prompts[i];
      a.max_tokens = kMaxTokens;
      return Generate(proxy, a);
    }));
  }
  for (size_t i = 0; i < futures.size(); ++i) ExpectMatches(futures[i].get(), prompts[i], refs[i], i);

  // Prompts sharing a prefix were served from a prefix cache somewhere.
  double hits = 0;
  for (const auto& w : (*fleet)->workers()) {
    auto m = Scrape(w.metrics);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    hits += MetricValue(*m, "tandem_prefix_cache_hits_tokens_total");
  }
  EXPECT_GT(hits, 0);
}

INSTANTIATE_TEST_SUITE_P(Topologies, FleetEquivalence,
                         ::testing::Values(Topology{"1p1d", 1, 1, 0}, Topology{"2p2d", 2, 2, 0},
                                           Topology{"aggregated", 0, 0, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

// Waits (bounded) until every worker is idle: no KV block used, no
// reservation, no parked or queued prefill, no running or waiting sequence.
void ExpectWorkersIdle(const Fleet& fleet) {
  EXPECT_EQ(WaitFleetIdle(fleet.workers(), "", std::chrono::seconds(10)), "");
}

TEST(Fleet, CancelAtRandomPointsFreesEveryBlock) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();
  auto channel = grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials());
  auto stub = tandem::v1::Generation::NewStub(channel);

  constexpr int kRequests = 500, kConcurrency = 25;
  std::atomic<int> next{0}, completed{0}, cancelled{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kConcurrency; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = next++; i < kRequests; i = next++) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        tandem::v1::GenerateRequest req;
        for (uint32_t id : PromptIds(1000 + i, 20 + rng() % 250, kVocab)) {
          req.add_prompt_token_ids(id);
        }
        req.set_max_tokens(8 + rng() % 24);
        req.mutable_sampling()->set_temperature(0);
        req.set_ignore_eos(true);
        auto reader = stub->Generate(&ctx, req);
        // Cancel before anything (0), after the first message, or mid-stream.
        const int cut = static_cast<int>(rng() % 4);
        std::thread canceller;
        if (cut == 0) canceller = std::thread([&ctx, d = rng() % 3000] {
          std::this_thread::sleep_for(std::chrono::microseconds(d));
          ctx.TryCancel();
        });
        tandem::v1::GenerateResponse resp;
        int messages = 0;
        while (reader->Read(&resp)) {
          if (++messages == cut) ctx.TryCancel();
        }
        if (canceller.joinable()) canceller.join();
        const auto st = reader->Finish();
        (st.ok() ? completed : cancelled)++;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(completed + cancelled, kRequests);
  EXPECT_GT(cancelled, 100);
  ExpectWorkersIdle(**fleet);

  // The fleet still serves, correctly.
  const auto prompt = Prompts()[3];
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  ExpectMatches(Generate(proxy, a), prompt, References()[3], 3);
}

struct BadInput {
  const char* name;
  GenerateArgs args;
  grpc::StatusCode code;
  const char* message_part;
};

TEST(Fleet, BadInputsGetTheirStatusAndTheFleetKeepsServing) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string proxy = (*fleet)->proxy_grpc();
  std::vector<BadInput> cases;
  auto add = [&](const char* name, auto tweak, grpc::StatusCode code, const char* part) {
    GenerateArgs a;
    a.prompt = "In the beginning";
    tweak(a);
    cases.push_back({name, a, code, part});
  };
  const auto inv = grpc::StatusCode::INVALID_ARGUMENT;
  add("empty prompt", [](GenerateArgs& a) { a.prompt = ""; }, inv, "prompt is empty");
  add("both prompts", [](GenerateArgs& a) { a.prompt_ids = {1, 2}; }, inv, "not both");
  add("token out of vocab", [](GenerateArgs& a) { a.prompt = ""; a.prompt_ids = {1, 99999}; },
      inv, "prompt_token_ids[1] is 99999");
  add("prompt + max_tokens beyond context",
      [](GenerateArgs& a) { a.prompt = ""; a.prompt_ids = PromptIds(5, 1000, kVocab); a.max_tokens = 100; },
      inv, "exceeds the model's context of 1024 tokens");
  add("max_tokens 0", [](GenerateArgs& a) { a.max_tokens = 0; }, inv, "max_tokens must be at least 1");
  add("max_tokens above limit", [](GenerateArgs& a) { a.max_tokens = 513; }, inv,
      "this fleet allows at most 512");
  add("temperature < 0", [](GenerateArgs& a) { a.temperature = -1.0f; }, inv,
      "sampling.temperature must be >= 0");
  add("top_p 0", [](GenerateArgs& a) { a.top_p = 0.0f; }, inv, "sampling.top_p must be in (0, 1]");
  add("top_p > 1", [](GenerateArgs& a) { a.top_p = 1.5f; }, inv, "sampling.top_p must be in (0, 1]");
  // The C++ client sends these bytes (protobuf only logs an error); the
  // proxy parses the wire-identical bytes view and names the field.
  add("invalid UTF-8 prompt", [](GenerateArgs& a) { a.prompt = "ab\xff"; }, inv,
      "prompt is not valid UTF-8");
  add("invalid UTF-8 stop", [](GenerateArgs& a) { a.stop = {"\xc3"}; }, inv,
      "stop[0] is not valid UTF-8");
  add("unknown model", [](GenerateArgs& a) { a.model = "gpt-9"; }, grpc::StatusCode::NOT_FOUND,
      "model 'gpt-9' is not served here");
  for (const auto& c : cases) {
    auto r = Generate(proxy, c.args);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(static_cast<int>(r.status().code()), static_cast<int>(c.code))
        << c.name << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find(c.message_part), std::string::npos)
        << c.name << ": " << r.status().message();
  }
  // A client's request id is only a label (docs/security.md, "Hostile
  // input"): a second request reusing an id in flight is served too, and
  // neither disturbs the other; both echo the id.
  {
    GenerateArgs first;
    first.prompt = "In the beginning";
    first.max_tokens = 512;
    first.request_id = "dup-1";
    auto running = std::async(std::launch::async, [&] { return Generate(proxy, first); });
    // The event: the proxy has it in flight.
    ASSERT_TRUE(WaitUntil(
        [&] {
          auto m = Scrape((*fleet)->proxy_metrics());
          return m.ok() && MetricValue(*m, "tandem_requests_inflight") >= 1;
        },
        std::chrono::seconds(20)));
    GenerateArgs second = first;
    second.max_tokens = 4;
    auto dup = Generate(proxy, second);
    ASSERT_TRUE(dup.ok()) << dup.status().ToString();
    EXPECT_EQ(dup->completion_tokens, 4u);
    EXPECT_EQ(dup->request_id, "dup-1");
    auto done = running.get();
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_EQ(done->completion_tokens, 512u);
    EXPECT_EQ(done->token_ids.size(), 512u);
    EXPECT_EQ(done->request_id, "dup-1");
    // Greedy: the short one is the long one's first 4 tokens.
    ASSERT_GE(done->token_ids.size(), 4u);
    EXPECT_EQ(dup->token_ids, std::vector<uint32_t>(done->token_ids.begin(),
                                                     done->token_ids.begin() + 4));
  }
  // Still serving, correctly.
  const auto prompt = Prompts()[5];
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  ExpectMatches(Generate(proxy, a), prompt, References()[5], 5);
  ExpectWorkersIdle(**fleet);
}

}  // namespace
}  // namespace tandem::testing

namespace tandem::testing {
namespace {

// SIGTERM to `tandem launch` while requests run: it exits 0 and leaves no
// process of the fleet behind.
TEST(Fleet, SigtermToLaunchStopsEveryProcess) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  std::vector<pid_t> pids = {(*fleet)->proxy_pid()};
  for (const auto& w : (*fleet)->workers()) pids.push_back(w.pid);
  ASSERT_GT(pids.front(), 0);
  std::vector<std::future<Result<Completion>>> load;
  for (int i = 0; i < 8; ++i) {
    load.push_back(std::async(std::launch::async, [&, i] {
      GenerateArgs a;
      a.prompt_ids = PromptIds(900 + i, 50, kVocab);
      a.max_tokens = 64;
      return Generate((*fleet)->proxy_grpc(), a);
    }));
  }
  // The event: requests are in flight at the proxy when the signal comes.
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto m = Scrape((*fleet)->proxy_metrics());
        return m.ok() && MetricValue(*m, "tandem_requests_inflight") >= 1;
      },
      std::chrono::seconds(20)));
  auto st = (*fleet)->Stop(std::chrono::seconds(40));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << *st;
  for (auto& f : load) f.get().status().IgnoreError();  // finished or failed; none hangs
  for (pid_t p : pids) {
    EXPECT_NE(kill(p, 0), 0) << "process " << p << " outlived tandem launch";
  }
}

// An orderly stop is not an alarm: the launcher drains the proxy first, so
// each worker's registrar (kicked by its Watch ending) finds the proxy gone
// before its own SIGTERM comes, and the proxy takes every worker out of
// routing as it shuts down; the workers stop together, so a prefiller may
// see its KV endpoint to a decoder that exited first fail, with nothing in
// flight. None of it is logged at warning or above (it was: two lines per
// worker before session 23; the endpoint's failure, 1 run in CI, before
// session 24). The fleet logs at `warn`, so every line in its log would be
// one.
TEST(Fleet, AnOrderlyStopLogsNoWarning) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  o.log_level = "warn";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  GenerateArgs a;
  a.prompt_ids = PromptIds(950, 40, kVocab);
  a.max_tokens = 8;
  auto c = Generate((*fleet)->proxy_grpc(), a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto st = (*fleet)->Stop(std::chrono::seconds(40));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << *st;
  std::ifstream in((*fleet)->log_path());
  ASSERT_TRUE(in.good()) << (*fleet)->log_path();
  std::vector<std::string> alarms;
  for (std::string line; std::getline(in, line);) {
    // "DATE TIME L [process] message": L is the level's letter.
    std::istringstream words(line);
    std::string date, time, level;
    words >> date >> time >> level;
    if (level == "W" || level == "E" || level == "C") alarms.push_back(line);
  }
  EXPECT_TRUE(alarms.empty()) << alarms.size() << " lines, the first: " << alarms.front();
}

TEST(Fleet, ProxyWithoutWorkersAnswersUnavailable) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  char dir[] = "/tmp/tandem-proxy-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string cfg = std::string(dir) + "/fleet.yaml";
  {
    std::ofstream y(cfg);
    y << "model:\n  path: " << BundledModel()
      << "\nproxy:\n  grpc: 127.0.0.1:0\n  metrics: 127.0.0.1:0\n"
         "prefill:\n  replicas: 1\ndecode:\n  replicas: 1\n";
  }
  // Started by hand, the proxy needs an internal-plane identity (mutual TLS by default).
  auto ca = FleetCa::OpenOrCreate(std::string(dir) + "/tls", "test fleet CA");
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  auto id = ca->Issue("proxy", {"127.0.0.1"});
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  cli::Supervisor sup;
  auto proxy = sup.Start({"proxy", "proxy",
                          {std::string(TANDEM_BINARY_DIR) + "/tandem", "--log-level", "error",
                           "proxy", "--config", cfg, "--tls-ca", id->ca_file, "--tls-cert",
                           id->cert_file, "--tls-key", id->key_file}},
                         std::chrono::seconds(60));
  ASSERT_TRUE(proxy.ok()) << proxy.status().ToString();
  GenerateArgs a;
  a.prompt = "And God said";
  auto r = Generate((*proxy)->grpc, a);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("no worker"), std::string::npos) << r.status().message();
  sup.StopAll(std::chrono::seconds(10));
  std::filesystem::remove_all(dir);
}

TEST(Fleet, FullProxyAnswersResourceExhaustedAtOnce) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o;
  o.max_inflight = 4;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  std::vector<std::future<Result<Completion>>> futures;
  for (int i = 0; i < 24; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      GenerateArgs a;
      a.prompt_ids = PromptIds(500 + i, 200, kVocab);
      a.max_tokens = 200;
      return Generate((*fleet)->proxy_grpc(), a);
    }));
  }
  int ok = 0, exhausted = 0;
  for (auto& f : futures) {
    auto r = f.get();
    if (r.ok()) {
      ++ok;
      EXPECT_EQ(r->completion_tokens, 200u);
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
      EXPECT_NE(r.status().message().find("proxy.max_inflight"), std::string::npos);
      ++exhausted;
    }
  }
  EXPECT_GE(ok, 4);
  EXPECT_GT(exhausted, 0);
  EXPECT_EQ(ok + exhausted, 24);
  ExpectWorkersIdle(**fleet);
}

}  // namespace
}  // namespace tandem::testing
