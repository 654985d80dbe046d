// The chaos suite's load and bookkeeping (tests/chaos/README in
// docs/failure-handling.md, "Chaos suite"): a pool of requests of mixed
// lengths, greedy and seeded, each with its `tandem generate` reference;
// N client streams sending them back to back through the proxy's gRPC API;
// per fault, what became of every request; and the check that no worker
// holds anything once the load has stopped.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "fleet_harness.h"

namespace tandem::testing::chaos {

using Clock = std::chrono::steady_clock;

struct Job {
  std::vector<uint32_t> prompt;
  uint32_t max_tokens = 0;
  float temperature = 0;  // 0: greedy
  uint64_t seed = 0;
  std::vector<uint32_t> expected;  // `tandem generate` with the same settings
};

// `n` jobs: prompts of 16..~400 tokens, 8..96 completion tokens, every
// other one seeded (temperature 0.8). References computed once per binary.
Result<std::vector<Job>> MakeJobs(int n, uint32_t seed);

// What became of the requests sent during one fault.
struct FaultStats {
  std::string fault;
  int completed = 0;   // OK, output equal to the reference
  int mismatched = 0;  // OK, output different (must be 0)
  int failed = 0;      // ended with a status (code + message)
  int unclear = 0;     // failed with UNKNOWN or an empty message (must be 0)
  int hung = 0;        // still running at, or past, its deadline (must be 0)
  std::map<std::string, int> statuses;  // "UNAVAILABLE: first 80 chars of message" -> count
  double recovery_ms = -1;
  std::string note;
};

// `streams` threads, each sending jobs back to back (job index rotates) with
// `deadline` each, until Stop(); bounded by `max_per_stream` requests per
// stream.
class Load {
 public:
  Load(std::string proxy, const std::vector<Job>& jobs, int streams,
       std::chrono::milliseconds deadline, int max_per_stream = 1000);
  ~Load();
  void Start();
  // Stops sending; waits for the requests in flight (bounded by their deadlines).
  void Stop();
  // Requests that completed correctly (all, or those started after `t`).
  int Completed() const { return completed_.load(); }
  int CompletedStartedAfter(Clock::time_point t) const;
  FaultStats Stats(const std::string& fault) const;

 private:
  void Run(int stream);

  std::string proxy_;
  const std::vector<Job>& jobs_;
  int streams_, max_per_stream_;
  std::chrono::milliseconds deadline_;
  std::atomic<bool> stop_{false};
  std::atomic<int> completed_{0};
  mutable std::mutex mu_;
  std::vector<Clock::time_point> ok_starts_;
  FaultStats stats_;
  std::vector<std::thread> threads_;
};

// One markdown table row for bench/results/chaos.md.
std::string Row(const FaultStats& s);

}  // namespace tandem::testing::chaos
