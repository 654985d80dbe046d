// A decoder's KV endpoint declared lost while the decoder is alive (a
// keep-alive failure under load, a partition that heals, a stopped process;
// docs/failure-handling.md, "A decoder's KV endpoint declared lost"), with
// real processes: a sim 1P1D fleet through `tandem launch`, real gRPC and
// real UCX, and the transport's fault hook (TANDEM_KV_FAULT lose_peer_at=N:
// prefill-0's transport declares decode-0 lost at its Nth data write, as an
// endpoint error from UCX would).
//
// Under concurrent load, every request must end well before its deadline
// with its tokens or a named error; the decoder must get back every KV
// block it reserved for the pushes that failed (no reservation left for
// the lease to expire, nothing quarantined); and requests after the fault
// must be served by the same decoder (the prefiller imports its descriptor
// again instead of keeping the lost endpoint).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <sstream>
#include <string>
#include <vector>

#include "fleet_harness.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kVocab = 4000;
constexpr uint32_t kMaxTokens = 24;
constexpr int kRequests = 16;
constexpr auto kDeadline = 30s;  // each call's; the default lease is 30 s too



struct Outcome {
  Result<Completion> result;
  Clock::duration took;
};

class PeerLost : public ::testing::TestWithParam<const char*> {};

// `push`: after_prefill (one data write per request: the fault hits one
// request's only write) or streaming (many per request: it hits one mid-push).
TEST_P(PeerLost, LiveDecoderDeclaredLostStrandsNoRequestAndNoBlock) {
  const std::string push = GetParam();
  FleetOptions o;
  o.prefill = 1;
  o.decode = 1;
  o.num_blocks = 512;
  o.max_batched_tokens = 256;
  o.log_level = "info";
  o.model_yaml = "  backend: sim\n  name: itest\n  max_model_len: 4096\n";
  // The default lease (30 s): a reservation may not wait for it; every
  // block must come back by the prefiller's word long before.
  o.extra_yaml = fmt::format(
      "sim:\n  profile: H100\n  model_shape: {}/configs/sim/models/llama-3-8b\n"
      "  link_gbps: 100\n  link_latency_us: 10\n  kv_scale: 256\n"
      "transport:\n  push: {}\n",
      TANDEM_SOURCE_DIR, push);
  // The first request's write(s) go through; the fault comes under load.
  const std::string fault = push == "streaming" ? "lose_peer_at=12,agent=prefill-0"
                                                : "lose_peer_at=4,agent=prefill-0";
  setenv("TANDEM_KV_FAULT", fault.c_str(), 1);
  auto fleet = Fleet::Launch(o);
  unsetenv("TANDEM_KV_FAULT");
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_NE(d0, nullptr);
  const std::string proxy = (*fleet)->proxy_grpc();
  auto run = [&](uint32_t seed) {
    GenerateArgs a;
    a.prompt_ids = PromptIds(seed, 300 + 37 * (seed % 7), kVocab);
    a.max_tokens = kMaxTokens;
    a.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kDeadline);
    const auto start = Clock::now();
    Outcome out{Generate(proxy, a), {}};
    out.took = Clock::now() - start;
    return out;
  };

  // One request before the fault: the fleet serves.
  {
    Outcome first = run(1);
    ASSERT_TRUE(first.result.ok()) << first.result.status().ToString();
    ASSERT_EQ(first.result->token_ids.size(), kMaxTokens);
  }
  // The load: the fault fires among these.
  std::vector<std::future<Outcome>> calls;
  for (int i = 0; i < kRequests; ++i) {
    calls.push_back(std::async(std::launch::async, run, 100 + i));
  }
  int ok = 0, named = 0;
  std::vector<std::string> other;
  double longest_s = 0;
  for (auto& c : calls) {
    Outcome out = c.get();
    longest_s = std::max(longest_s, std::chrono::duration<double>(out.took).count());
    if (out.result.ok()) {
      EXPECT_EQ(out.result->token_ids.size(), kMaxTokens);
      ++ok;
      continue;
    }
    const Status& s = out.result.status();
    // A named error: the decoder whose KV push failed, and why.
    if (s.code() == StatusCode::kUnavailable &&
        s.message().find("decoder 'decode-0'") != std::string::npos) {
      ++named;
    } else {
      other.push_back(s.ToString());
    }
  }
  std::printf("[peer_lost] push %s: %d of %d completed, %d ended with a named error, %zu "
              "otherwise; longest call %.2f s (deadline %lld s)\n",
              push.c_str(), ok, kRequests, named, other.size(), longest_s,
              static_cast<long long>(kDeadline.count()));
  ASSERT_TRUE(WaitForLogLine((*fleet)->log_path(), "declares peer", 1s).has_value())
      << "the fault never fired (" << fault << ")";
  // The decoder heard of the abandoned reservations over a fresh endpoint.
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(), "over a fresh KV endpoint", 10s).has_value());
  EXPECT_EQ(ok + named, kRequests) << "other endings: " << fmt::format("{}", fmt::join(other, " | "));
  EXPECT_LT(longest_s, 15.0) << "a request waited for its deadline or a lease";

  // Every block back on the decoder, by the prefiller's notice, not by a
  // lease (30 s, far past this bound): no reservation, nothing quarantined,
  // no KV block used; nothing left in flight anywhere.
  const std::string held = WaitFleetIdle((*fleet)->workers(), (*fleet)->proxy_metrics(), 15s);
  EXPECT_EQ(held, "") << "still held after the load";
  EXPECT_EQ(Metric(d0->metrics, "tandem_kv_lease_expired_total"), 0);

  // The same decoder serves again: through a fresh endpoint.
  const double steps = Metric(d0->metrics, "tandem_decode_step_seconds_count");
  for (uint32_t seed = 500; seed < 504; ++seed) {
    Outcome after = run(seed);
    ASSERT_TRUE(after.result.ok()) << "after the fault: " << after.result.status().ToString();
    EXPECT_EQ(after.result->token_ids.size(), kMaxTokens);
  }
  EXPECT_GT(Metric(d0->metrics, "tandem_decode_step_seconds_count"), steps);
  EXPECT_EQ(WaitFleetIdle((*fleet)->workers(), (*fleet)->proxy_metrics(), 15s), "");
  // Closing the lost endpoint may make decode-0's own endpoint to prefill-0
  // fail (UCX over TCP: a reset); decode-0 then counts prefill-0 dead until
  // prefill-0 reserves again, which proves it alive.
  const std::string log = ReadText((*fleet)->log_path());
  std::istringstream lines(log);
  bool decoder_saw_failure = false;
  for (std::string line; std::getline(lines, line);) {
    decoder_saw_failure |= line.find("[decode-0] kvtransfer: peer") != std::string::npos &&
                           line.find("(prefill-0 generation") != std::string::npos;
  }
  std::printf("[peer_lost] decode-0's endpoint to prefill-0 %s\n",
              decoder_saw_failure ? "failed too" : "stayed up");
  if (decoder_saw_failure) {
    EXPECT_NE(log.find("reserves again: alive"), std::string::npos)
        << "decode-0 kept the live prefill-0 for dead";
  }
}

INSTANTIATE_TEST_SUITE_P(Push, PeerLost, ::testing::Values("after_prefill", "streaming"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace tandem::testing
