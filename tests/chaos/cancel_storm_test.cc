// Issue 20's cancel storm (docs/failure-handling.md, "Cancel storm"): a 2P2D
// fleet of the bundled model (CPU backend), N requests (default 400 here;
// TANDEM_CANCEL_STORM_N=5000 for the recorded run) from 32 concurrent
// clients, half through gRPC, half through the OpenAI HTTP API, each
// cancelled at a random moment:
//   - at once (before routing: gRPC TryCancel right after the call starts,
//     HTTP close right after the request is written);
//   - after a random delay in [0, 2 x the median time to first token]
//     (during the prefill or the KV push);
//   - after k streamed tokens, k random (mid-decode).
// Afterwards no worker holds a used KV block, a reservation, a queued or
// parked prefill, or a running or waiting sequence, the proxy has nothing
// in flight, and the fleet still answers correctly. The lease is the default
// 30 s and the idle wait is bounded well below it: the cancels themselves
// must free everything, not lease expiry.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "chaos_load.h"
#include "common/net.h"
#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing::chaos {
namespace {

namespace pb = ::tandem::v1;
using namespace std::chrono_literals;

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 48;

enum class When { kAtOnce, kAfterDelay, kAfterTokens };
const char* Name(When w) {
  return w == When::kAtOnce ? "at once" : w == When::kAfterDelay ? "after a delay" : "mid-decode";
}

struct Outcome {
  std::string api, when, result;
};

// gRPC: one streamed Generate cancelled as told. Returns "OK" (finished
// before the cancel landed), "CANCELLED" or another status.
std::string GrpcOne(pb::Generation::Stub& stub, const std::vector<uint32_t>& prompt, When when,
                    std::chrono::microseconds delay, uint32_t tokens) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  pb::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(kMaxTokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  auto reader = stub.Generate(&ctx, req);
  pb::GenerateResponse resp;
  if (when == When::kAtOnce) {
    ctx.TryCancel();
  } else if (when == When::kAfterDelay) {
    std::this_thread::sleep_for(delay);
    ctx.TryCancel();
  } else {
    uint32_t got = 0;
    while (got < tokens && reader->Read(&resp)) got += static_cast<uint32_t>(resp.token_ids_size());
    ctx.TryCancel();
  }
  while (reader->Read(&resp)) {
  }
  const grpc::Status st = reader->Finish();
  if (st.ok()) return "OK";
  if (st.error_code() == grpc::StatusCode::CANCELLED) return "CANCELLED";
  return fmt::format("{}: {}", static_cast<int>(st.error_code()), st.error_message());
}

// HTTP: a streamed /v1/completions whose connection is closed as told.
// Returns "closed" (the client went away), "done" (the stream ended first)
// or an error.
std::string HttpOne(const std::string& address, const std::vector<uint32_t>& prompt, When when,
                    std::chrono::microseconds delay, uint32_t tokens) {
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return "bad address";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp->port);
  inet_pton(AF_INET, hp->host.c_str(), &sa.sin_addr);
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return "connect failed";
  }
  std::string ids;
  for (uint32_t t : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  const std::string body = fmt::format(
      R"({{"model":"tandem-kjv","prompt":[{}],"max_tokens":{},"temperature":0,"ignore_eos":true,"stream":true}})",
      ids, kMaxTokens);
  const std::string req = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\n\r\n{}",
      address, body.size(), body);
  std::string result = "closed";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    result = "write failed";
  } else if (when == When::kAfterDelay) {
    std::this_thread::sleep_for(delay);
  } else if (when == When::kAfterTokens) {
    std::string got;
    char buf[4096];
    size_t events = 0;
    while (events < tokens) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) {
        result = n == 0 ? "eof" : "read timeout";
        break;
      }
      got.append(buf, static_cast<size_t>(n));
      if (got.find("[DONE]") != std::string::npos) {
        result = "done";
        break;
      }
      if (got.find("HTTP/1.1 200") != 0) {
        result = "HTTP " + got.substr(0, got.find('\r'));
        break;
      }
      events = 0;
      for (size_t at = got.find("data: {"); at != std::string::npos; at = got.find("data: {", at + 1)) {
        ++events;
      }
    }
  }
  close(fd);
  return result;
}

TEST(CancelStorm, EveryBlockIsFreedOnEveryWorker) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  const char* env_n = getenv("TANDEM_CANCEL_STORM_N");
  const int total = env_n && *env_n ? std::atoi(env_n) : 400;
  constexpr int kClients = 32;
  FleetOptions o;
  o.prefill = 2;
  o.decode = 2;
  o.num_blocks = 1024;
  o.max_waiting = 1024;
  // The default lease (30 s): the idle wait below ends long before it.
  o.max_inflight = 2048;
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string grpc_addr = (*fleet)->proxy_grpc(), http_addr = (*fleet)->proxy_http();
  ASSERT_FALSE(http_addr.empty());
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel(grpc_addr, grpc::InsecureChannelCredentials()));

  // Prompts of 16..415 tokens (1-4 prefill chunks of 128).
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 64; ++i) prompts.push_back(PromptIds(5000 + i, 16 + (i * 97) % 400, kVocab));

  // The median time to first token of the longer prompts, under no load:
  // delays are drawn up to twice it, across the prefill and the push.
  std::vector<double> ttft;
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    pb::GenerateRequest req;
    for (uint32_t t : PromptIds(5100 + i, 400, kVocab)) req.add_prompt_token_ids(t);
    req.set_max_tokens(1);
    const auto t0 = Clock::now();
    auto reader = stub->Generate(&ctx, req);
    pb::GenerateResponse resp;
    reader->Read(&resp);
    ttft.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    while (reader->Read(&resp)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  std::sort(ttft.begin(), ttft.end());
  const double max_delay_us = 2 * ttft[ttft.size() / 2];

  std::mutex mu;
  std::map<std::string, int> counts;  // "api, when: result" -> n
  std::vector<std::string> errors;
  std::atomic<int> next{0};
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(777 + static_cast<uint32_t>(c));
      auto own = pb::Generation::NewStub(
          grpc::CreateChannel(grpc_addr, grpc::InsecureChannelCredentials()));
      // Bounded in count and in time.
      for (int i = next++; i < total && Clock::now() - start < 300s; i = next++) {
        const auto& prompt = prompts[rng() % prompts.size()];
        const When when = static_cast<When>(rng() % 3);
        const auto delay = std::chrono::microseconds(
            static_cast<int64_t>(max_delay_us * (rng() % 1000) / 1000.0));
        const uint32_t tokens = 1 + rng() % (kMaxTokens - 1);
        const bool http = i % 2 == 1;
        const std::string r = http ? HttpOne(http_addr, prompt, when, delay, tokens)
                                   : GrpcOne(*own, prompt, when, delay, tokens);
        std::lock_guard lock(mu);
        counts[fmt::format("{}, {}: {}", http ? "HTTP" : "gRPC", Name(when), r)]++;
        const bool fine = http ? (r == "closed" || r == "done") : (r == "OK" || r == "CANCELLED");
        if (!fine) errors.push_back(fmt::format("{} {}: {}", http ? "HTTP" : "gRPC", Name(when), r));
      }
    });
  }
  for (auto& t : clients) t.join();
  const double storm_s = std::chrono::duration<double>(Clock::now() - start).count();
  const int sent = std::min(next.load(), total);

  // The event: every worker back at zero (bounded far below the 30 s lease).
  const auto idle_from = Clock::now();
  const std::string held = WaitFleetIdle((*fleet)->workers(), (*fleet)->proxy_metrics(), 15s);
  const double idle_ms = std::chrono::duration<double, std::milli>(Clock::now() - idle_from).count();
  auto pm = Scrape((*fleet)->proxy_metrics());
  ASSERT_TRUE(pm.ok());
  double cancelled = 0;
  {
    const std::string needle = "outcome=\"cancelled\"";
    std::istringstream in(*pm);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("tandem_requests_total{", 0) == 0 && line.find(needle) != std::string::npos) {
        cancelled += std::stod(line.substr(line.rfind(' ') + 1));
      }
    }
  }
  std::printf("[cancel-storm] %d requests (32 clients, gRPC and HTTP, delays up to %.0f ms) in %.1f s; "
              "proxy counted %.0f cancelled; workers idle %.0f ms after the last client\n",
              sent, max_delay_us / 1000, storm_s, cancelled, idle_ms);
  for (const auto& [k, n] : counts) std::printf("[cancel-storm]   %5d  %s\n", n, k.c_str());
  // Where the cancels met the workers: prefills dropped, by reason.
  std::map<std::string, double> drops;
  for (const auto& w : (*fleet)->workers()) {
    auto m = Scrape(w.metrics);
    if (!m.ok()) continue;
    std::istringstream in(*m);
    std::string line;
    while (std::getline(in, line)) {
      const auto r = line.find("reason=\"");
      if (line.rfind("tandem_prefill_dropped_total{", 0) != 0 || r == std::string::npos) continue;
      drops[line.substr(r + 8, line.find('"', r + 8) - r - 8)] += std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  for (const auto& [reason, n] : drops) {
    std::printf("[cancel-storm]   prefills dropped (%s): %.0f\n", reason.c_str(), n);
  }
  EXPECT_EQ(sent, total) << "the storm ran out of time";
  EXPECT_EQ(held, "") << "held after the storm";
  EXPECT_TRUE(errors.empty()) << errors.size() << " unexpected outcomes, first: " << errors.front();
  EXPECT_GE(cancelled, total / 2.0) << "most requests should have been cancelled in flight";

  // The fleet still answers correctly.
  auto jobs = MakeJobs(4, 21);
  ASSERT_TRUE(jobs.ok()) << jobs.status().ToString();
  for (const auto& j : *jobs) {
    GenerateArgs a;
    a.prompt_ids = j.prompt;
    a.max_tokens = j.max_tokens;
    a.temperature = j.temperature;
    if (j.temperature != 0) a.seed = j.seed;
    auto c = Generate(grpc_addr, a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, j.expected);
  }
}

}  // namespace
}  // namespace tandem::testing::chaos
