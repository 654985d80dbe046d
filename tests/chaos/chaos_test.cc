// Issue 20's chaos suite (docs/failure-handling.md, "Chaos suite"): a 2P2D
// fleet of the bundled model on the CPU backend (token-exact against
// `tandem generate`, greedy and seeded), 64 concurrent streams of mixed
// lengths, and faults injected one after another, each under its own load:
//   - SIGSTOP of each worker for 1-5 s, then SIGCONT;
//   - kill -9 of a prefiller, then of a decoder, each restarted with --join;
//   - SIGTERM (drain) of a prefiller, then of a decoder, each restarted with
//     --join (a rolling restart);
//   - network delay/loss on loopback (`tc netem`, or a `tbf` slow link where
//     the kernel lacks netem) inside the test's own network namespace
//     (chaos_netns.sh), skipped with the reason where there is none.
// After each fault: every request either completed with the reference
// output or ended with a clear status, none hung to its deadline, and once
// the load stops no worker holds a running or waiting sequence, a
// reservation, a queued or parked prefill, a KV block or a quarantined block.
//
// Environment: TANDEM_CHAOS_ROUNDS=N repeats the whole fault sequence N
// times (the recorded run of bench/results/chaos.md); TANDEM_CHAOS_REPORT=PATH
// appends one markdown row per fault to PATH; TANDEM_CHAOS_ONLY=TEXT runs only
// the faults whose name contains TEXT (to chase one).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "chaos_load.h"
#include "fleet_harness.h"
#include "reaper.h"

namespace tandem::testing::chaos {
namespace {

using namespace std::chrono_literals;

constexpr int kStreams = 64;
constexpr auto kDeadline = 30s;

int EnvInt(const char* name, int fallback) {
  const char* v = getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The fleet of the suite: short leases and liveness so that faults resolve
// in seconds; KV pushes over UCX's TCP transport (the multi-host path, and
// the one loopback delay/loss reaches; the shared-memory path is covered by
// the other fleet tests).
FleetOptions ChaosFleet() {
  FleetOptions o;
  o.prefill = 2;
  o.decode = 2;
  o.num_blocks = 1024;
  o.max_num_seqs = 64;
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n  drain_seconds: 5\n";
  o.extra_yaml = "transport:\n  lease_seconds: 2\n  peer_timeout_seconds: 1.5\n";
  return o;
}

int Run(const std::string& cmd) {
  const int st = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class ChaosSuite {
 public:
  explicit ChaosSuite(Fleet& fleet, const std::vector<Job>& jobs)
      : fleet_(fleet), jobs_(jobs), live_(fleet.workers()) {}
  ~ChaosSuite() {
    for (pid_t p : joined_) StopProcess(p, 10s);
  }

  WorkerAddr* Find(const std::string& name) {
    for (auto& w : live_) {
      if (w.name == name) return &w;
    }
    return nullptr;
  }

  // Work the worker has done so far (prefills or decode steps).
  static double Work(const WorkerAddr& w) {
    auto m = Scrape(w.metrics);
    if (!m.ok()) return -1;
    return MetricValue(*m, w.role == "prefill" ? "tandem_prefill_seconds_count"
                                               : "tandem_decode_step_seconds_count");
  }

  // One fault under a fresh load of kStreams streams. `inject` runs the fault
  // and returns the worker that must serve again for the fleet to count as
  // recovered ("" for none), or an error to skip the fault with.
  void Fault(const std::string& name, const std::function<Result<std::string>()>& inject) {
    if (const char* only = getenv("TANDEM_CHAOS_ONLY"); only && name.find(only) == std::string::npos) {
      return;
    }
    SCOPED_TRACE(name);
    const double leases_before = DecoderSum("tandem_kv_lease_expired_total");
    const double stale_before = DecoderSum("tandem_kv_stale_notices_total");
    const double acked_before = DecoderSum("tandem_kv_quarantine_released_total", "acknowledged");
    const double dead_before = DecoderSum("tandem_kv_quarantine_released_total", "peer_dead");
    Load load(fleet_.proxy_grpc(), jobs_, kStreams, kDeadline);
    load.Start();
    const bool steady = WaitUntil([&] { return load.Completed() >= kStreams; }, 120s);
    EXPECT_TRUE(steady) << "no steady load before the fault";
    auto victim = inject();
    const auto end = Clock::now();
    double recovery_ms = -1;
    std::string note = std::move(note_);
    note_.clear();
    if (!victim.ok()) {
      note = "skipped: " + std::string(victim.status().message()) + (note.empty() ? "" : "; " + note);
    } else {
      const WorkerAddr* w = victim->empty() ? nullptr : Find(*victim);
      const double before = w ? Work(*w) : 0;
      const bool recovered = WaitUntil(
          [&] {
            return load.CompletedStartedAfter(end) >= kStreams && (!w || Work(*w) > before);
          },
          90s);
      EXPECT_TRUE(recovered) << "the fleet did not recover: " << load.Completed() << " completed";
      if (recovered) recovery_ms = Ms(Clock::now() - end);
    }
    load.Stop();
    FaultStats s = load.Stats(name);
    s.recovery_ms = recovery_ms;
    s.note = note;
    const std::string held = WaitFleetIdle(live_, fleet_.proxy_metrics(), 30s);
    // What the decoders saw (a restarted decoder's counters start again at 0).
    const double leases = DecoderSum("tandem_kv_lease_expired_total") - leases_before;
    const double stale = DecoderSum("tandem_kv_stale_notices_total") - stale_before;
    const double acked =
        DecoderSum("tandem_kv_quarantine_released_total", "acknowledged") - acked_before;
    const double dead = DecoderSum("tandem_kv_quarantine_released_total", "peer_dead") - dead_before;
    if (leases > 0 || stale > 0) {
      s.note += fmt::format("{}decoders: {:.0f} leases expired, {:.0f} stale notices",
                            s.note.empty() ? "" : "; ", leases, stale);
    }
    if (acked > 0 || dead > 0) {
      s.note += fmt::format("{}quarantines ended: {:.0f} acknowledged, {:.0f} writer dead",
                            s.note.empty() ? "" : "; ", acked, dead);
    }
    std::printf("[chaos] %s\n", Row(s).c_str());
    std::fflush(stdout);
    EXPECT_EQ(s.hung, 0) << "requests that ran to their deadline";
    EXPECT_EQ(s.mismatched, 0) << "completed requests whose output differs from tandem generate";
    EXPECT_EQ(s.unclear, 0) << "requests that failed without a clear status";
    EXPECT_GT(s.completed, 0);
    EXPECT_EQ(held, "") << "held after the load stopped";
    rows_.push_back(s);
  }

  // SIGSTOP for `seconds`, then SIGCONT.
  Result<std::string> Pause(const std::string& name, double seconds) {
    WorkerAddr* w = Find(name);
    if (!w) return NotFoundError(name);
    if (kill(w->pid, SIGSTOP) != 0) return InternalError("SIGSTOP failed");
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
    if (kill(w->pid, SIGCONT) != 0) return InternalError("SIGCONT failed");
    return name;
  }

  // kill -9, then the same worker restarted with --join (same name).
  Result<std::string> KillAndRejoin(const std::string& name) {
    WorkerAddr* w = Find(name);
    if (!w) return NotFoundError(name);
    if (kill(w->pid, SIGKILL) != 0) return InternalError("SIGKILL failed");
    // `tandem launch` reaps it; its pid may be reused from now on.
    Forget(w->pid);
    const std::string log =
        std::filesystem::path(fleet_.config_path()).parent_path().string() + "/" + name + ".log";
    TANDEM_ASSIGN_OR_RETURN(WorkerAddr joined, JoinWorker(fleet_, w->role, name, log));
    joined_.push_back(joined.pid);
    *w = joined;
    return name;
  }

  // Replaces the process serving `name` by a new one joined under the same
  // name with `env` (e.g. the KV fault hook), after a drain (SIGTERM) of the
  // old one.
  Status Swap(const std::string& name, const std::vector<std::string>& env) {
    WorkerAddr* w = Find(name);
    if (!w) return NotFoundError(name);
    if (std::find(joined_.begin(), joined_.end(), w->pid) != joined_.end()) {
      StopProcess(w->pid, 20s);
      joined_.erase(std::find(joined_.begin(), joined_.end(), w->pid));
    } else {
      // Started by `tandem launch`, which reaps it: gone once kill(pid, 0) fails.
      kill(w->pid, SIGTERM);
      const pid_t pid = w->pid;
      if (!WaitUntil([&] { return kill(pid, 0) != 0; }, 20s)) kill(pid, SIGKILL);
      Forget(pid);
    }
    TANDEM_ASSIGN_OR_RETURN(WorkerAddr joined, JoinWorker(fleet_, w->role, name, LogOf(name), env));
    joined_.push_back(joined.pid);
    *w = joined;
    return Status::Ok();
  }

  std::string LogOf(const std::string& name) const {
    return std::filesystem::path(fleet_.config_path()).parent_path().string() + "/" + name + ".log";
  }

  static size_t Count(const std::string& text, const std::string& needle) {
    size_t n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  }

  // Sum of `metric` over the live decoders; with `reason`, only the samples
  // labelled reason="REASON".
  double DecoderSum(const std::string& metric, const std::string& reason = "") {
    double sum = 0;
    for (const auto& w : live_) {
      if (w.role != "decode") continue;
      auto m = Scrape(w.metrics);
      if (!m.ok()) continue;
      if (reason.empty()) {
        sum += MetricValue(*m, metric);
        continue;
      }
      std::istringstream in(*m);
      std::string line;
      while (std::getline(in, line)) {
        if (line.rfind(metric + "{", 0) == 0 &&
            line.find("reason=\"" + reason + "\"") != std::string::npos) {
          sum += std::stod(line.substr(line.rfind(' ') + 1));
        }
      }
    }
    return sum;
  }

  // `name` runs with the KV fault hook set to `spec` (TANDEM_KV_FAULT) until
  // `done` holds (bounded), then is swapped back for a clean process.
  Result<std::string> KvFault(const std::string& name, const std::string& spec,
                              const std::function<bool()>& done) {
    const size_t log_from = ReadText(LogOf(name)).size();
    TANDEM_RETURN_IF_ERROR(Swap(name, {"TANDEM_KV_FAULT=" + spec + ",agent=" + name}));
    const std::string log = ReadText(LogOf(name)).substr(log_from);
    if (log.find("FAULT INJECTION ON") == std::string::npos) {
      TANDEM_RETURN_IF_ERROR(Swap(name, {}));
      return UnavailableError("this build has no KV fault hook (TANDEM_KV_FAULT)");
    }
    const bool happened = WaitUntil(done, 30s);
    const size_t injected = Count(ReadText(LogOf(name)).substr(log_from), "injected fault");
    note_ = fmt::format("`TANDEM_KV_FAULT={},agent={}`: {} faults injected", spec, name, injected);
    EXPECT_TRUE(happened) << note_;
    EXPECT_GT(injected, 0u) << note_;
    TANDEM_RETURN_IF_ERROR(Swap(name, {}));
    return name;
  }

  // The hook's faults seen in `name`'s log since `from`.
  size_t Injected(const std::string& name, size_t from) {
    const std::string log = ReadText(LogOf(name));
    return log.size() > from ? Count(log.substr(from), "injected fault") : 0;
  }

  // Delay and loss on the loopback of this test's own network namespace.
  Result<std::string> NetworkFault(double seconds) {
    if (!getenv("TANDEM_CHAOS_NETNS")) {
      const char* why = getenv("TANDEM_CHAOS_NETNS_WHY");
      return UnavailableError(fmt::format("not in a network namespace of the test's own ({})",
                                          why ? why : "run through tests/chaos/chaos_netns.sh"));
    }
    std::string kind = "netem delay 20ms 10ms loss 1%";
    if (Run("tc qdisc add dev lo root " + kind) != 0) {
      // This kernel has no sch_netem: a congested slow link (token bucket,
      // 20 Mbit/s) delays packets by queueing and drops what would wait over
      // 200 ms. (Its burst must exceed lo's 64 KiB MTU, or every full-size
      // segment is dropped.)
      kind = "tbf rate 20mbit burst 128kb latency 200ms";
      if (Run("tc qdisc add dev lo root " + kind) != 0) {
        return UnavailableError("tc qdisc add (netem, tbf) failed");
      }
      note_ = "no sch_netem in this kernel: `tc qdisc add dev lo root " + kind + "` (delay by queueing, drops past 200 ms)";
    } else {
      note_ = "`tc qdisc add dev lo root " + kind + "`";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
    if (Run("tc qdisc del dev lo root") != 0) return InternalError("tc qdisc del failed");
    return std::string();
  }

  std::vector<FaultStats>& rows() { return rows_; }
  void AppendNote(const std::string& more) { note_ += more; }

 private:
  Fleet& fleet_;
  const std::vector<Job>& jobs_;
  std::vector<WorkerAddr> live_;
  std::vector<pid_t> joined_;
  std::vector<FaultStats> rows_;
  std::string note_;  // set by a fault, shown in its row
};

TEST(Chaos, FaultsOneAfterAnotherUnder64Streams) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  const int rounds = EnvInt("TANDEM_CHAOS_ROUNDS", 1);
  auto jobs = MakeJobs(16, 20);
  ASSERT_TRUE(jobs.ok()) << jobs.status().ToString();
  setenv("UCX_TLS", "tcp", 1);  // for the fleet's processes (see ChaosFleet)
  auto fleet = Fleet::Launch(ChaosFleet());
  unsetenv("UCX_TLS");
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  ChaosSuite suite(**fleet, *jobs);
  std::mt19937 rng(2020);
  auto pause_s = [&] { return 1.0 + (rng() % 41) / 10.0; };  // 1.0 .. 5.0 s
  for (int round = 0; round < rounds; ++round) {
    for (const char* name : {"prefill-0", "prefill-1", "decode-0", "decode-1"}) {
      const double s = pause_s();
      suite.Fault(fmt::format("SIGSTOP {} {:.1f} s, SIGCONT", name, s),
                  [&] { return suite.Pause(name, s); });
    }
    suite.Fault("kill -9 prefill-0, restarted with --join",
                [&] { return suite.KillAndRejoin("prefill-0"); });
    suite.Fault("kill -9 decode-0, restarted with --join",
                [&] { return suite.KillAndRejoin("decode-0"); });
    // A rolling restart: SIGTERM (the worker drains: out of routing, its
    // in-flight work finishes or is cut and re-routed), then --join again.
    for (const char* name : {"prefill-1", "decode-1"}) {
      suite.Fault(fmt::format("SIGTERM {} (drain), restarted with --join", name),
                  [&]() -> Result<std::string> {
                    TANDEM_RETURN_IF_ERROR(suite.Swap(name, {}));
                    return std::string(name);
                  });
    }
    suite.Fault("loopback delay/loss 4 s", [&] { return suite.NetworkFault(4); });
    // The KV fault hook (TANDEM_KV_FAULT) in prefill-1: until 8 faults were
    // injected (it logs each), then prefill-1 is swapped back for a clean one.
    size_t from = ReadText(suite.LogOf("prefill-1")).size();
    suite.Fault("KV hook: every 4th data write of prefill-1 fails", [&] {
      return suite.KvFault("prefill-1", "fail_every=4", [&] { return suite.Injected("prefill-1", from) >= 8; });
    });
    // Writes stalled past the 2 s lease: the stale writers that the decoder
    // must not free (or reuse) slots under before they are confirmed done.
    from = ReadText(suite.LogOf("prefill-1")).size();
    suite.Fault("KV hook: prefill-1's first 6 data writes stalled 3 s (lease 2 s)", [&] {
      return suite.KvFault("prefill-1", "delay_ms=3000,delay_writes=6",
                           [&] { return suite.Injected("prefill-1", from) >= 6; });
    });
    // One byte of one pushed block flipped at the receiver: the checksum must
    // catch it and the request complete correctly elsewhere.
    suite.Fault("KV hook: one byte flipped in a block prefill-1 pushed", [&]() -> Result<std::string> {
      auto m = Scrape(suite.Find("decode-1")->metrics);
      if (!m.ok() || m->find("tandem_kv_checksum_failures_total") == std::string::npos) {
        return UnavailableError("this build has no KV checksums (tandem_kv_checksum_failures_total)");
      }
      const double before = suite.DecoderSum("tandem_kv_checksum_failures_total");
      auto r = suite.KvFault("prefill-1", "flip_block=5", [&] {
        return suite.DecoderSum("tandem_kv_checksum_failures_total") > before;
      });
      const double caught = suite.DecoderSum("tandem_kv_checksum_failures_total") - before;
      EXPECT_GE(caught, 1) << "the flipped byte was not caught by a checksum";
      suite.AppendNote(fmt::format("; {:.0f} caught by the decoders' checksums", caught));
      return r;
    });
  }
  int total = 0, completed = 0;
  for (const auto& r : suite.rows()) {
    total += r.completed + r.mismatched + r.failed + r.hung;
    completed += r.completed;
  }
  // The idle check reads tandem_kv_quarantined_blocks as 0 where a build
  // lacks it: say which it was.
  auto dm = Scrape(suite.Find("decode-1")->metrics);
  const bool quarantine = dm.ok() && dm->find("tandem_kv_quarantined_blocks") != std::string::npos;
  std::printf("[chaos] %d rounds: %d of %d requests completed (%.3f %%); quarantine metric %s\n",
              rounds, completed, total, 100.0 * completed / std::max(total, 1),
              quarantine ? "present" : "absent in this build");
  // Issue 20: at least 99.9 % of all requests complete (the rest end with a
  // clear status, checked per fault).
  EXPECT_GE(completed, 0.999 * total) << "completed " << completed << " of " << total;
  if (const char* path = getenv("TANDEM_CHAOS_REPORT")) {
    std::ofstream out(path, std::ios::app);
    for (const auto& r : suite.rows()) out << Row(r) << "\n";
    out << fmt::format("| **all ({} rounds)** | {} | {} | | | | | {:.3f} % completed |\n", rounds,
                       total, completed, 100.0 * completed / std::max(total, 1));
  }
}

}  // namespace
}  // namespace tandem::testing::chaos
