// `tandem bench proxy`: the serving path's own CPU cost (issue 23). Drives a
// sim fleet (launched here, or a running one) with the public gRPC API and
// charges the proxy's and the decoder's CPU time (their CPU clocks, in ns:
// cli/proc_stats.h) to the tokens and prompts they served. CPU time, not wall
// time, so the result holds on a loaded machine. Docs: docs/bench-serve.md,
// "tandem bench proxy".
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli/bench_proxy_floor.h"
#include "cli/bench_proxy_idle.h"
#include "cli/bench_proxy_native.h"
#include "cli/bench_proxy_prompt_floor.h"
#include "cli/bench_proxy_relay_floor.h"
#include "cli/bench_proxy_sse.h"
#include "cli/commands.h"
#include "cli/proc_stats.h"
#include "loadgen/grpc_client.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace tandem::cli {
namespace {

namespace lg = tandem::loadgen;
namespace fs = std::filesystem;

struct ProxyBenchArgs {
  std::string config = "configs/sim-1p1d.yaml";
  std::string state_file;  // a running fleet: no launch
  std::string workloads = "idle,stream,prompt,open,floor,prompt-floor";
  double idle_seconds = 10;  // idle: bench_proxy_idle.h
  double launch_timeout_s = 120;
  // stream: many tokens through few streams.
  uint32_t stream_requests = 100, stream_input = 16, stream_output = 1000, stream_concurrency = 16;
  // prompt: long prompts, one token each.
  uint32_t prompt_requests = 200, prompt_input = 8000, prompt_concurrency = 16;
  // open: many streams open at once (ITL under load).
  uint32_t open_streams = 1000, open_output = 64, open_input = 16;
  // floor: bare servers streaming canned tokens (bench_proxy_floor.h).
  uint32_t floor_requests = 32;
  double floor_step_ms = 0;  // 0: the stream workload's ITL p50 when it ran, else 6.4
  double duration_s = 300;  // per workload
  std::string json_path;
  std::string grpc_server;  // --grpc-server: the launched fleet's proxy.grpc_server
};

struct Proc {
  std::string role;
  int pid = 0;
  std::string metrics;  // host:port
};

// GET http://host:port/metrics (plain HTTP/1.0); empty on any failure.
std::string FetchMetrics(const std::string& hostport) {
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return "";
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(hostport.substr(0, colon).c_str(), hostport.substr(colon + 1).c_str(), &hints,
                  &res) != 0) {
    return "";
  }
  const int fd = socket(res->ai_family, res->ai_socktype, 0);
  std::string out;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: " + hostport + "\r\n\r\n";
    if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) == ssize_t(req.size())) {
      char buf[65536];
      for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, size_t(n));
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

// Cumulative bucket counts of histogram `name` (le -> count).
std::vector<std::pair<double, double>> HistogramBuckets(const std::string& text,
                                                        const std::string& name) {
  std::vector<std::pair<double, double>> out;
  std::istringstream in(text);
  const std::string prefix = name + "_bucket{";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(prefix, 0) != 0) continue;
    size_t le = line.find(",le=\"");
    if (le == std::string::npos) le = line.find("{le=\"");
    if (le != std::string::npos) ++le;
    const size_t end = le == std::string::npos ? le : line.find('"', le + 4);
    const size_t sp = line.rfind(' ');
    if (end == std::string::npos || sp == std::string::npos) continue;
    const std::string bound = line.substr(le + 4, end - le - 4);
    const double b = bound == "+Inf" ? std::numeric_limits<double>::infinity()
                                     : std::strtod(bound.c_str(), nullptr);
    out.emplace_back(b, std::strtod(line.c_str() + sp + 1, nullptr));
  }
  return out;
}

// Quantile q of the difference of two cumulative histograms (after - before),
// interpolated within a bucket as Prometheus' histogram_quantile does.
double HistogramQuantile(const std::vector<std::pair<double, double>>& before,
                         const std::vector<std::pair<double, double>>& after, double q) {
  if (after.empty() || before.size() != after.size()) return NAN;
  std::vector<std::pair<double, double>> d(after.size());
  for (size_t i = 0; i < after.size(); ++i) d[i] = {after[i].first, after[i].second - before[i].second};
  const double total = d.back().second;
  if (total <= 0) return NAN;
  const double rank = q * total;
  double lo = 0, lo_count = 0;
  for (const auto& [le, c] : d) {
    if (c >= rank) {
      if (std::isinf(le)) return lo;
      return lo + (le - lo) * (c > lo_count ? (rank - lo_count) / (c - lo_count) : 0);
    }
    lo = le;
    lo_count = c;
  }
  return lo;
}

// Cumulative buckets of `name` summed over several processes' metrics
// texts (the same boundaries in each: one binary); empty when any lacks it.
std::vector<std::pair<double, double>> SummedBuckets(const std::vector<std::string>& addrs,
                                                     const std::string& name) {
  std::vector<std::pair<double, double>> sum;
  for (const auto& a : addrs) {
    const auto b = HistogramBuckets(FetchMetrics(a), name);
    if (b.empty() || (!sum.empty() && b.size() != sum.size())) return {};
    if (sum.empty()) sum.assign(b.size(), {0, 0});
    for (size_t i = 0; i < b.size(); ++i) sum[i] = {b[i].first, sum[i].second + b[i].second};
  }
  return sum;
}

// Quantile q of `samples` counted in the boundaries of `like` (a scraped
// histogram) and interpolated as HistogramQuantile does: set against that
// histogram's quantile, both carry the same interpolation error.
double BucketedQuantile(const std::vector<double>& samples,
                        const std::vector<std::pair<double, double>>& like, double q) {
  if (like.empty()) return NAN;
  std::vector<std::pair<double, double>> zero(like.size()), counts(like.size());
  for (size_t i = 0; i < like.size(); ++i) {
    zero[i] = {like[i].first, 0};
    counts[i] = {like[i].first, 0};
  }
  for (double v : samples) {  // v's bucket: the first boundary >= v (the last is +Inf)
    const auto it = std::lower_bound(counts.begin(), counts.end(), v,
                                     [](const auto& b, double x) { return b.first < x; });
    if (it != counts.end()) it->second += 1;
  }
  for (size_t i = 1; i < counts.size(); ++i) counts[i].second += counts[i - 1].second;
  return HistogramQuantile(zero, counts, q);
}

struct Fleet {
  std::string grpc;
  std::string http;  // proxy.http: the sse workload
  std::string public_ca;  // the state file's public_ca_file (public TLS); empty: plaintext
  std::vector<Proc> procs;  // proxy first
  pid_t launcher = -1;
  std::string dir;  // our temp dir when launched here
};

Result<Fleet> ReadState(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError(fmt::format("cannot open the state file '{}'", path));
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.contains("proxy") || !j["proxy"].contains("pid")) {
    return InvalidArgumentError(fmt::format(
        "state file '{}' has no proxy.pid (write it with tandem launch --state-file)", path));
  }
  Fleet f;
  f.grpc = j["proxy"].value("grpc", "");
  f.http = j["proxy"].value("http", "");
  f.public_ca = j.value("public_ca_file", "");  // security.public_tls on: the client speaks TLS
  f.procs.push_back({"proxy", j["proxy"]["pid"].get<int>(), j["proxy"].value("metrics", "")});
  for (const auto& w : j.value("workers", nlohmann::json::array())) {
    f.procs.push_back({w.value("role", "?"), w.value("pid", 0), w.value("metrics", "")});
    // A worker's follower ranks (issue 18): their CPU is the role's too.
    for (const auto& r : w.value("ranks", nlohmann::json::array())) {
      if (r.value("rank", 0) > 0) f.procs.push_back({w.value("role", "?"), r.value("pid", 0), ""});
    }
  }
  return f;
}

Result<Fleet> Launch(const ProxyBenchArgs& a) {
  if (!fs::exists(a.config)) {
    return NotFoundError(fmt::format("--config '{}' does not exist", a.config));
  }
  char tmpl[] = "/tmp/tandem-bench-proxy-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return InternalError("cannot make a temporary directory");
  const std::string dir = tmpl;
  const std::string state = dir + "/state.json", log = dir + "/launch.log";
  std::error_code ec;
  const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
  const pid_t pid = fork();
  if (pid < 0) return InternalError("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // the fleet goes when the bench does
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execl(self.c_str(), "tandem", "launch", a.config.c_str(), "--state-file", state.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(int64_t(a.launch_timeout_s * 1000));
  while (!fs::exists(state)) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      return UnavailableError(fmt::format("tandem launch {} exited before it was ready; see {}",
                                          a.config, log));
    }
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
      return UnavailableError(fmt::format("tandem launch {} was not ready within {} s "
                                          "(--launch-timeout); see {}",
                                          a.config, a.launch_timeout_s, log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  auto f = ReadState(state);
  if (!f.ok()) {
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
    return f.status();
  }
  f->launcher = pid;
  f->dir = dir;
  return f;
}

void Stop(Fleet& f) {
  if (f.launcher <= 0) return;
  kill(f.launcher, SIGTERM);
  waitpid(f.launcher, nullptr, 0);
  f.launcher = -1;
  std::error_code ec;
  fs::remove_all(f.dir, ec);
}

struct Workload {
  std::string name;
  uint32_t requests, input, output, concurrency;
};

struct Measured {
  Workload w;
  lg::Summary s;
  std::map<std::string, std::string> failures;  // status -> its first message
  std::map<std::string, double> cpu;  // role -> CPU seconds over the run
  double step_p50 = NAN, step_p99 = NAN;  // decoders' tandem_decode_step_seconds
  // The ITL the decoders emitted (tandem_decoder_inter_token_latency_seconds)
  // and the client's ITL counted in the same buckets (BucketedQuantile):
  // the client's p99 minus the decoders' is what the path after the
  // decoder (its stream, the proxy, the client's end) adds to ITL p99.
  double dec_itl_p50 = NAN, dec_itl_p99 = NAN;
  // The proxy's tandem_inter_token_latency_seconds (the same buckets),
  // stamped when it hands a request its tokens: proxy - decoder is the
  // decoder -> proxy hop's share, client - proxy the proxy -> client one's.
  double proxy_itl_p99 = NAN;
  double client_itl_p99_bucketed = NAN;
  double load1 = 0;
};

Result<Measured> RunOne(lg::Client& client, const lg::ModelInfo& mi, const Fleet& f,
                        const Workload& w, double duration_s) {
  lg::SyntheticOptions so;
  so.input = {lg::LengthDist::Kind::kFixed, double(w.input), 0};
  so.output = {lg::LengthDist::Kind::kFixed, double(w.output), 0};
  so.seed = 1;
  so.vocab = mi.vocab_size;
  so.max_model_len = mi.max_model_len;
  if (Status s = lg::ValidateSynthetic(so); !s.ok()) return s;
  auto source = lg::MakeSyntheticSource(so);
  lg::RunOptions ro;
  ro.num_requests = w.requests;
  ro.duration_s = duration_s;
  ro.arrival.kind = lg::ArrivalKind::kConcurrency;
  ro.arrival.concurrency = w.concurrency;
  ro.ignore_eos = true;
  ro.model = mi.id;
  ro.request_id_prefix = fmt::format("bench-proxy-{}-{}", getpid(), w.name);
  ro.request_timeout = std::chrono::milliseconds(int64_t(duration_s * 1000) + 60000);

  std::vector<std::string> decoder_metrics, proxy_metrics;
  for (const auto& p : f.procs) {
    if (p.metrics.empty()) continue;
    if (p.role == "decode" || p.role == "both") decoder_metrics.push_back(p.metrics);
    if (p.role == "proxy") proxy_metrics.push_back(p.metrics);
  }
  constexpr const char* kStep = "tandem_decode_step_seconds";
  constexpr const char* kDecItl = "tandem_decoder_inter_token_latency_seconds";
  constexpr const char* kProxyItl = "tandem_inter_token_latency_seconds";
  const auto step_before = SummedBuckets(decoder_metrics, kStep);
  const auto itl_before = SummedBuckets(decoder_metrics, kDecItl);
  const auto proxy_itl_before = SummedBuckets(proxy_metrics, kProxyItl);
  std::map<int, double> before;
  for (const auto& p : f.procs) before[p.pid] = ProcessCpuSeconds(p.pid);
  Measured m;
  m.w = w;
  m.load1 = LoadAverage1();
  auto run = lg::Run(client, *source, ro);
  if (!run.ok()) return run.status();
  for (const auto& p : f.procs) m.cpu[p.role] += ProcessCpuSeconds(p.pid) - before[p.pid];
  m.load1 = (m.load1 + LoadAverage1()) / 2;
  const auto step_after = SummedBuckets(decoder_metrics, kStep);
  const auto itl_after = SummedBuckets(decoder_metrics, kDecItl);
  const auto proxy_itl_after = SummedBuckets(proxy_metrics, kProxyItl);
  m.step_p50 = HistogramQuantile(step_before, step_after, 0.5);
  m.step_p99 = HistogramQuantile(step_before, step_after, 0.99);
  m.dec_itl_p50 = HistogramQuantile(itl_before, itl_after, 0.5);
  m.dec_itl_p99 = HistogramQuantile(itl_before, itl_after, 0.99);
  m.proxy_itl_p99 = HistogramQuantile(proxy_itl_before, proxy_itl_after, 0.99);
  std::vector<double> gaps;
  for (const auto& r : run->records) gaps.insert(gaps.end(), r.itl_s.begin(), r.itl_s.end());
  m.client_itl_p99_bucketed = BucketedQuantile(gaps, itl_after, 0.99);
  m.s = lg::Summarize(run->records, {});
  m.failures = lg::FirstFailureMessages(run->records);
  return m;
}

// prompt-floor's relay-tcp channel (bench_proxy_relay_floor.h), back to
// back and, when `rate` > 0, paced as prompt-floor's other channels; each
// prompt as many bytes as the framed-mtls channel's request in the same
// mode (its request ids, and so its size, differ by mode). Appends a JSON
// row per mode to `out`; the exit code.
int RunRelayRows(const std::string& self, const ProxyBenchArgs& a, double rate,
                 nlohmann::json& out) {
  std::vector<double> rates = {0};
  if (rate > 0) rates.push_back(rate);
  for (const double r : rates) {
    const char* mode_name = r > 0 ? "paced" : "back-to-back";
    uint32_t bytes = 0;
    for (const auto& j : out) {
      if (j.value("channel", "") == "framed-mtls" && j.value("mode", "") == mode_name) {
        bytes = j.value("request_bytes", uint32_t{0});
      }
    }
    if (bytes == 0) {
      std::cerr << fmt::format(
          "tandem bench proxy: prompt-floor: no {} framed request size for relay-tcp\n", mode_name);
      return 1;
    }
    const uint32_t n = r > 0 ? std::min(a.prompt_requests, 64u) : a.prompt_requests;
    auto pass = RunRelayFloor(self, n, bytes, r);
    if (!pass.ok()) {
      std::cerr << "tandem bench proxy: prompt-floor (relay-tcp): " << pass.status().message()
                << "\n";
      return 1;
    }
    const std::string mode = r > 0 ? fmt::format("paced {:.2f}/s", r) : "back-to-back";
    const double server_us = pass->ok > 0 ? pass->server_s / pass->ok * 1e6 : NAN;
    std::cout << fmt::format(
        "pfloor {:>6} {:>6} {:>6} {:>4}  {:<11} {:<13} wall {:.2f} s  server {:.1f} us/call  "
        "request {} B (raw TCP, 2 wake-ups)\n",
        n, a.prompt_input, 1, 1, "relay-tcp", mode, pass->wall_s, server_us, bytes);
    std::cout.flush();
    out.push_back({{"workload", "prompt-floor"},
                   {"channel", "relay-tcp"},
                   {"mode", mode_name},
                   {"requests_ok", pass->ok},
                   {"requests_failed", n - pass->ok},
                   {"input_len", a.prompt_input},
                   {"concurrency", 1},
                   {"paced_per_s", r},
                   {"wall_s", pass->wall_s},
                   {"server_us_per_call", server_us},
                   {"request_bytes", bytes}});
    if (pass->ok != n) {
      std::cerr << fmt::format(
          "tandem bench proxy: prompt-floor (relay-tcp): {} of {} calls "
          "failed\n",
          n - pass->ok, n);
      return 3;
    }
  }
  return 0;
}

int RunProxyBench(const ProxyBenchArgs& a) {
  const auto bad = [](const Status& s) {
    std::cerr << "tandem bench proxy: " << s.message() << "\n";
    return 1;
  };
  std::vector<Workload> todo;
  std::unique_ptr<PromptFloor> floor;  // prompt-floor (bench_proxy_prompt_floor.h)
  std::istringstream names(a.workloads);
  for (std::string n; std::getline(names, n, ',');) {
    if (n == "prompt-floor") {
      if (floor) continue;
      auto f = PromptFloor::Start();  // forks: before any gRPC here
      if (!f.ok()) return bad(f.status());
      floor = std::move(*f);
    } else if (n == "stream" || n == "sse") {  // sse: stream's shape over the HTTP API
      todo.push_back({n, a.stream_requests, a.stream_input, a.stream_output, a.stream_concurrency});
    } else if (n == "prompt") {
      todo.push_back({n, a.prompt_requests, a.prompt_input, 1, a.prompt_concurrency});
    } else if (n == "open") {
      todo.push_back({n, a.open_streams, a.open_input, a.open_output, a.open_streams});
    } else if (n == "floor") {
      todo.push_back({n, a.floor_requests, a.stream_input, a.stream_output, a.stream_concurrency});
    } else if (n == "idle") {
      todo.push_back({n, 1, 1, 1, 1});  // no requests: bench_proxy_idle.h
    } else {
      return bad(InvalidArgumentError(fmt::format(
          "--workloads: unknown workload '{}' (give a list of idle, stream, sse, prompt, open, "
          "floor, prompt-floor)",
          n)));
    }
  }
  if (floor && (a.prompt_requests == 0 || a.prompt_concurrency == 0 || a.prompt_input == 0)) {
    return bad(InvalidArgumentError(
        "workload prompt-floor: --prompt-requests, --prompt-input and --prompt-concurrency must "
        "be at least 1"));
  }
  for (const auto& w : todo) {
    if (w.requests == 0 || w.concurrency == 0 || w.input == 0 || w.output == 0) {
      return bad(InvalidArgumentError(fmt::format(
          "workload {}: requests, concurrency and lengths must be at least 1", w.name)));
    }
  }
  if (!(a.floor_step_ms >= 0) || a.floor_step_ms > 1000) {
    return bad(InvalidArgumentError(
        fmt::format("--floor-step-ms must be in [0, 1000] ms, got {}", a.floor_step_ms)));
  }
  if (!(a.duration_s > 0) || a.duration_s > 3600) {
    return bad(InvalidArgumentError(
        fmt::format("--duration must be in (0, 3600] seconds, got {}", a.duration_s)));
  }
  auto config = GrpcServerConfig::Make(a.config, a.state_file.empty() ? a.grpc_server : "");
  if (!config.ok()) return bad(config.status());
  ProxyBenchArgs launch_args = a;
  launch_args.config = (*config)->path();
  Result<Fleet> fleet = a.state_file.empty() ? Launch(launch_args) : ReadState(a.state_file);
  if (!fleet.ok()) return bad(fleet.status());
  int rc = 0;
  nlohmann::json out = nlohmann::json::array();
  {
    auto client = lg::MakeGrpcClient({fleet->grpc, "", 4, fleet->public_ca});
    auto mi = client->GetModelInfo("");
    if (!mi.ok()) {
      Stop(*fleet);
      return bad(mi.status());
    }
    std::cout << fmt::format(
        "{:<14} {:>5} {:>6} {:>6} {:>4} {:>8} {:>7} {:>9} {:>11} {:>11} "
        "{:>10} {:>10} {:>9} {:>9} {:>11} {:>11} {:>11} {:>9} {:>5}\n",
        "load", "reqs", "in", "out", "conc", "out tok", "wall s", "proxy s", "proxy us/tok",
        "proxy ms/req", "dec us/tok", "pre ms/req", "ITL p50ms", "ITL p99ms", "decITL p99",
        "proxyITL p99", "added p99", "step p99ms", "load1");
    double stream_itl_p50_ms = 0;
    for (const auto& w : todo) {
      if (w.name == "idle") {
        std::vector<IdleProc> procs;
        for (const auto& p : fleet->procs) procs.push_back({p.role, p.pid});
        rc = std::max(rc, RunIdleWorkload(procs, a.idle_seconds, out));
        continue;
      }
      if (w.name == "floor") {
        FloorSpec spec{w.requests, w.input, w.output, w.concurrency,
                       a.floor_step_ms > 0 ? a.floor_step_ms
                       : stream_itl_p50_ms > 0 ? stream_itl_p50_ms
                                               : 6.4,
                       a.duration_s};
        std::error_code ec;
        auto rows = RunProxyFloors(fs::read_symlink("/proc/self/exe", ec).string(), spec, *mi);
        if (!rows.ok()) {
          rc = bad(rows.status());
          break;
        }
        for (const FloorRow& r : *rows) {
          const double tok = double(r.tokens);
          const bool grpc = r.grpc;  // the raw TCP rows have no client ITL
          std::cout << fmt::format(
              "{:<14} {:>5} {:>6} {:>6} {:>4} {:>8} {:>7.1f} {:>9.3f} {:>11.2f} {:>11.3f} {:>10} "
              "{:>10} {:>9.2f} {:>9.2f} {:>11} {:>11} {:>11} {:>9.2f} {:>5.1f}\n",
              r.name, r.requests_ok, w.input, w.output, w.concurrency, r.tokens,
              r.summary.duration_s, r.server_cpu_s, tok > 0 ? r.server_cpu_s / tok * 1e6 : NAN,
              r.requests_ok ? r.server_cpu_s / double(r.requests_ok) * 1e3 : NAN, "-", "-",
              grpc ? r.summary.itl_s.p50 * 1e3 : NAN, grpc ? r.summary.itl_s.p99 * 1e3 : NAN, "-",
              "-", "-", spec.step_ms, r.load1);
          std::cout.flush();
          out.push_back({{"workload", r.name}, {"requests_ok", r.requests_ok},
                         {"requests_failed", r.requests_failed}, {"input_len", w.input},
                         {"output_len", w.output}, {"concurrency", w.concurrency},
                         {"output_tokens", r.tokens}, {"duration_s", r.summary.duration_s},
                         {"cpu_s", {{"floor_server", r.server_cpu_s}}},
                         {"floor_server_us_per_token", tok > 0 ? r.server_cpu_s / tok * 1e6 : -1},
                         {"floor_step_ms", spec.step_ms},
                         {"itl_p50_ms", grpc ? r.summary.itl_s.p50 * 1e3 : -1},
                         {"itl_p99_ms", grpc ? r.summary.itl_s.p99 * 1e3 : -1},
                         {"load1", r.load1}});
          if (r.requests_failed > 0) {
            std::cerr << fmt::format("tandem bench proxy: {}: {} requests failed\n", r.name,
                                     r.requests_failed);
            rc = 3;
          }
        }
        continue;
      }
      auto sse = w.name == "sse" ? MakeSseBenchClient(fleet->http, mi->vocab_size)
                                 : Result<std::unique_ptr<lg::Client>>(nullptr);
      if (!sse.ok()) {
        rc = bad(sse.status());
        break;
      }
      auto m = RunOne(*sse ? **sse : *client, *mi, *fleet, w, a.duration_s);
      if (!m.ok()) {
        rc = bad(m.status());
        break;
      }
      if (w.name == "stream") stream_itl_p50_ms = m->s.itl_s.p50 * 1e3;
      const double tok = double(m->s.output_tokens);
      const double proxy = m->cpu["proxy"];
      const double dec = m->cpu["decode"] + m->cpu["both"];
      const double pre = m->cpu["prefill"];  // a `both` worker's is in dec
      std::cout << fmt::format(
          "{:<14} {:>5} {:>6} {:>6} {:>4} {:>8} {:>7.1f} {:>9.3f} {:>11.2f} {:>11.3f} {:>10.2f} "
          "{:>10.3f} {:>9.2f} {:>9.2f} {:>11.2f} {:>11.2f} {:>11.2f} {:>9.2f} {:>5.1f}\n",
          w.name, m->s.ok, w.input, w.output, w.concurrency, m->s.output_tokens, m->s.duration_s,
          proxy, tok > 0 ? proxy / tok * 1e6 : NAN,
          m->s.ok > 0 ? proxy / double(m->s.ok) * 1e3 : NAN, tok > 0 ? dec / tok * 1e6 : NAN,
          m->s.ok > 0 ? pre / double(m->s.ok) * 1e3 : NAN, m->s.itl_s.p50 * 1e3,
          m->s.itl_s.p99 * 1e3, m->dec_itl_p99 * 1e3, m->proxy_itl_p99 * 1e3,
          (m->client_itl_p99_bucketed - m->dec_itl_p99) * 1e3, m->step_p99 * 1e3, m->load1);
      std::cout.flush();
      nlohmann::json j = {{"workload", w.name},
                          {"requests_ok", m->s.ok},
                          {"requests_failed", m->s.failed},
                          {"input_len", w.input},
                          {"output_len", w.output},
                          {"concurrency", w.concurrency},
                          {"output_tokens", m->s.output_tokens},
                          {"duration_s", m->s.duration_s},
                          {"cpu_s", m->cpu},
                          {"proxy_us_per_token", tok > 0 ? proxy / tok * 1e6 : -1},
                          {"proxy_ms_per_request", m->s.ok ? proxy / double(m->s.ok) * 1e3 : -1},
                          {"decoder_us_per_token", tok > 0 ? dec / tok * 1e6 : -1},
                          {"prefiller_ms_per_request", m->s.ok ? pre / double(m->s.ok) * 1e3 : -1},
                          {"itl_p50_ms", m->s.itl_s.p50 * 1e3},
                          {"itl_p99_ms", m->s.itl_s.p99 * 1e3},
                          {"decode_step_p50_ms", m->step_p50 * 1e3},
                          {"decode_step_p99_ms", m->step_p99 * 1e3},
                          {"decoder_itl_p50_ms", m->dec_itl_p50 * 1e3},
                          {"decoder_itl_p99_ms", m->dec_itl_p99 * 1e3},
                          {"proxy_itl_p99_ms", m->proxy_itl_p99 * 1e3},
                          {"itl_p99_ms_in_decoder_buckets", m->client_itl_p99_bucketed * 1e3},
                          {"itl_p99_added_ms", (m->client_itl_p99_bucketed - m->dec_itl_p99) * 1e3},
                          {"load1", m->load1}};
      out.push_back(j);
      if (m->s.failed > 0) {
        std::cerr << fmt::format("tandem bench proxy: workload {}: {} requests failed\n", w.name,
                                 m->s.failed);
        for (const auto& [code, msg] : m->failures) {
          std::cerr << fmt::format("tandem bench proxy: workload {}: {} failed with {}, e.g.: {}\n",
                                   w.name, m->s.failed_by_status.at(code), code, msg);
        }
        rc = 3;
      }
    }
    if (floor && rc == 0) {
      double rate = 0;  // the prompt workload's, when it ran: the floor keeps its cadence
      for (const auto& j : out) {
        if (j["workload"] == "prompt" && j["duration_s"].get<double>() > 0) {
          rate = j["requests_ok"].get<double>() / j["duration_s"].get<double>();
        }
      }
      auto rows = floor->Run(a.prompt_requests, a.prompt_input, a.prompt_concurrency, rate);
      if (!rows.ok()) {
        rc = bad(rows.status());
      } else {
        for (auto& r : *rows) out.push_back(std::move(r));
        std::error_code ec;
        rc = std::max(rc,
                      RunRelayRows(fs::read_symlink("/proc/self/exe", ec).string(), a, rate, out));
      }
    }
  }
  Stop(*fleet);
  if (!a.json_path.empty()) {
    std::ofstream f(a.json_path);
    f << out.dump(2) << "\n";
    if (!f) return bad(InvalidArgumentError(fmt::format("--json: cannot write '{}'", a.json_path)));
  }
  return rc;
}

}  // namespace

void RegisterBenchProxy(CLI::App& bench, GlobalOptions& g) {
  auto* cmd = bench.add_subcommand(
      "proxy", "CPU per token and per prompt of the proxy and decoder on a sim fleet "
               "(docs/bench-serve.md)");
  auto a = std::make_shared<ProxyBenchArgs>();
  cmd->add_option("--config", a->config,
                  "fleet to launch (default configs/sim-1p1d.yaml); stopped at the end");
  cmd->add_option("--state-file", a->state_file,
                  "measure a running fleet instead (tandem launch --state-file)");
  cmd->add_option("--workloads", a->workloads,
                  "comma-separated: idle, stream, sse, prompt, open, floor, prompt-floor "
                  "(default idle, stream, prompt, open, floor, prompt-floor)");
  cmd->add_option("--idle-seconds", a->idle_seconds,
                  "idle: seconds measured with no request (default 10)");
  cmd->add_option("--launch-timeout", a->launch_timeout_s, "seconds for the fleet to be ready");
  cmd->add_option("--stream-requests", a->stream_requests, "stream: requests (default 100)");
  cmd->add_option("--stream-input", a->stream_input, "stream: prompt tokens (default 16)");
  cmd->add_option("--stream-output", a->stream_output, "stream: output tokens (default 1000)");
  cmd->add_option("--stream-concurrency", a->stream_concurrency, "stream: in flight (default 16)");
  cmd->add_option("--prompt-requests", a->prompt_requests, "prompt: requests (default 200)");
  cmd->add_option("--prompt-input", a->prompt_input, "prompt: prompt tokens (default 8000)");
  cmd->add_option("--prompt-concurrency", a->prompt_concurrency, "prompt: in flight (default 16)");
  cmd->add_option("--open-streams", a->open_streams,
                  "open: streams opened at once, each one request (default 1000)");
  cmd->add_option("--open-output", a->open_output, "open: output tokens each (default 64)");
  cmd->add_option("--floor-requests", a->floor_requests,
                  "floor: requests per floor server, shaped as stream's (default 32)");
  cmd->add_option("--floor-step-ms", a->floor_step_ms,
                  "floor: ms between tokens of a stream (default: the stream workload's ITL p50 "
                  "when it ran, else 6.4)");
  cmd->add_option("--duration", a->duration_s,
                  "bound of each workload in seconds (default 300)");
  cmd->add_option("--grpc-server", a->grpc_server,
                  "grpc|native: the launched fleet's public gRPC front end (proxy.grpc_server; "
                  "default: the config's)");
  cmd->add_option("--json", a->json_path, "write the results as JSON to PATH");
  cmd->callback([&g, a] { g.exit_code = RunProxyBench(*a); });
  RegisterBenchProxyFloorServer(bench, g.exit_code);
}

}  // namespace tandem::cli
