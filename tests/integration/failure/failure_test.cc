// Issue 6's acceptance tests (docs/failure-handling.md), with real
// processes started by `tandem launch`, real gRPC and real UCX on loopback:
//   - kill -9 of a prefiller, later of a decoder, under 16 concurrent
//     streams in 2P2D: every request completes with `tandem generate`'s
//     output or ends with a clear error, none outlives its deadline;
//   - a decoder started with --join after the fleet is up gets requests and
//     answers them correctly; a worker with another block size is refused;
//   - a reservation whose prefiller was SIGSTOPped expires after the lease;
//     its blocks wait in quarantine (the stopped prefiller may still write)
//     while the decoder serves others, and after SIGCONT the prefiller
//     confirms its writes ended, the decoder returns to idle and nothing is
//     corrupted;
//   - SIGTERM to `tandem launch` under load drains: in-flight requests
//     finish, new ones get UNAVAILABLE, every process exits in time.
// Leases and timeouts are short in these fleets so the tests stay fast.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "fleet_harness.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {
namespace {

namespace pb = ::tandem::v1;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint32_t kVocab = 4096;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// `tandem generate` once per (prompt, max_tokens), cached for the binary.
const std::vector<uint32_t>& Reference(const std::vector<uint32_t>& prompt, uint32_t max_tokens) {
  static std::mutex mu;
  static std::map<std::pair<std::vector<uint32_t>, uint32_t>, std::vector<uint32_t>> cache;
  std::lock_guard lock(mu);
  auto key = std::make_pair(prompt, max_tokens);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto ids = ReferenceGenerate(prompt, max_tokens);
    EXPECT_TRUE(ids.ok()) << ids.status().ToString();
    it = cache.emplace(key, ids.ok() ? *ids : std::vector<uint32_t>{}).first;
  }
  return it->second;
}

// One streamed Generate with the client-side timing of every message.
struct Streamed {
  grpc::Status status;
  std::vector<uint32_t> token_ids;
  double longest_gap_ms = 0;  // between consecutive messages (or start and the first)
  double total_ms = 0;
};

Streamed Stream(pb::Generation::Stub& stub, const std::vector<uint32_t>& prompt,
                uint32_t max_tokens, std::chrono::milliseconds deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  pb::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  req.set_ignore_eos(true);
  Streamed s;
  const auto start = Clock::now();
  auto last = start;
  auto reader = stub.Generate(&ctx, req);
  pb::GenerateResponse resp;
  while (reader->Read(&resp)) {
    const auto now = Clock::now();
    s.longest_gap_ms = std::max(s.longest_gap_ms, Ms(now - last));
    last = now;
    s.token_ids.insert(s.token_ids.end(), resp.token_ids().begin(), resp.token_ids().end());
  }
  s.status = reader->Finish();
  s.total_ms = Ms(Clock::now() - start);
  return s;
}

std::string Tandem() { return std::string(TANDEM_BINARY_DIR) + "/tandem"; }

// Runs `tandem ARGS...` in the background with stdout+stderr to `log`.
// `salt`: the fleet's (Fleet::cache_salt), for a worker joining it by hand.
pid_t Spawn(const std::vector<std::string>& args, const std::string& log,
            const std::string& salt = "") {
  const pid_t pid = fork();
  if (pid == 0) {
    if (!salt.empty()) setenv("TANDEM_CACHE_SALT", salt.c_str(), 1);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<std::string> all = {Tandem()};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits (bounded) for `pid` to exit; its wait status, or nullopt.
std::optional<int> WaitExit(pid_t pid, std::chrono::milliseconds limit) {
  const auto give_up = Clock::now() + limit;
  while (Clock::now() < give_up) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return st;
    std::this_thread::sleep_for(20ms);
  }
  return std::nullopt;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}



// Polls until `pred` holds (bounded); returns whether it did.
template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds limit) {
  const auto give_up = Clock::now() + limit;
  while (Clock::now() < give_up) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
}


// The fleets of this file: short leases and liveness so failures resolve
// within seconds.
FleetOptions FailureFleet(int prefill, int decode) {
  FleetOptions o;
  o.prefill = prefill;
  o.decode = decode;
  o.num_blocks = 512;
  o.proxy_yaml = "  liveness_timeout_seconds: 1\n  max_migrations: 3\n  drain_seconds: 8\n";
  o.extra_yaml = "transport:\n  lease_seconds: 2\n  peer_timeout_seconds: 1.5\n";
  return o;
}

// kill -9 one prefiller, later one decoder, under 16 concurrent streams.
TEST(Failure, KillPrefillerThenDecoderUnderLoad) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  constexpr int kStreams = 16;
  constexpr uint32_t kMaxTokens = 64;
  constexpr auto kDeadline = 30s;
  std::vector<std::vector<uint32_t>> prompts;
  // Long enough (up to ~380 tokens, 3 chunks) that prefills are in flight when one dies.
  for (uint32_t i = 0; i < 8; ++i) prompts.push_back(PromptIds(600 + i, 60 + 45 * i, kVocab));
  for (const auto& p : prompts) ASSERT_FALSE(Reference(p, kMaxTokens).empty());

  auto fleet = Fleet::Launch(FailureFleet(2, 2));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* p0 = FindWorker(**fleet, "prefill-0");
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_TRUE(p0 && d0);
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel((*fleet)->proxy_grpc(), grpc::InsecureChannelCredentials()));

  std::atomic<bool> stop{false};
  std::atomic<int> completed{0}, failed{0}, wrong{0}, late{0};
  std::mutex mu;
  double longest_stall_ms = 0;
  std::vector<std::string> errors;
  std::vector<std::thread> clients;
  // A failed ASSERT returns from here: the clients stop and are joined
  // first (each within its stream's deadline), not left to abort the run.
  struct JoinClients {
    std::atomic<bool>& stop;
    std::vector<std::thread>& clients;
    ~JoinClients() {
      stop = true;
      for (auto& c : clients) {
        if (c.joinable()) c.join();
      }
    }
  } join_clients{stop, clients};
  const auto load_start = Clock::now();
  for (int t = 0; t < kStreams; ++t) {
    clients.emplace_back([&, t] {
      // Bounded in count and in time.
      for (int i = 0; i < 40 && !stop && Clock::now() - load_start < 60s; ++i) {
        const auto& prompt = prompts[(t + i) % prompts.size()];
        Streamed s = Stream(*stub, prompt, kMaxTokens, kDeadline);
        std::lock_guard lock(mu);
        longest_stall_ms = std::max(longest_stall_ms, s.longest_gap_ms);
        if (s.total_ms > Ms(kDeadline) + 2000) ++late;
        if (s.status.ok()) {
          ++completed;
          if (s.token_ids != Reference(prompt, kMaxTokens)) ++wrong;
        } else {
          ++failed;
          errors.push_back(fmt::format("{}: {}", static_cast<int>(s.status.error_code()),
                                       s.status.error_message()));
        }
      }
    });
  }
  const auto wait_completed = [&](int n, std::chrono::seconds limit) {
    return WaitFor([&] { return completed.load() >= n; }, limit);
  };
  ASSERT_TRUE(wait_completed(kStreams, 60s)) << "no steady load";
  ASSERT_EQ(kill(p0->pid, SIGKILL), 0);
  const int at_prefill_kill = completed;
  ASSERT_TRUE(wait_completed(at_prefill_kill + kStreams, 60s)) << "no progress after the prefiller died";
  // With one prefiller left most streams wait on prefill, so decode-0 can
  // be empty at any given moment: kill it as soon as a scrape (which
  // samples the engine afresh) shows a request in its running batch.
  ASSERT_TRUE(WaitFor([&] { return Metric(d0->metrics, "tandem_num_requests_running") >= 1; }, 30s))
      << "decode-0 never had a request in its running batch";
  ASSERT_EQ(kill(d0->pid, SIGKILL), 0);
  const int at_decode_kill = completed;
  EXPECT_TRUE(wait_completed(at_decode_kill + 2 * kStreams, 60s))
      << "no progress after the decoder died";
  stop = true;
  for (auto& c : clients) c.join();

  const double migrations = Metric((*fleet)->proxy_metrics(), "tandem_request_migrations_total");
  const double retries = Metric((*fleet)->proxy_metrics(), "tandem_request_retries_total");
  const WorkerAddr* p1 = FindWorker(**fleet, "prefill-1");
  const double target_lost =
      p1 ? LabeledMetric(p1->metrics, "tandem_prefill_dropped_total", "reason=\"target_lost\"") : -1;
  std::printf("[failure] kill -9 prefill-0 then decode-0 under %d streams: completed %d, failed %d, "
              "longest client-side stall %.0f ms, migrations %.0f, retries %.0f, prefill-1 drops "
              "(push target lost) %.0f\n",
              kStreams, completed.load(), failed.load(), longest_stall_ms, migrations, retries,
              target_lost);
  for (const auto& e : errors) std::printf("[failure]   error: %s\n", e.c_str());
  EXPECT_EQ(wrong, 0) << "completed requests whose output differs from tandem generate";
  EXPECT_EQ(late, 0) << "requests that outlived their deadline";
  for (const auto& e : errors) {
    // A clear error: a status with a message (e.g. no pair left to migrate to).
    EXPECT_NE(e.find(": "), std::string::npos);
    EXPECT_GT(e.size(), 10u) << e;
  }
  // The decoder died with a stream in its running batch: some were
  // migrated, and those (like every completed request) equal the reference.
  EXPECT_GE(migrations, 1) << "no stream was on decode-0 when it died?";
}

// A decoder joins a running fleet and serves; another block size is refused.
TEST(Failure, JoinedDecoderServesAndMismatchIsRefused) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  FleetOptions o = FailureFleet(1, 1);
  o.log_level = "info";  // the proxy's "joined" line
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const std::string dir = std::filesystem::path((*fleet)->config_path()).parent_path();

  // The mismatch first: same fleet file but block_size 32.
  {
    std::string yaml = ReadFile((*fleet)->config_path());
    const auto at = yaml.find("block_size: 16");
    ASSERT_NE(at, std::string::npos);
    yaml.replace(at, 14, "block_size: 32");
    const std::string other = dir + "/other.yaml";
    std::ofstream(other) << yaml;
    const std::string log = dir + "/mismatch.log";
    std::vector<std::string> args = {"decode", "--config", other, "--grpc", "127.0.0.1:0",
                                     "--metrics", "127.0.0.1:0", "--name", "decode-odd"};
    for (const auto& a : (*fleet)->JoinArgs()) args.push_back(a);
    const pid_t pid = Spawn(args, log, (*fleet)->cache_salt());
    auto st = WaitExit(pid, 60s);
    if (!st) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
    ASSERT_TRUE(st.has_value()) << "a mismatched worker was not refused";
    EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 1) << *st;
    const std::string out = ReadFile(log);
    EXPECT_NE(out.find("block_size 32 differs from the fleet's 16"), std::string::npos) << out;
  }

  // Now a compatible decoder joins.
  const std::string log = dir + "/joined.log";
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  // argv is built before fork: the child only execs.
  const std::string bin = Tandem(), ready = std::to_string(fds[1]);
  std::vector<std::string> args = {bin, "decode", "--config", (*fleet)->config_path(),
                                   "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
                                   "--name", "decode-late", "--node", "host-b", "--zone",
                                   "rack-2", "--ready-fd", ready};
  for (const auto& a : (*fleet)->JoinArgs()) args.push_back(a);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    setenv("TANDEM_CACHE_SALT", (*fleet)->cache_salt().c_str(), 1);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::string line;
  char buf[512];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) line.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  struct Reap {
    pid_t pid;
    ~Reap() {
      kill(pid, SIGTERM);
      if (!WaitExit(pid, 15s)) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
    }
  } reap{pid};
  const auto q = line.find("\"metrics\":\"");
  ASSERT_NE(q, std::string::npos) << "no ready line: " << ReadFile(log);
  const std::string metrics = line.substr(q + 11, line.find('"', q + 11) - q - 11);
  ASSERT_EQ(Metric(metrics, "tandem_decode_step_seconds_count"), 0);

  // Round robin over two decoders: half of these land on the new one.
  constexpr uint32_t kMaxTokens = 24;
  for (uint32_t i = 0; i < 8; ++i) {
    GenerateArgs a;
    a.prompt_ids = PromptIds(700 + i, 30 + 7 * i, kVocab);
    a.max_tokens = kMaxTokens;
    auto c = Generate((*fleet)->proxy_grpc(), a);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->token_ids, Reference(a.prompt_ids, kMaxTokens)) << "prompt " << i;
  }
  const double steps = Metric(metrics, "tandem_decode_step_seconds_count");
  const double queried = Metric(metrics, "tandem_prefix_cache_queries_tokens_total");
  std::printf("[failure] joined decoder: %.0f decode steps, %.0f prompt tokens reserved\n", steps,
              queried);
  EXPECT_GT(steps, 0) << "the joined decoder decoded nothing";
  EXPECT_GT(queried, 0) << "the joined decoder reserved nothing";
  // The proxy took the labels it gave on the command line.
  const std::string proxy_log = ReadFile((*fleet)->log_path());
  const auto joined = proxy_log.find("worker decode-late (decode) joined at ");
  ASSERT_NE(joined, std::string::npos) << proxy_log;
  const std::string joined_line = proxy_log.substr(joined, proxy_log.find('\n', joined) - joined);
  // ... and the registration's rank layout (one process: tp1pp1).
  EXPECT_NE(joined_line.find("(node 'host-b', zone 'rack-2', layout tp1pp1)"), std::string::npos)
      << joined_line;
}

// A prefiller stopped (SIGSTOP) while it holds a decoder reservation: the
// lease ends that attempt but its blocks stay quarantined (a stopped writer
// is alive and may still write when it wakes), the other prefiller serves
// meanwhile; after SIGCONT the late one confirms no write is outstanding,
// the quarantine ends, nothing is corrupted and it serves again.
TEST(Failure, LeaseExpiryWithStoppedPrefiller) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  constexpr uint32_t kMaxTokens = 16;
  constexpr uint32_t kLong = 400;
  FleetOptions o = FailureFleet(2, 1);
  // Long prompts prefill in many chunks: a wide window to stop in. The
  // lease is longer than the other failure tests' 2 s: a healthy prefiller
  // that holds six long prompts (its own and the stopped one's retries)
  // must not overrun it on a slow machine.
  o.max_batched_tokens = 16;
  o.extra_yaml = "transport:\n  lease_seconds: 4\n  peer_timeout_seconds: 1.5\n";
  o.log_level = "info";      // the proxy's "answers again" line
  auto fleet = Fleet::Launch(o);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  const WorkerAddr* p0 = FindWorker(**fleet, "prefill-0");
  const WorkerAddr* d0 = FindWorker(**fleet, "decode-0");
  ASSERT_TRUE(p0 && d0);
  const std::string proxy = (*fleet)->proxy_grpc();
  auto run = [&](uint32_t seed, uint32_t len) {
    GenerateArgs a;
    a.prompt_ids = PromptIds(seed, len, kVocab);
    a.max_tokens = kMaxTokens;
    a.timeout = 30s;
    auto c = Generate(proxy, a);
    EXPECT_TRUE(c.ok()) << "prompt " << seed << ": " << c.status().ToString();
    if (c.ok()) {
      EXPECT_EQ(c->token_ids, Reference(a.prompt_ids, kMaxTokens)) << "prompt " << seed;
    }
  };
  for (uint32_t s = 800; s < 806; ++s) Reference(PromptIds(s, kLong, kVocab), kMaxTokens);
  for (uint32_t s = 900; s < 908; ++s) Reference(PromptIds(s, 60, kVocab), kMaxTokens);

  // Stop prefill-0 while it works on long prompts, until a lease expires
  // (it may have been between reservations: then wake it and try again).
  bool expired = false;
  for (int attempt = 0; attempt < 4 && !expired; ++attempt) {
    const double before = Metric(d0->metrics, "tandem_kv_lease_expired_total");
    std::vector<std::thread> load;
    for (uint32_t s = 800; s < 806; ++s) load.emplace_back([&, s] { run(s, kLong); });
    // Stop it while it prefills: the event is its engine running a request
    // (a prefiller reserves decoder blocks only when its engine can start at
    // once, so it holds a reservation then).
    WaitFor([&] { return Metric(p0->metrics, "tandem_num_requests_running") >= 1; }, 10s);
    ASSERT_EQ(kill(p0->pid, SIGSTOP), 0);
    // Requests keep being served meanwhile, by prefill-1.
    for (auto& t : load) t.join();
    expired = WaitFor([&] { return Metric(d0->metrics, "tandem_kv_lease_expired_total") > before; },
                      6s);
    if (!expired) {
      const size_t log_at = ReadText((*fleet)->log_path()).size();
      ASSERT_EQ(kill(p0->pid, SIGCONT), 0);
      // Back in routing (when it had left it): the proxy says so.
      WaitForLogLine((*fleet)->log_path(), "worker prefill-0 answers again", 5s, log_at);
    }
  }
  ASSERT_TRUE(expired) << "never caught prefill-0 holding a reservation";
  // While prefill-0 is stopped its expired reservation stays quarantined
  // (acknowledge-or-dead: it is alive, so only its word ends it); nothing
  // runs on the decoder.
  const bool settled = WaitFor(
      [&] {
        auto m = Scrape(d0->metrics);
        return m.ok() && MetricValue(*m, "tandem_num_requests_running") == 0 &&
               MetricValue(*m, "tandem_kv_quarantined_blocks") > 0;
      },
      5s);
  EXPECT_TRUE(settled) << "no quarantined blocks while the writer is stopped";
  for (uint32_t s = 900; s < 904; ++s) run(s, 60);  // served meanwhile by prefill-1
  EXPECT_GT(Metric(d0->metrics, "tandem_kv_quarantined_blocks"), 0);
  EXPECT_EQ(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "peer_dead"), 0)
      << "a stopped (alive) prefiller was declared dead";

  // Wake it: its late work must not land anywhere. It comes back into
  // routing and serves correctly again.
  const double prefills_before = Metric(p0->metrics, "tandem_prefill_seconds_count");
  ASSERT_EQ(kill(p0->pid, SIGCONT), 0);
  const bool back = WaitFor(
      [&] {
        run(904, 60);
        return Metric(p0->metrics, "tandem_prefill_seconds_count") > prefills_before;
      },
      10s);
  EXPECT_TRUE(back) << "prefill-0 did not come back into routing";
  std::vector<std::thread> after;
  for (uint32_t s = 904; s < 908; ++s) after.emplace_back([&, s] { run(s, 60); });
  for (uint32_t s = 800; s < 802; ++s) after.emplace_back([&, s] { run(s, kLong); });
  for (auto& t : after) t.join();
  // Awake, prefill-0 confirmed its writes ended: the quarantine is over and
  // the decoder idle.
  const bool idle = WaitFor(
      [&] {
        auto m = Scrape(d0->metrics);
        return m.ok() && MetricValue(*m, "tandem_kv_quarantined_blocks") == 0 &&
               MetricValue(*m, "tandem_kv_reservations") == 0 &&
               MetricValue(*m, "tandem_kv_cache_usage_ratio") == 0 &&
               MetricValue(*m, "tandem_num_requests_running") == 0;
      },
      10s);
  EXPECT_TRUE(idle) << "the decoder did not return to idle after prefill-0 woke";
  EXPECT_GT(LabeledMetric(d0->metrics, "tandem_kv_quarantine_released_total", "acknowledged"), 0);
  std::printf("[failure] lease test: prefill-0 dropped %.0f (lease) / %.0f (target lost); decoder "
              "leases expired %.0f, stale notices %.0f\n",
              LabeledMetric(p0->metrics, "tandem_prefill_dropped_total", "reason=\"lease_expired\""),
              LabeledMetric(p0->metrics, "tandem_prefill_dropped_total", "reason=\"target_lost\""),
              Metric(d0->metrics, "tandem_kv_lease_expired_total"),
              Metric(d0->metrics, "tandem_kv_stale_notices_total"));
}

// SIGTERM to `tandem launch` under load: in-flight requests finish, new
// ones get UNAVAILABLE, every process is gone within the grace period.
TEST(Failure, SigtermToLaunchDrainsUnderLoad) {
  if (!HaveBundledModel()) GTEST_SKIP() << "bundled model missing";
  constexpr uint32_t kMaxTokens = 400;
  constexpr double kDrainSeconds = 8;  // FailureFleet's proxy.drain_seconds
  auto fleet = Fleet::Launch(FailureFleet(1, 1));
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  std::vector<pid_t> pids = {(*fleet)->proxy_pid()};
  for (const auto& w : (*fleet)->workers()) pids.push_back(w.pid);
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 6; ++i) prompts.push_back(PromptIds(950 + i, 40, kVocab));
  for (const auto& p : prompts) ASSERT_FALSE(Reference(p, kMaxTokens).empty());
  auto stub = pb::Generation::NewStub(
      grpc::CreateChannel((*fleet)->proxy_grpc(), grpc::InsecureChannelCredentials()));

  std::vector<Streamed> results(prompts.size());
  std::atomic<int> started{0};
  std::vector<std::thread> load;
  for (size_t i = 0; i < prompts.size(); ++i) {
    load.emplace_back([&, i] {
      ++started;
      results[i] = Stream(*stub, prompts[i], kMaxTokens, 60s);
    });
  }
  // Every stream is running (the proxy counts them) before the signal.
  ASSERT_TRUE(WaitFor([&] {
    return Metric((*fleet)->proxy_metrics(), "tandem_requests_inflight") >=
           static_cast<double>(prompts.size());
  }, 20s));
  const auto t0 = Clock::now();
  ASSERT_EQ(kill((*fleet)->launcher_pid(), SIGTERM), 0);
  // New requests are refused once the proxy has the signal: the first
  // refusal is the event (ones admitted before it just complete).
  Streamed refused;
  WaitFor(
      [&] {
        refused = Stream(*stub, prompts[0], 1, 10s);
        return !refused.status.ok();
      },
      10s);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.status.error_message();
  std::printf("[failure] new request during the drain: %d %s\n",
              static_cast<int>(refused.status.error_code()),
              refused.status.error_message().c_str());
  for (auto& t : load) t.join();
  const double drained_ms = Ms(Clock::now() - t0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].token_ids, Reference(prompts[i], kMaxTokens)) << "prompt " << i;
  }
  auto st = (*fleet)->Stop(30s);  // already signalled: waits for the exit
  const double exited_ms = Ms(Clock::now() - t0);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << *st;
  std::printf("[failure] SIGTERM under load: in-flight done after %.0f ms, launcher exited after "
              "%.0f ms (grace %.0f s)\n",
              drained_ms, exited_ms, kDrainSeconds);
  // Every process exited by itself within its grace: the launcher had to
  // kill none (it says so when it does). No wall-clock bound in the test.
  const std::string launch_log = ReadFile((*fleet)->log_path());
  EXPECT_EQ(launch_log.find("had to be killed"), std::string::npos) << launch_log;
  for (pid_t p : pids) EXPECT_NE(kill(p, 0), 0) << "process " << p << " outlived tandem launch";
}

}  // namespace
}  // namespace tandem::testing
