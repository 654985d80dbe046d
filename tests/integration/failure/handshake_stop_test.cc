// A prefiller stopped (SIGSTOP) before it answered the connection handshake
// of the decoder's new watch endpoint, with real processes: a 2P1D CPU fleet
// through `tandem launch`, real gRPC, real UCX. The decoder makes that
// endpoint at the prefiller's first Reserve; the KV fault hook
// (TANDEM_KV_FAULT stop_peer_at_import=1, decode-0 only) SIGSTOPs the
// prefiller right then, before the endpoint exists, so the stop covers the
// handshake every run. The stop outlasts transport.peer_timeout_seconds and
// the lease: the decoder must keep that reservation's blocks quarantined
// (the stopped prefiller is alive and could still write into them: before,
// the handshake declared it dead and freed them), the request is served by
// the other prefiller meanwhile, and after SIGCONT the prefiller's word ends
// the quarantine and the fleet serves `tandem generate`'s tokens
// (docs/failure-handling.md, "Quarantine"; docs/kvtransfer.md, "Connection
// handshake"). The same stop held past the prefiller's Reserve deadline
// (its reply then comes after the call ended there) must end the same way.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "fleet_harness.h"
#include "kvtransfer/process_identity.h"

namespace tandem::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kVocab = 4096;
constexpr uint32_t kMaxTokens = 16;

// The state letter of /proc/PID/stat ('T': stopped), '?' when unreadable.
char ProcState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  char state = '?';
  uint64_t start = 0;
  return kvtransfer::ParseProcStat(line, &state, &start) ? state : '?';
}

// 2P1D whose decode-0 stops (SIGSTOP) the prefiller of its first Reserve
// at that prefiller's first import (TANDEM_KV_FAULT stop_peer_at_import=1).
// The handshake bound (1 s) ends well before the lease (2 s): without the
// liveness rule the decoder declares the stopped prefiller dead first and
// frees the expired reservation at once.
Result<std::unique_ptr<Fleet>> LaunchStoppingFleet() {
  FleetOptions o;
  o.prefill = 2;
  o.decode = 1;
  o.num_blocks = 512;
  o.log_level = "info";  // the transport's "waiting for it" line
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n  drain_seconds: 8\n";
  o.extra_yaml = "transport:\n  lease_seconds: 2\n  peer_timeout_seconds: 1\n";
  setenv("TANDEM_KV_FAULT", "stop_peer_at_import=1,agent=decode-0", 1);
  auto fleet = Fleet::Launch(o);
  unsetenv("TANDEM_KV_FAULT");
  return fleet;
}

// The prefiller of `p` that the hook stopped (waited for), or null.
const WorkerAddr* StoppedPrefiller(const WorkerAddr* const (&p)[2]) {
  const WorkerAddr* victim = nullptr;
  WaitUntil(
      [&] {
        for (const WorkerAddr* w : p) {
          if (ProcState(w->pid) == 'T') victim = w;
        }
        return victim != nullptr;
      },
      20s);
  return victim;
}

// Waits (bounded) until `decoder` holds no quarantined block and released
// at least one by a prefiller's acknowledgement.
bool QuarantineAcknowledged(const WorkerAddr& decoder) {
  return WaitUntil(
      [&] {
        return Metric(decoder.metrics, "tandem_kv_quarantined_blocks") == 0 &&
               LabeledMetric(decoder.metrics, "tandem_kv_quarantine_released_total",
                             "acknowledged") >= 1;
      },
      15s);
}

// Whatever fails, the victim is not left stopped.
struct Resume {
  pid_t pid;
  ~Resume() { kill(pid, SIGCONT); }
};

TEST(HandshakeStop, PrefillerStoppedBeforeTheWatchHandshakeKeepsItsQuarantine) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<std::vector<uint32_t>> want;
  for (uint32_t i = 0; i < 5; ++i) {
    prompts.push_back(PromptIds(1400 + i, 60 + 20 * i, kVocab));
    auto ref = ReferenceGenerate(prompts.back(), kMaxTokens);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    want.push_back(*ref);
  }
  auto fleet = LaunchStoppingFleet();
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  const WorkerAddr* p[2] = {FindWorker(**fleet, "prefill-0"), FindWorker(**fleet, "prefill-1")};
  ASSERT_TRUE(d0 && p[0] && p[1]);
  const std::string proxy = (*fleet)->proxy_grpc();
  auto run = [&](size_t i) {
    GenerateArgs a;
    a.prompt_ids = prompts[i];
    a.max_tokens = kMaxTokens;
    a.timeout = 30s;
    return Generate(proxy, a);
  };

  // The first request: its prefiller's Reserve makes decode-0's watch
  // endpoint, and the hook stops that prefiller before it can answer.
  auto first = std::async(std::launch::async, [&] { return run(0); });
  const WorkerAddr* victim = StoppedPrefiller(p);
  ASSERT_NE(victim, nullptr) << "no prefiller was stopped at decode-0's first import";
  const Resume resume{victim->pid};
  const auto stopped_at = Clock::now();
  std::printf("[handshake-stop] %s (pid %d) stopped at decode-0's first import\n",
              victim->name.c_str(), victim->pid);

  // The event: the reservation's lease (2 s, past the 1 s handshake bound)
  // expired while the prefiller was stopped. Its blocks must be
  // quarantined, not released as a dead writer's.
  ASSERT_TRUE(WaitUntil([&] { return Metric(d0->metrics, "tandem_kv_lease_expired_total") >= 1; },
                        15s))
      << "the stopped prefiller's reservation never expired";
  EXPECT_TRUE(WaitUntil([&] { return Metric(d0->metrics, "tandem_kv_quarantined_blocks") > 0; }, 5s))
      << "nothing quarantined after the lease expired";
  // decode-0's transport found the handshake overdue and the process alive.
  EXPECT_TRUE(WaitForLogLine((*fleet)->log_path(),
                             fmt::format("but its process {} on this host is alive", victim->pid),
                             5s)
                  .has_value())
      << "decode-0 never judged the overdue handshake by the prefiller's process";
  const double stopped_s = std::chrono::duration<double>(Clock::now() - stopped_at).count();
  EXPECT_EQ(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"), 0)
      << "the stopped (alive) prefiller was declared dead";
  EXPECT_EQ(ProcState(victim->pid), 'T');
  // The first request was served meanwhile by the other prefiller.
  auto c = first.get();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids, want[0]);
  EXPECT_GT(Metric(d0->metrics, "tandem_kv_quarantined_blocks"), 0)
      << "the quarantine ended while its writer was stopped";
  EXPECT_EQ(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"), 0);
  std::printf("[handshake-stop] after %.2f s stopped: %.0f blocks quarantined, %.0f released as "
              "peer_dead\n",
              stopped_s, Metric(d0->metrics, "tandem_kv_quarantined_blocks"),
              LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"));

  // Wake it: its acknowledgement ends the quarantine; the fleet serves
  // exact tokens, the woken prefiller included.
  ASSERT_EQ(kill(victim->pid, SIGCONT), 0);
  EXPECT_TRUE(QuarantineAcknowledged(*d0))
      << "the woken prefiller did not end its quarantine";
  const double prefills_before = Metric(victim->metrics, "tandem_prefill_seconds_count");
  for (int round = 0; round < 5; ++round) {
    std::vector<std::future<Result<Completion>>> calls;
    for (size_t i = 1; i < prompts.size(); ++i) {
      calls.push_back(std::async(std::launch::async, [&, i] { return run(i); }));
    }
    for (size_t i = 1; i < prompts.size(); ++i) {
      auto r = calls[i - 1].get();
      ASSERT_TRUE(r.ok()) << "prompt " << i << ": " << r.status().ToString();
      EXPECT_EQ(r->token_ids, want[i]) << "prompt " << i;
    }
    if (Metric(victim->metrics, "tandem_prefill_seconds_count") > prefills_before) break;
  }
  EXPECT_GT(Metric(victim->metrics, "tandem_prefill_seconds_count"), prefills_before)
      << victim->name << " did not serve again after SIGCONT";
  EXPECT_EQ(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"), 0);
  const std::string held = WaitFleetIdle((*fleet)->workers(), "", 15s);
  EXPECT_EQ(held, "") << "still held after the load: " << held;
}

// The same stop, held past the stopped prefiller's Reserve deadline (the
// request's own: the client's 5 s timeout, sooner than the link's 10 s):
// when it wakes, its Reserve call has ended here before the decoder's reply,
// which waits in its socket, is read (a stopped process's epoll_wait ends
// EINTR after SIGCONT and the frame loop expires the call first). The
// decoder holds a reservation for it all the same, quarantined once the
// lease expired: the late reply must still be acknowledged (an error
// notice), or the blocks stay out of use until that prefiller dies (session
// 15: released as "dead" only when the fleet stopped;
// docs/failure-handling.md, "Quarantine").
TEST(HandshakeStop, PrefillerStoppedPastItsReserveDeadlineStillEndsItsQuarantine) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  const auto prompt = PromptIds(1500, 80, kVocab);
  auto want = ReferenceGenerate(prompt, kMaxTokens);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  auto fleet = LaunchStoppingFleet();
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  const WorkerAddr* p[2] = {FindWorker(**fleet, "prefill-0"), FindWorker(**fleet, "prefill-1")};
  ASSERT_TRUE(d0 && p[0] && p[1]);
  const std::string proxy = (*fleet)->proxy_grpc();
  GenerateArgs a;
  a.prompt_ids = prompt;
  a.max_tokens = kMaxTokens;
  a.timeout = 5s;  // the prefill job's deadline, so its Reserve call's too
  const auto deadline = std::chrono::system_clock::now() + a.timeout;
  auto first = std::async(std::launch::async, [&] { return Generate(proxy, a); });
  const WorkerAddr* victim = StoppedPrefiller(p);
  ASSERT_NE(victim, nullptr) << "no prefiller was stopped at decode-0's first import";
  const Resume resume{victim->pid};
  ASSERT_TRUE(WaitUntil([&] { return Metric(d0->metrics, "tandem_kv_quarantined_blocks") > 0; },
                        15s))
      << "the stopped prefiller's reservation was never quarantined";
  // The event: the request's deadline, which its Reserve call had, passed
  // while the prefiller was stopped (the client's call has ended by then).
  first.wait();
  ASSERT_TRUE(WaitUntil([&] { return std::chrono::system_clock::now() > deadline; }, 10s));
  EXPECT_EQ(ProcState(victim->pid), 'T');
  EXPECT_GT(Metric(d0->metrics, "tandem_kv_quarantined_blocks"), 0);

  const auto woke = Clock::now();
  ASSERT_EQ(kill(victim->pid, SIGCONT), 0);
  EXPECT_TRUE(QuarantineAcknowledged(*d0))
      << "the woken prefiller did not acknowledge the reservation whose reply came after its "
         "Reserve deadline";
  std::printf("[handshake-stop] late reply acknowledged %.2f s after SIGCONT\n",
              std::chrono::duration<double>(Clock::now() - woke).count());
  EXPECT_EQ(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"), 0);
  // The fleet still serves exact tokens.
  a.timeout = 30s;
  auto c = Generate(proxy, a);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->token_ids, *want);
  const std::string held = WaitFleetIdle((*fleet)->workers(), "", 15s);
  EXPECT_EQ(held, "") << "still held after the load: " << held;
}

}  // namespace
}  // namespace tandem::testing
