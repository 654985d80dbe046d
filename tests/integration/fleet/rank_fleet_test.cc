// Issue 18, a worker as a group of rank processes (docs/parallelism.md,
// "Rank processes"): a CPU fleet of two aggregated (`both`) workers with
// `tensor_parallel: 2` started by `tandem launch` (aggregated: no KV
// transfer; the cross-layout transfer and its fleet tests are
// kv-reshard's, tests/integration/fleet/tp_fleet_test.cc).
//   - the state file lists both ranks of every worker with live pids, rank
//     0's pid also as the worker's pid;
//   - greedy completions equal `tandem generate` (one process, TP 1);
//   - kill -9 of rank 1 of both-0 under load: the launcher names the rank
//     and its pid and stops the rest of the group, the worker leaves
//     routing and the state file, and the requests complete on both-1 with
//     `tandem generate`'s tokens (retried or migrated per today's rules).
//   - ranks started by hand (no launcher): after kill -9 of rank 1, rank 0's
//     next step fails UNAVAILABLE naming the rank (the proxy retries the
//     request elsewhere) and rank 0 leaves routing and exits 1.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "fleet_harness.h"
#include "reaper.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 24;

bool Alive(pid_t pid) { return pid > 0 && kill(pid, 0) == 0; }

// Worker names in the state file right now.
std::vector<std::string> StateWorkers(const std::string& state_path) {
  std::vector<std::string> names;
  const std::string text = ReadText(state_path);
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return names;
  for (const auto& w : j.value("workers", nlohmann::json::array())) names.push_back(w.value("name", ""));
  return names;
}

TEST(RankFleet, TwoRankWorkersServeListEveryRankAndDieAsAGroup) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 6; ++i) prompts.push_back(PromptIds(1800 + i, 20 + 30 * i, kVocab));
  std::vector<std::vector<uint32_t>> reference;
  for (const auto& p : prompts) {
    auto r = ReferenceGenerate(p, kMaxTokens);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reference.push_back(*r);
  }

  FleetOptions o;
  o.prefill = 0;
  o.decode = 0;
  o.both = 2;
  o.both_yaml = "  tensor_parallel: 2\n";
  // A worker of several ranks refuses KV checksums (no rank holds a whole block).
  o.extra_yaml = "transport:\n  checksum: false\n";
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n";
  o.log_level = "info";  // the launcher's lines about the group
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Fleet& f = **fleet;

  // The state file: every rank, live pids, rank 0 == the worker's pid.
  ASSERT_EQ(f.workers().size(), 2u);
  const WorkerAddr* both0 = nullptr;
  for (const auto& w : f.workers()) {
    SCOPED_TRACE(w.name);
    ASSERT_EQ(w.ranks.size(), 2u);
    EXPECT_EQ(w.ranks[0].first, 0u);
    EXPECT_EQ(w.ranks[0].second, w.pid);
    EXPECT_EQ(w.ranks[1].first, 1u);
    EXPECT_NE(w.ranks[1].second, w.pid);
    EXPECT_TRUE(Alive(w.ranks[0].second));
    EXPECT_TRUE(Alive(w.ranks[1].second));
    if (w.name == "both-0") both0 = &w;
  }
  ASSERT_NE(both0, nullptr);

  // Greedy completions equal the single-process reference (both workers
  // take requests: round_robin).
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateArgs a;
    a.prompt_ids = prompts[i];
    a.max_tokens = kMaxTokens;
    auto c = Generate(f.proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, reference[i]) << "prompt " << i;
  }

  // Load, then kill -9 of rank 1 of both-0.
  constexpr int kClients = 6;
  std::atomic<bool> stop{false};
  std::atomic<int> completed{0}, wrong{0};
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> clients;
  const auto start = Clock::now();
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; i < 30 && !stop && Clock::now() - start < 90s; ++i) {  // bounded
        const size_t k = static_cast<size_t>(t + i) % prompts.size();
        GenerateArgs a;
        a.prompt_ids = prompts[k];
        a.max_tokens = kMaxTokens;
        a.timeout = 30s;
        auto c = Generate(f.proxy_grpc(), a);
        std::lock_guard lock(mu);
        if (!c.ok()) {
          errors.push_back(c.status().ToString());
        } else {
          ++completed;
          if (c->token_ids != reference[k]) ++wrong;
        }
      }
    });
  }
  ASSERT_TRUE(WaitUntil([&] { return completed >= kClients; }, 60s)) << "no steady load";
  const pid_t victim = both0->ranks[1].second;
  const pid_t rank0 = both0->pid;
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  const int at_kill = completed;
  // The launcher names the rank and its pid, and stops the rest of the group.
  EXPECT_TRUE(WaitForLogLine(f.log_path(),
                             "both-0 rank 1 (pid " + std::to_string(victim) +
                                 ") was killed by signal 9",
                             30s))
      << ReadText(f.log_path());
  EXPECT_TRUE(WaitUntil([&] { return !Alive(rank0); }, 30s)) << "rank 0 of both-0 still runs";
  // The state file drops the worker.
  EXPECT_TRUE(WaitUntil(
      [&] { return StateWorkers(f.state_path()) == std::vector<std::string>{"both-1"}; }, 30s))
      << ReadText(f.state_path());
  // Requests keep completing on both-1.
  EXPECT_TRUE(WaitUntil([&] { return completed >= at_kill + 2 * kClients; }, 90s))
      << "no progress after the rank died";
  stop = true;
  for (auto& c : clients) c.join();
  std::printf("[rank_fleet] kill -9 both-0 rank 1 under %d clients: completed %d (%d after the "
              "kill), failed %zu\n",
              kClients, completed.load(), completed.load() - at_kill, errors.size());
  for (const auto& e : errors) std::printf("[rank_fleet]   error: %s\n", e.c_str());
  EXPECT_EQ(wrong, 0) << "completed requests whose tokens differ from tandem generate";
  for (const auto& e : errors) EXPECT_GT(e.size(), 10u) << "an error without a message: " << e;
}

// `tandem both --rank 1` of a hand-started group (no ready line: nobody
// waits for it), output appended to `log`; registered with the reaper.
pid_t SpawnFollower(const std::string& config, const std::string& group, const std::string& log) {
  std::vector<std::string> args = {std::string(TANDEM_BINARY_DIR) + "/tandem", "both", "--config",
                                   config, "--name", "hand-0", "--rank", "1", "--group", group,
                                   "--tensor-parallel", "2"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (pid > 0) ReapOnExit(pid);
  return pid;
}

TEST(RankFleet, HandStartedRankZeroLeavesWhenARankIsLost) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  const std::vector<uint32_t> prompt = PromptIds(1900, 40, kVocab);
  auto reference = ReferenceGenerate(prompt, kMaxTokens);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  FleetOptions o;
  o.prefill = 0;
  o.decode = 0;
  o.both = 1;  // one launcher-started worker (TP 1) takes over
  o.extra_yaml = "transport:\n  checksum: false\n";
  o.log_level = "info";
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Fleet& f = **fleet;
  const std::string log = f.log_path() + ".hand";
  const std::string group = "tandem-test-" + std::to_string(getpid()) + "-hand";
  // The follower first (it waits for rank 0), then rank 0 joining the proxy.
  const pid_t follower = SpawnFollower(f.config_path(), group, log);
  ASSERT_GT(follower, 0);
  auto r0 = JoinWorker(f, "both", "hand-0", log, {}, 60s,
                       {"--join", f.proxy_internal(), "--rank", "0", "--group", group,
                        "--tensor-parallel", "2"});
  ASSERT_TRUE(r0.ok()) << r0.status().ToString() << ReadText(log);
  // hand-0 serves: round_robin alternates between it and both-0.
  for (int i = 0; i < 4; ++i) {
    GenerateArgs a;
    a.prompt_ids = prompt;
    a.max_tokens = kMaxTokens;
    auto c = Generate(f.proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, *reference);
  }
  ASSERT_EQ(kill(follower, SIGKILL), 0);
  // Requests keep completing (the one that meets the broken group is
  // retried on both-0) until rank 0 has gone.
  int sent = 0;
  while (sent < 12 && Alive(r0->pid)) {
    GenerateArgs a;
    a.prompt_ids = prompt;
    a.max_tokens = kMaxTokens;
    auto c = Generate(f.proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, *reference);
    ++sent;
  }
  int status = 0;
  bool exited = false;
  ASSERT_TRUE(WaitUntil([&] { return (exited = waitpid(r0->pid, &status, WNOHANG) == r0->pid); },
                        30s))
      << "rank 0 still runs after its rank 1 died\n" << ReadText(log);
  EXPECT_TRUE(exited && WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::string text = ReadText(log);
  EXPECT_NE(text.find("rank 1 (pid " + std::to_string(follower) + ") died"), std::string::npos)
      << text;
  EXPECT_NE(text.find("leaving routing and exiting"), std::string::npos) << text;
  StopProcess(r0->pid, 5s);  // forgets it in the reaper
  StopProcess(follower, 5s);
  // The fleet serves on.
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  auto c = Generate(f.proxy_grpc(), a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids, *reference);
}

}  // namespace
}  // namespace tandem::testing
