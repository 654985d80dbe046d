// `tandem bench kvtransfer`: KV transfer bandwidth and per-request latency
// between two processes on this machine.
//
// The command spawns a copy of itself as the target (`--role target`, a
// decoder-like process owning the destination pool) with fork/exec *before*
// creating its own transport — UCX state does not survive fork — then moves
// `--blocks` blocks of `--block-bytes` per request, `--requests` times,
// keeping `--concurrency` requests in flight. Each request is PrepareWrite →
// Post → completion callback (data remotely complete, then the notice sent).
// `--scatter` writes every other remote slot, so no two blocks coalesce.
// `--encrypt` then runs the requests again, one at a time, sealed and opened
// as transport.encrypt does (bench_kv_encrypt.h), and measures memcpy of the
// same bytes as the physical reference.
// `--memory` picks the pools (bench_kv_memory.h): host (default), staged
// (the StagedTransport pipeline with the host stand-in copy engine, against
// the memcpy bandwidth of the same run) or device (a CUDA pool through the
// cuda worker's path; refused without a GPU).
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "cli/bench_kv_encrypt.h"
#include "cli/bench_kv_memory.h"
#include "cli/commands.h"
#include "common/logging.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transport.h"

extern char** environ;

namespace tandem::cli {
namespace {

namespace kv = tandem::kvtransfer;
using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string role = "writer";  // writer | target (internal)
  std::string backend = "ucx";
  std::string memory = "host";  // host | staged | device
  uint64_t block_bytes = 1 << 20;
  uint32_t blocks = 64;  // per request
  uint32_t requests = 200;
  uint32_t warmup = 5;
  uint32_t concurrency = 1;
  bool scatter = false;
  bool json = false;
  bool notice = true;                   // send a notice after each request's data
  bool encrypt = false;                 // also the sealed run (transport.encrypt)
  uint64_t max_put_bytes = 4ull << 20;  // the library default
  uint32_t pool_blocks = 0;             // target only
  double timeout_s = 120;               // whole run
};

// The target process, spoken to over its stdin/stdout.
class Target {
 public:
  Status Start(const BenchOptions& o, uint32_t pool_blocks) {
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    std::vector<std::string> argv = {exe,
                                     "bench",
                                     "kvtransfer",
                                     "--role",
                                     "target",
                                     "--backend",
                                     o.backend,
                                     "--memory",
                                     o.memory,
                                     "--block-bytes",
                                     std::to_string(o.block_bytes),
                                     "--pool-blocks",
                                     std::to_string(pool_blocks)};
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      return InternalError(fmt::format("pipe: {}", std::strerror(errno)));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const int rc = posix_spawn(&pid_, exe.c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
    if (rc != 0) return InternalError(fmt::format("spawning the target: {}", std::strerror(rc)));
    return Status::Ok();
  }
  ~Target() {
    if (to_ >= 0) close(to_);
    if (pid_ > 0) {
      for (int i = 0; i < 500 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (kill(pid_, 0) == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
      }
    }
    if (from_ >= 0) close(from_);
  }
  void Send(const std::string& line) {
    const std::string l = line + "\n";
    [[maybe_unused]] ssize_t n = write(to_, l.data(), l.size());
  }
  void CloseInput() {
    close(to_);
    to_ = -1;
  }
  // The rest of the next line starting with `prefix`, within `timeout_s`.
  Result<std::string> Expect(const std::string& prefix, double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    for (int lines = 0; lines < 10000;) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        ++lines;
        if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
        if (line.rfind("ERROR ", 0) == 0) return InternalError("target: " + line.substr(6));
        continue;
      }
      const auto left_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left_ms <= 0) break;
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left_ms)) <= 0) continue;
      char chunk[65536];
      const ssize_t n = read(from_, chunk, sizeof(chunk));
      if (n <= 0) return UnavailableError("target exited");
      buf_.append(chunk, static_cast<size_t>(n));
    }
    return DeadlineExceededError(
        fmt::format("target did not say '{}' within {} s", prefix, timeout_s));
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::string buf_;
};

int RunTarget(const BenchOptions& o) {
  kv::TransportOptions to;
  to.backend = o.backend;
  to.agent_name = "bench-target";
  to.block_bytes = o.block_bytes;
  to.num_blocks = o.pool_blocks;
  auto pool = kvbench::CreateBenchPool(o.memory, to);
  Status filled = pool.ok() ? pool->Fill(2) : pool.status();  // faults the pages in before timing
  if (!filled.ok()) {
    std::cout << "ERROR " << filled.ToString() << std::endl;
    return 1;
  }
  kv::Transport* t = pool->transport.get();
  std::atomic<uint64_t> notices{0};
  kvbench::EncryptedReceiver sealed(*t);
  t->SetNotificationCallback([&](kv::Notification n) {
    if (!sealed.OnNotice(n.payload)) ++notices;
  });
  std::cout << "DESC " << kv::ToHex(t->LocalDescriptor()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    uint32_t first = 0, stride = 1, count = 0;
    in >> cmd >> first >> stride >> count;
    if (cmd == "SUM" && count > 0 && first + uint64_t{stride} * (count - 1) < t->num_blocks()) {
      auto sum = pool->Checksum(first, stride, count);
      if (sum.ok()) {
        std::cout << "SUM " << *sum << std::endl;
      } else {
        std::cout << "ERROR " << sum.status().ToString() << std::endl;
      }
    } else if (cmd == "NOTICES") {
      std::cout << "NOTICES " << notices.load() << std::endl;
    } else if (cmd == "WAIT") {
      std::cout << "OPENED " << sealed.Wait(first, 30) << std::endl;
    }
  }
  return 0;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i =
      std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

int RunWriter(const BenchOptions& o) {
  const uint32_t groups = std::max(1u, o.concurrency);
  const uint32_t local_blocks = groups * o.blocks;
  const uint32_t stride = o.scatter ? 2 : 1;
  const uint32_t remote_blocks = local_blocks * stride;
  // 0. --memory device without a usable GPU: refused here, naming why (no
  // UCX is touched; the CUDA check is forgotten by the exec'd target).
  if (Status s = kvbench::CheckMemoryUsable(o.memory); !s.ok()) {
    std::cerr << "kvtransfer bench: " << s.ToString() << "\n";
    return 1;
  }
  // 1. The second process first: fork/exec before this process touches UCX.
  Target target;
  if (Status s = target.Start(o, remote_blocks); !s.ok()) {
    std::cerr << s.ToString() << "\n";
    return 1;
  }
  auto desc_hex = target.Expect("DESC ", 60);
  if (!desc_hex.ok()) {
    std::cerr << desc_hex.status().ToString() << "\n";
    return 1;
  }
  // 2. Our transport and pool.
  kv::TransportOptions to;
  to.backend = o.backend;
  to.agent_name = "bench-writer";
  to.block_bytes = o.block_bytes;
  to.num_blocks = local_blocks;
  to.max_put_bytes = o.max_put_bytes;
  to.staging_blocks = o.encrypt ? o.blocks : 0;
  auto created = kvbench::CreateBenchPool(o.memory, to);
  Status filled = created.ok() ? created->Fill(1) : created.status();
  if (!filled.ok()) {
    std::cerr << "kvtransfer bench: " << filled.ToString() << "\n";
    return 1;
  }
  kv::Transport& t = *created->transport;
  auto desc = kv::FromHex(*desc_hex);
  auto peer = desc.ok() ? t.ImportPeer(*desc) : Result<kv::PeerId>(desc.status());
  if (!peer.ok()) {
    std::cerr << peer.status().ToString() << "\n";
    return 1;
  }
  const std::string transports = t.TransportsInUse(*peer).value_or("unknown");

  // Block pairs of each group: local [g*N, (g+1)*N) -> remote slots stride apart.
  std::vector<std::vector<kv::BlockPair>> pairs(groups);
  for (uint32_t g = 0; g < groups; ++g) {
    for (uint32_t j = 0; j < o.blocks; ++j) {
      const uint32_t local = g * o.blocks + j;
      pairs[g].push_back({local, local * stride});
    }
  }
  uint64_t puts_per_request = 0;  // after coalescing and splitting at max_put_bytes
  for (const kv::Segment& s : kv::CoalesceBlocks(pairs[0], o.block_bytes)) {
    puts_per_request += (s.length_bytes + o.max_put_bytes - 1) / o.max_put_bytes;
  }

  // 3. Requests: `groups` in flight. Each completion callback (on the
  // transport's progress thread) posts its group's next request at once, as
  // a serving path would, so no thread hop sits between requests.
  std::mutex mu;
  std::condition_variable cv;
  const uint32_t total = o.warmup + o.requests;
  uint32_t issued = 0, finished = 0, failed = 0;
  uint32_t callbacks_returned = 0;  // the frame may only end once every callback is out of it
  std::vector<double> latency_s;
  latency_s.reserve(o.requests);
  Clock::time_point measure_start, measure_end;
  std::string first_error;
  auto fail = [&](const Status& s) {
    std::lock_guard lock(mu);
    ++failed;
    if (first_error.empty()) first_error = s.ToString();
    cv.notify_one();
  };
  std::function<void(uint32_t)> post_next = [&](uint32_t group) {
    uint32_t index = 0;
    {
      std::lock_guard lock(mu);
      if (issued >= total || failed > 0) return;
      index = issued++;
      if (index == o.warmup) measure_start = Clock::now();
    }
    auto x = t.PrepareBlockWrite(
        *peer, pairs[group],
        o.notice ? std::optional<std::string>("r" + std::to_string(index)) : std::nullopt);
    if (!x.ok()) return fail(x.status());
    const auto start = Clock::now();
    Status s = t.Post(
        *x, [&, group, index, start, id = *x](kv::XferId, kv::XferStatus st, const Status& detail) {
          const auto end = Clock::now();
          t.Release(id).IgnoreError();
          if (st != kv::XferStatus::kSuccess) return fail(detail);
          {
            std::lock_guard lock(mu);
            ++finished;
            if (index >= o.warmup)
              latency_s.push_back(std::chrono::duration<double>(end - start).count());
            if (finished == total) measure_end = end;
          }
          post_next(group);
          std::lock_guard lock(mu);
          ++callbacks_returned;
          cv.notify_one();
        });
    if (!s.ok()) fail(s);
  };
  for (uint32_t g = 0; g < groups; ++g) post_next(g);
  std::unique_lock lock(mu);
  cv.wait_until(lock, Clock::now() + std::chrono::duration<double>(o.timeout_s),
                [&] { return callbacks_returned == total || failed > 0; });
  if (finished < total || failed > 0) {
    std::cerr << fmt::format("kvtransfer bench: {} of {} requests finished, {} failed{}{}\n",
                             finished, total, failed, first_error.empty() ? "" : ": ", first_error);
    lock.unlock();
    std::_Exit(1);  // requests may still be in flight and reference this frame
  }
  lock.unlock();

  // 4. The notices at the target, then its data. A notice is handed on
  // once its data is in the target's pool — for staged and device pools,
  // after the target's host->device copies — so the time the last one was
  // seen bounds the end-to-end transfer ("delivered" bandwidth).
  uint64_t notices = 0;
  const uint64_t want_notices = o.notice ? total : 0;
  Clock::time_point delivered_end = measure_end;
  const auto notice_deadline = Clock::now() + std::chrono::seconds(60);
  while (notices < want_notices && Clock::now() < notice_deadline) {
    target.Send("NOTICES");
    auto n = target.Expect("NOTICES ", 30);
    notices = n.ok() ? std::stoull(*n) : 0;
    delivered_end = Clock::now();
    if (!n.ok()) break;
    if (notices < want_notices) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  target.Send(fmt::format("SUM 0 {} {}", stride, o.blocks));
  auto remote_sum = target.Expect("SUM ", 30);
  auto local_sum = created->Checksum(0, 1, o.blocks);
  const bool verified =
      remote_sum.ok() && local_sum.ok() && *remote_sum == std::to_string(*local_sum);
  // 5. The sealed run (transport.encrypt), one request at a time.
  Result<kvbench::EncryptedRun> sealed_run = kvbench::EncryptedRun{};
  double memcpy_bw = 0;
  if (o.encrypt) {
    sealed_run = kvbench::RunEncrypted(t, *peer, pairs[0], o.warmup, o.requests, [&](uint64_t i) {
      target.Send(fmt::format("WAIT {}", i));
      return target.Expect("OPENED ", 60);
    });
    if (!sealed_run.ok()) std::cerr << "encrypted run: " << sealed_run.status().ToString() << "\n";
  }
  // The physical reference of a host-memory run: memcpy of one request's bytes.
  if (o.memory != "device") memcpy_bw = kvbench::MemcpyBandwidth(uint64_t{o.blocks} * o.block_bytes, 5);
  t.ReleasePeer(*peer).IgnoreError();  // before the target exits, so no peer-loss warning
  target.CloseInput();

  const double elapsed_s = std::chrono::duration<double>(measure_end - measure_start).count();
  const uint64_t bytes_per_request = uint64_t{o.blocks} * o.block_bytes;
  const double bw = static_cast<double>(bytes_per_request) * o.requests / elapsed_s;
  const double delivered_s =
      std::max(elapsed_s, std::chrono::duration<double>(delivered_end - measure_start).count());
  const double delivered_bw = static_cast<double>(bytes_per_request) * o.requests / delivered_s;
  const double p50 = Percentile(latency_s, 0.50), p99 = Percentile(latency_s, 0.99);
  double mean = 0;
  for (double v : latency_s) mean += v / static_cast<double>(latency_s.size());
  const char* tls = std::getenv("UCX_TLS");
  if (o.json) {
    nlohmann::json j = {{"backend", o.backend},
                        {"memory", o.memory},
                        {"path", created->path},
                        {"path_detail", created->detail},
                        {"block_bytes", o.block_bytes},
                        {"blocks", o.blocks},
                        {"requests", o.requests},
                        {"warmup_requests", o.warmup},
                        {"concurrency", groups},
                        {"scatter", o.scatter},
                        {"bytes_per_request", bytes_per_request},
                        {"puts_per_request", puts_per_request},
                        {"elapsed_s", elapsed_s},
                        {"bandwidth_bytes_per_s", bw},
                        {"delivered_bandwidth_bytes_per_s", delivered_bw},
                        {"p50_latency_s", p50},
                        {"p99_latency_s", p99},
                        {"mean_latency_s", mean},
                        {"transports", transports},
                        {"ucx_tls", tls ? tls : ""},
                        {"notices_received", notices},
                        {"data_verified", verified}};
    if (o.encrypt && sealed_run.ok()) {
      const auto& e = *sealed_run;
      const double b = static_cast<double>(e.bytes);
      j["encrypt"] = {{"requests", e.requests},
                      {"bandwidth_bytes_per_s", b / e.total_s},
                      {"seal_bytes_per_s", b / e.seal_s},
                      {"transfer_bytes_per_s", b / e.transfer_s},
                      {"open_bytes_per_s", b / e.open_s},
                      {"tag_failures", e.failures}};
    }
    if (memcpy_bw > 0) {
      j["memcpy_bytes_per_s"] = memcpy_bw;
      j["fraction_of_memcpy"] = delivered_bw / memcpy_bw;
    }
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << fmt::format(
        "kvtransfer bench: backend {} memory {} ({}) transports [{}]{}\n"
        "  {} requests x {} blocks x {} bytes ({} puts/request), concurrency {}{}\n"
        "  bandwidth {:.3f} GB/s ({:.0f} bytes/s) over {:.3f} s\n"
        "  latency per request: p50 {:.1f} us, p99 {:.1f} us, mean {:.1f} us\n"
        "  notices received {} of {}; data verified: {}\n",
        o.backend, o.memory, created->detail, transports, tls ? fmt::format(" (UCX_TLS={})", tls) : "", o.requests, o.blocks,
        o.block_bytes, puts_per_request, groups, o.scatter ? ", scattered slots" : "", bw / 1e9, bw,
        elapsed_s, p50 * 1e6, p99 * 1e6, mean * 1e6, notices, want_notices,
        verified ? "yes" : "NO");
    if (o.encrypt && sealed_run.ok()) {
      const auto& e = *sealed_run;
      const double b = static_cast<double>(e.bytes);
      std::cout << fmt::format(
          "  encrypted (AES-256-GCM, one request at a time, seal -> put -> open): {:.3f} GB/s end "
          "to end\n    seal {:.3f} GB/s, put+notice {:.3f} GB/s, open {:.3f} GB/s; tag failures {}\n"
          "",
          b / e.total_s / 1e9, b / e.seal_s / 1e9, b / e.transfer_s / 1e9, b / e.open_s / 1e9,
          e.failures);
    }
    if (memcpy_bw > 0) {
      std::cout << fmt::format(
          "  delivered (until the target handed on the last notice) {:.3f} GB/s\n"
          "  memcpy of {} bytes: {:.3f} GB/s (delivered = {:.2f} of it)\n",
          delivered_bw / 1e9, bytes_per_request, memcpy_bw / 1e9, delivered_bw / memcpy_bw);
    }
  }
  const bool sealed_ok = !o.encrypt || (sealed_run.ok() && sealed_run->failures == 0);
  return verified && notices == want_notices && sealed_ok ? 0 : 1;
}

}  // namespace

void RegisterBenchKvTransfer(CLI::App& bench, GlobalOptions& g) {
  auto* cmd =
      bench.add_subcommand("kvtransfer", "KV transfer bandwidth and latency between two processes");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("--block-bytes", o->block_bytes, "bytes per KV block")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--blocks", o->blocks, "blocks per request")->check(CLI::PositiveNumber);
  cmd->add_option("--requests", o->requests, "measured requests")->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", o->warmup, "requests before measuring");
  cmd->add_option("--concurrency", o->concurrency, "requests in flight")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--scatter", o->scatter, "write every other remote slot (no coalescing)");
  cmd->add_option("--backend", o->backend, "ucx (loopback is in-process only)")
      ->check(CLI::IsMember({"ucx"}));
  cmd->add_option("--memory", o->memory,
                  "pools: host (transport memory), staged (the staging pipeline with the host "
                  "stand-in copy engine), device (CUDA pool, the cuda worker's path; needs a GPU)")
      ->check(CLI::IsMember({"host", "staged", "device"}));
  cmd->add_option("--max-put-bytes", o->max_put_bytes, "largest single put")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--timeout", o->timeout_s, "give up after this many seconds");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->add_flag("!--no-notice", o->notice, "send no notice after each request");
  cmd->add_flag("--encrypt", o->encrypt,
                "also run the requests sealed with AES-256-GCM (transport.encrypt), one at a time, "
                "and measure memcpy");
  cmd->add_option("--role", o->role, "internal: writer | target")->group("");
  cmd->add_option("--pool-blocks", o->pool_blocks, "internal: target pool size")->group("");
  cmd->callback([&g, o] {
    if (Status s = SetupLogging(o->role == "target" ? "bench-target" : "bench",
                                g.log_level.empty() ? "warn" : g.log_level,
                                g.log_format.empty() ? "text" : g.log_format);
        !s.ok()) {
      std::cerr << s.ToString() << "\n";
      g.exit_code = 2;
      return;
    }
    if (o->encrypt && o->memory != "host") {
      std::cerr << "kvtransfer bench: --encrypt seals host pools only; use --memory host\n";
      g.exit_code = 2;
      return;
    }
    if (o->role == "target") {
      g.exit_code = RunTarget(*o);
      return;
    }
    if (uint64_t{o->blocks} * o->concurrency * o->block_bytes * (o->scatter ? 2 : 1) >
        (16ull << 30)) {
      std::cerr
          << "kvtransfer bench: the pools would exceed 16 GiB; lower --blocks, --block-bytes or "
             "--concurrency\n";
      g.exit_code = 2;
      return;
    }
    g.exit_code = RunWriter(*o);
  });
}

}  // namespace tandem::cli
