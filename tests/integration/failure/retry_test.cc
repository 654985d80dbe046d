// Issue 20: a retry must never collide with its own first attempt. Real
// processes started by `tandem launch` (2P2D), real gRPC and UCX on
// loopback: a prefiller is paused (SIGSTOP) under 32 concurrent streams and
// resumed ~3 s later; the proxy abandons its calls and re-routes, often to
// workers that still hold the abandoned attempt of the same request. Every
// request must complete with `tandem generate`'s output (before each
// attempt had its own identity on the workers, 1-2 of 32 failed with
// ALREADY_EXISTS "request 'req-N' is already here").
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kVocab = 4096;



// 32 streams of back-to-back requests on a fleet of `prefill` x `decode`;
// once the load is steady, `victim` is paused (SIGSTOP) for ~3 s in all,
// then resumed; one more wave after it is back in routing. Every request
// must complete with `tandem generate`'s output.
void PauseUnderLoad(int prefill, int decode, const std::string& victim) {
  constexpr int kStreams = 32;
  constexpr uint32_t kMaxTokens = 32;
  // 8 prompts of 60-375 tokens (up to 3 chunks of 128): prefills are in
  // flight when the victim stops.
  std::vector<std::vector<uint32_t>> prompts;
  std::map<size_t, std::vector<uint32_t>> reference;
  for (uint32_t i = 0; i < 8; ++i) {
    prompts.push_back(PromptIds(2000 + i, 60 + 45 * i, kVocab));
    auto ref = ReferenceGenerate(prompts.back(), kMaxTokens);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    reference[i] = *ref;
  }

  FleetOptions o;
  o.prefill = prefill;
  o.decode = decode;
  o.log_level = "info";  // the proxy's "out of routing" / "back in routing" lines
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n";
  o.extra_yaml = "transport:\n  lease_seconds: 2\n  peer_timeout_seconds: 1.5\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* paused = FindWorker(**fleet, victim);
  ASSERT_NE(paused, nullptr);
  const std::string log = (*fleet)->log_path();

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, wrong{0};
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> clients;
  const auto load_start = Clock::now();
  for (int t = 0; t < kStreams; ++t) {
    clients.emplace_back([&, t] {
      // Back to back, bounded in count and in time.
      for (int i = 0; i < 12 && !stop && Clock::now() - load_start < 90s; ++i) {
        const size_t p = static_cast<size_t>(t + i) % prompts.size();
        GenerateArgs a;
        a.prompt_ids = prompts[p];
        a.max_tokens = kMaxTokens;
        a.timeout = 60s;
        auto c = Generate((*fleet)->proxy_grpc(), a);
        std::lock_guard lock(mu);
        if (!c.ok()) {
          errors.push_back(fmt::format("stream {} request {}: {}", t, i, c.status().ToString()));
        } else if (c->token_ids != reference[p]) {
          ++wrong;
        } else {
          ++ok;
        }
      }
    });
  }
  // Stop the victim under steady load (the first wave done, all 32 in flight).
  const bool loaded = WaitUntil(
      [&] {
        return ok.load() + wrong.load() >= kStreams &&
               Metric((*fleet)->proxy_metrics(), "tandem_requests_inflight") >= kStreams;
      },
      60s);
  ASSERT_TRUE(loaded) << "no steady load of 32 streams";
  ASSERT_EQ(kill(paused->pid, SIGSTOP), 0);
  const auto stopped_at = Clock::now();
  const size_t log_at = ReadText(log).size();
  // The proxy notices (liveness), ends its calls and re-routes them.
  auto out = WaitForLogLine(log, "worker " + victim + " out of routing", 20s, log_at);
  EXPECT_TRUE(out.has_value()) << "the proxy never took the paused worker out of routing";
  // The fault lasts ~3 s in all (the reproduction), then it wakes.
  std::this_thread::sleep_until(stopped_at + 3s);
  ASSERT_EQ(kill(paused->pid, SIGCONT), 0);
  const bool back = WaitForLogLine(log, "worker " + victim + " answers again: back in routing", 20s,
                                   out.value_or(log_at))
                        .has_value();
  // One more wave with the victim back, then the streams stop.
  const int at_back = ok.load() + wrong.load();
  WaitUntil([&] { return ok.load() + wrong.load() >= at_back + kStreams; }, 60s);
  stop = true;
  for (auto& c : clients) c.join();

  const double retries = Metric((*fleet)->proxy_metrics(), "tandem_request_retries_total");
  std::printf("[retry] %s paused 3 s under %d streams (%dP%dD): completed %d, wrong %d, "
              "failed %zu, retries %.0f, back in routing %d\n",
              victim.c_str(), kStreams, prefill, decode, ok.load(), wrong.load(), errors.size(),
              retries, back);
  for (const auto& e : errors) std::printf("[retry]   %s\n", e.c_str());
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(wrong, 0) << "completed requests whose output differs from tandem generate";
  EXPECT_GE(ok, 3 * kStreams);
  EXPECT_GE(retries, 1) << "nothing was re-routed: the pause did not hit a request in flight";
  EXPECT_TRUE(back) << victim << " did not come back into routing after SIGCONT";
}

// The reproduction: a prefiller paused under 32 streams in 2P2D.
TEST(Retry, PausedPrefillerUnder32StreamsEveryRequestCompletes) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  PauseUnderLoad(2, 2, "prefill-0");
}

// The same collision made certain: with one prefiller, every request
// re-routed away from a paused decoder goes back to the prefiller that
// still holds its first attempt (waiting on its Reserve to the paused
// decoder, or prefilling it until the cancel lands).
TEST(Retry, PausedDecoderRetriesReachTheSamePrefiller) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  PauseUnderLoad(1, 2, "decode-0");
}


// Seeded (non-greedy) sampling through a migration: decode-0 is killed
// (SIGKILL) while seeded streams are on it; the proxy re-prefills prompt +
// sent tokens on decode-1 with the random stream continued at index `sent`
// (first_sample_index), so every completion equals `tandem generate
// --temperature T --seed S` for the same request (docs/failure-handling.md).
TEST(Migration, SeededSamplingThroughAMigrationEqualsTheUnmigratedOutput) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  namespace pb = ::tandem::v1;
  constexpr int kStreams = 4;
  constexpr uint32_t kMaxTokens = 400;
  constexpr float kTemperature = 0.9f;
  std::vector<std::vector<uint32_t>> prompts, reference;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(PromptIds(2100 + i, 40 + 10 * i, kVocab));
    auto ref = ReferenceGenerate(prompts.back(), kMaxTokens, kTemperature, 7000 + i);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    ASSERT_EQ(ref->size(), kMaxTokens);
    reference.push_back(*ref);
  }
  // Sampling really is random here: the seeds give different completions
  // than greedy decoding does.
  auto greedy = ReferenceGenerate(prompts[0], kMaxTokens);
  ASSERT_TRUE(greedy.ok());
  ASSERT_NE(*greedy, reference[0]);

  FleetOptions o;
  o.prefill = 1;
  o.decode = 2;
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n";
  o.extra_yaml = "transport:\n  lease_seconds: 2\n  peer_timeout_seconds: 1.5\n";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_NE(d0, nullptr);
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel((*fleet)->proxy_grpc(), grpc::InsecureChannelCredentials()));

  std::vector<std::vector<uint32_t>> got(kStreams);
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::atomic<size_t>> received(kStreams);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 60s);
      pb::GenerateRequest req;
      for (uint32_t t : prompts[i]) req.add_prompt_token_ids(t);
      req.set_max_tokens(kMaxTokens);
      req.mutable_sampling()->set_temperature(kTemperature);
      req.mutable_sampling()->set_seed(7000 + i);
      req.set_ignore_eos(true);
      auto reader = stub->Generate(&ctx, req);
      pb::GenerateResponse resp;
      while (reader->Read(&resp)) {
        got[i].insert(got[i].end(), resp.token_ids().begin(), resp.token_ids().end());
        received[i] = got[i].size();
      }
      status[i] = reader->Finish();
    });
  }
  // Every stream has produced a few tokens (of 400 each: far from done).
  const bool streaming = WaitUntil(
      [&] {
        for (auto& r : received) {
          if (r.load() < 4) return false;
        }
        return true;
      },
      60s);
  EXPECT_TRUE(streaming) << "the streams never all started";
  ASSERT_EQ(kill(d0->pid, SIGKILL), 0);
  for (auto& c : clients) c.join();

  const double migrations = Metric((*fleet)->proxy_metrics(), "tandem_request_migrations_total");
  std::printf("[migration] seeded (T=%.1f) streams, decode-0 killed mid-stream: %.0f migrations\n",
              kTemperature, migrations);
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_TRUE(status[i].ok()) << i << ": " << status[i].error_message();
    EXPECT_EQ(got[i], reference[i]) << "stream " << i << " (seed " << 7000 + i << ")";
  }
  // Round robin put half of them on decode-0: they were migrated, mid-stream.
  EXPECT_GE(migrations, 1) << "no stream was on decode-0 when it died";
}

}  // namespace
}  // namespace tandem::testing
