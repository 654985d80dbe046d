#include "fleet_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "common/net.h"
#include "common/rpc_server.h"
#include "reaper.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::testing {

namespace fs = std::filesystem;
namespace pb = ::tandem::v1;

std::string BundledModel() { return std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv"; }

bool HaveBundledModel() { return std::filesystem::exists(BundledModel() + "/model.safetensors"); }

static std::string Tandem() { return std::string(TANDEM_BINARY_DIR) + "/tandem"; }

// TANDEM_TEST_LOG_LEVEL (e.g. debug) overrides the default level, so that a
// failing fleet test can be rerun with the proxy's per-decision log lines
// (keep the logs with TANDEM_KEEP_TEST_DIRS=1); a test that chose a level
// itself keeps it.
static std::string LogLevel(const FleetOptions& o) {
  const char* env = getenv("TANDEM_TEST_LOG_LEVEL");
  return env && *env && o.log_level == FleetOptions{}.log_level ? std::string(env) : o.log_level;
}

// TANDEM_TEST_GRPC_SERVER=native (or grpc) in the environment: the proxy's
// public gRPC port is served by that front end (proxy.grpc_server,
// docs/grpc-frontend.md), unless the test chose one itself.
static std::string GrpcServerYaml(const FleetOptions& o) {
  const char* env = getenv("TANDEM_TEST_GRPC_SERVER");
  if (env == nullptr || *env == 0 || o.proxy_yaml.find("grpc_server:") != std::string::npos) {
    return "";
  }
  return fmt::format("  grpc_server: {}\n", env);
}

// TANDEM_TEST_PREFILL_TRANSPORT=grpc (or tcp) in the environment: the
// proxy's Prefill calls use that transport (proxy.prefill_transport,
// docs/serving-workers.md), unless the test chose one itself.
static std::string PrefillTransportYaml(const FleetOptions& o) {
  const char* env = getenv("TANDEM_TEST_PREFILL_TRANSPORT");
  if (env == nullptr || *env == 0 || o.proxy_yaml.find("prefill_transport:") != std::string::npos) {
    return "";
  }
  return fmt::format("  prefill_transport: {}\n", env);
}

// TANDEM_TEST_WATCH_TRANSPORT=grpc (or tcp) in the environment: what
// carries the workers' Watch streams (proxy.watch_transport,
// docs/serving-workers.md "Watch transport"), unless the test chose one itself.
static std::string WatchTransportYaml(const FleetOptions& o) {
  const char* env = getenv("TANDEM_TEST_WATCH_TRANSPORT");
  if (env == nullptr || *env == 0 || o.proxy_yaml.find("watch_transport:") != std::string::npos) {
    return "";
  }
  return fmt::format("  watch_transport: {}\n", env);
}

// TANDEM_TEST_REGISTER_TRANSPORT=grpc (or tcp) in the environment: what the
// workers' registrations use on proxy.internal (proxy.register_transport,
// docs/serving-workers.md "Register transport"), unless the test chose one.
static std::string RegisterTransportYaml(const FleetOptions& o) {
  const char* env = getenv("TANDEM_TEST_REGISTER_TRANSPORT");
  if (env == nullptr || *env == 0 ||
      o.proxy_yaml.find("register_transport:") != std::string::npos) {
    return "";
  }
  return fmt::format("  register_transport: {}\n", env);
}

// TANDEM_TEST_RESERVE_TRANSPORT=grpc (or tcp) in the environment: how the
// prefill and both workers call decoders' Reserve (<role>.reserve_transport,
// docs/serving-workers.md "Reserve transport"), unless the test chose it.
static std::string ReserveTransportYaml(const std::string& role, const std::string& role_yaml) {
  const char* env = getenv("TANDEM_TEST_RESERVE_TRANSPORT");
  if (env == nullptr || *env == 0 || role == "decode" ||
      role_yaml.find("reserve_transport:") != std::string::npos) {
    return "";
  }
  return fmt::format("  reserve_transport: {}\n", env);
}

Result<std::unique_ptr<Fleet>> Fleet::Launch(const FleetOptions& o) {
  auto f = std::make_unique<Fleet>();
  char tmpl[] = "/tmp/tandem-fleet-XXXXXX";
  if (!mkdtemp(tmpl)) return InternalError("mkdtemp failed");
  f->dir_ = tmpl;
  f->config_path_ = f->dir_ + "/fleet.yaml";
  {
    std::ofstream y(f->config_path_);
    y << fmt::format(
        "model:\n  path: {}\n{}cache:\n  block_size: 16\n  num_blocks: {}\n{}"
        "scheduler:\n  max_num_seqs: {}\n  max_batched_tokens: {}\n  max_waiting: {}\n{}"
        "proxy:\n  grpc: 127.0.0.1:0\n  http: 127.0.0.1:0\n  metrics: 127.0.0.1:0\n"
        "  max_inflight: {}\n  max_tokens_limit: 512\n{}"
        "router:\n  policy: {}\n{}"
        "logging:\n  level: {}\n  format: {}\n",
        o.model_path.empty() ? BundledModel() : o.model_path, o.model_yaml, o.num_blocks,
        o.cache_yaml, o.max_num_seqs, o.max_batched_tokens, o.max_waiting, o.scheduler_yaml,
        o.max_inflight,
        o.proxy_yaml + GrpcServerYaml(o) + PrefillTransportYaml(o) + WatchTransportYaml(o) +
            RegisterTransportYaml(o),
        o.policy, o.router_yaml, LogLevel(o), o.log_format);
    for (auto [role, n, extra] : {std::tuple{"prefill", o.prefill, &o.prefill_yaml},
                                  {"decode", o.decode, &o.decode_yaml},
                                  {"both", o.both, &o.both_yaml}}) {
      y << fmt::format("{}:\n  replicas: {}\n  grpc: 127.0.0.1:0\n  metrics: 127.0.0.1:0\n{}{}",
                       role, n, *extra, ReserveTransportYaml(role, *extra));
    }
    y << o.extra_yaml;
  }
  const std::string state = f->dir_ + "/state.json";
  const std::string log = f->dir_ + "/launch.log";
  f->pid_ = fork();
  if (f->pid_ == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    const std::string bin = Tandem();
    execl(bin.c_str(), bin.c_str(), "launch", f->config_path_.c_str(), "--state-file",
          state.c_str(), nullptr);
    _exit(127);
  }
  // If this test process dies, the reaper kills the fleet (reaper.h).
  ReapOnExit(f->pid_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(state)) {
    int st = 0;
    if (waitpid(f->pid_, &st, WNOHANG) == f->pid_) {
      Forget(f->pid_);
      f->pid_ = -1;
      std::ifstream in(log);
      std::stringstream ss;
      ss << in.rdbuf();
      return UnavailableError("tandem launch exited early:\n" + ss.str());
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return DeadlineExceededError("the fleet was not ready within 120 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::ifstream in(state);
  auto j = nlohmann::json::parse(in);
  f->proxy_grpc_ = j["proxy"]["grpc"];
  f->proxy_metrics_ = j["proxy"]["metrics"];
  f->proxy_http_ = j["proxy"].value("http", "");
  f->proxy_pid_ = j["proxy"].value("pid", -1);
  f->proxy_internal_ = j["proxy"].value("internal", "");
  if (j.contains("tls")) {
    f->tls_ca_ = j["tls"]["ca_file"];
    f->tls_cert_ = j["tls"]["cert_file"];
    f->tls_key_ = j["tls"]["key_file"];
  }
  f->cache_salt_ = j.value("cache_salt", "");
  for (const auto& w : j["workers"]) {
    WorkerAddr a{w["role"], w.value("name", ""), w["grpc"], w["metrics"], w["pid"], {}};
    for (const auto& r : w.value("ranks", nlohmann::json::array())) {
      a.ranks.emplace_back(r.value("rank", 0u), r.value("pid", -1));
    }
    f->workers_.push_back(std::move(a));
  }
  f->proxies_ = ReadProxies(state);
  ReapOnExit(f->proxy_pid_);
  for (const auto& p : f->proxies_) {
    if (p.pid != f->proxy_pid_) ReapOnExit(p.pid);
  }
  for (const auto& w : f->workers_) {
    ReapOnExit(w.pid);
    for (const auto& [rank, pid] : w.ranks) {
      if (rank > 0) ReapOnExit(pid);
    }
  }
  return f;
}

std::vector<ProxyAddr> ReadProxies(const std::string& state_path) {
  std::vector<ProxyAddr> out;
  try {
    std::ifstream in(state_path);
    const auto j = nlohmann::json::parse(in);
    for (const auto& p : j.value("proxies", nlohmann::json::array())) {
      out.push_back({p.value("name", ""), p.value("grpc", ""), p.value("http", ""),
                     p.value("metrics", ""), p.value("internal", ""), p.value("pid", -1)});
    }
  } catch (const std::exception&) {
    return {};
  }
  return out;
}

std::vector<std::string> Fleet::JoinArgs(const std::string& name) const {
  std::vector<std::string> a = {"--join", proxy_internal_};
  if (tls_ca_.empty()) return a;
  // A worker restarted under its own name presents the certificate the
  // launcher issued to it (next to the fleet CA), as an operator restarting
  // it would: the proxy binds a name to the identity that first registered
  // it. Any other name joins with the operator identity of the state file.
  std::string cert = tls_cert_, key = tls_key_;
  if (!name.empty()) {
    const auto dir = std::filesystem::path(tls_ca_).parent_path();
    const auto own_cert = dir / (name + ".pem"), own_key = dir / (name + ".key");
    if (std::filesystem::exists(own_cert) && std::filesystem::exists(own_key)) {
      cert = own_cert.string();
      key = own_key.string();
    }
  }
  a.insert(a.end(), {"--tls-ca", tls_ca_, "--tls-cert", cert, "--tls-key", key});
  return a;
}

Result<int> Fleet::Stop(std::chrono::seconds grace) {
  if (pid_ <= 0) return InternalError("not running");
  kill(pid_, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  int st = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      ForgetAll();
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return DeadlineExceededError("the launcher did not stop in time");
}

// The launcher has exited: it stopped (or, killed, left to their
// PR_SET_PDEATHSIG) its proxy and workers. Their pids may be reused from
// now on, so the reaper must not hit them.
void Fleet::ForgetAll() {
  Forget(pid_);
  Forget(proxy_pid_);
  for (const auto& p : proxies_) Forget(p.pid);
  for (const auto& w : workers_) {
    Forget(w.pid);
    for (const auto& [rank, pid] : w.ranks) {
      if (rank > 0) Forget(pid);
    }
  }
  pid_ = -1;
}

Fleet::~Fleet() {
  if (pid_ > 0) {
    if (!Stop(std::chrono::seconds(20)).ok()) {
      // Whatever is left (a stopped worker ignores SIGTERM): SIGKILL, as
      // the reaper would.
      for (const auto& w : workers_) {
        kill(w.pid, SIGKILL);
        for (const auto& [rank, pid] : w.ranks) kill(pid, SIGKILL);
      }
      for (const auto& p : ReadProxies(state_path())) kill(p.pid, SIGKILL);
      kill(proxy_pid_, SIGKILL);
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      ForgetAll();
    }
  }
  std::error_code ec;
  if (!dir_.empty() && !getenv("TANDEM_KEEP_TEST_DIRS")) fs::remove_all(dir_, ec);
}

Result<Completion> Generate(const std::string& proxy, const GenerateArgs& a) {
  auto channel = grpc::CreateChannel(proxy, grpc::InsecureChannelCredentials());
  auto stub = pb::Generation::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + a.timeout);
  if (!a.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + a.api_key);
  pb::GenerateRequest req;
  req.set_model(a.model);
  req.set_request_id(a.request_id);
  req.set_prompt(a.prompt);
  for (uint32_t t : a.prompt_ids) req.add_prompt_token_ids(t);
  if (a.max_tokens) req.set_max_tokens(*a.max_tokens);
  if (a.temperature) req.mutable_sampling()->set_temperature(*a.temperature);
  if (a.top_p) req.mutable_sampling()->set_top_p(*a.top_p);
  if (a.seed) req.mutable_sampling()->set_seed(*a.seed);
  for (const auto& s : a.stop) req.add_stop(s);
  for (uint32_t t : a.stop_token_ids) req.add_stop_token_ids(t);
  req.set_ignore_eos(a.ignore_eos);
  auto reader = stub->Generate(&ctx, req);
  Completion c;
  pb::GenerateResponse resp;
  while (reader->Read(&resp)) {
    ++c.messages;
    c.request_id = resp.request_id();
    c.token_ids.insert(c.token_ids.end(), resp.token_ids().begin(), resp.token_ids().end());
    c.text += resp.text();
    if (resp.finish_reason() != pb::FINISH_REASON_UNSPECIFIED) {
      c.finish_reason = resp.finish_reason();
      c.prompt_tokens = resp.usage().prompt_tokens();
      c.completion_tokens = resp.usage().completion_tokens();
      c.cached_prompt_tokens = resp.usage().cached_prompt_tokens();
    }
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) return FromGrpcStatus(st);
  return c;
}

Result<std::vector<uint32_t>> ReferenceGenerate(const std::vector<uint32_t>& prompt_ids,
                                                uint32_t max_tokens) {
  return ReferenceGenerate(prompt_ids, max_tokens, 0.0f, 0);
}

namespace {

Result<std::vector<uint32_t>> ReferenceGenerateOn(const std::string& model_dir,
                                                  const std::vector<uint32_t>& prompt_ids,
                                                  uint32_t max_tokens, float temperature,
                                                  uint64_t seed) {
  const std::string sampling =
      temperature == 0.0f ? std::string("--temperature 0")
                          : fmt::format("--temperature {} --seed {}", temperature, seed);
  std::string ids;
  for (uint32_t t : prompt_ids) {
    if (!ids.empty()) ids.push_back(',');
    ids += std::to_string(t);
  }
  const std::string cmd = fmt::format(
      "{} generate --model {} --prompt-ids {} --max-tokens {} {} --ignore-eos --json 2>/dev/null",
      Tandem(), model_dir, ids, max_tokens, sampling);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return InternalError("popen failed");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  if (status != 0) return InternalError(fmt::format("tandem generate failed ({}): {}", status, out));
  try {
    auto j = nlohmann::json::parse(out);
    return j.at("token_ids").get<std::vector<uint32_t>>();
  } catch (const std::exception& e) {
    return InternalError(fmt::format("bad JSON from tandem generate: {}: {}", e.what(), out));
  }
}

}  // namespace

Result<std::vector<uint32_t>> ReferenceGenerate(const std::vector<uint32_t>& prompt_ids,
                                                uint32_t max_tokens, float temperature,
                                                uint64_t seed) {
  return ReferenceGenerateOn(BundledModel(), prompt_ids, max_tokens, temperature, seed);
}

Result<std::vector<uint32_t>> ReferenceGenerateWith(const std::string& model_dir,
                                                    const std::vector<uint32_t>& prompt_ids,
                                                    uint32_t max_tokens) {
  return ReferenceGenerateOn(model_dir, prompt_ids, max_tokens, 0.0f, 0);
}

Result<std::string> Scrape(const std::string& address) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp.port);
  inet_pton(AF_INET, hp.host.c_str(), &sa.sin_addr);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return UnavailableError("cannot connect to " + address);
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, req.data(), req.size()) < 0) {
    close(fd);
    return UnavailableError("write failed");
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, static_cast<size_t>(n));
  close(fd);
  const auto body = resp.find("\r\n\r\n");
  if (body == std::string::npos) return UnavailableError("no HTTP body from " + address);
  return resp.substr(body + 4);
}

double MetricValue(const std::string& text, const std::string& metric) {
  double sum = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(metric, 0) != 0) continue;
    const char next = line.size() > metric.size() ? line[metric.size()] : '\0';
    if (next != '{' && next != ' ') continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

double Metric(const std::string& address, const std::string& metric) {
  auto m = Scrape(address);
  return m.ok() ? MetricValue(*m, metric) : -1;
}

double LabeledMetric(const std::string& address, const std::string& metric,
                     const std::string& label) {
  auto m = Scrape(address);
  if (!m.ok()) return -1;
  double sum = 0;
  std::istringstream in(*m);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(metric + "{", 0) == 0 && line.find(label) != std::string::npos) {
      sum += std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return sum;
}

const WorkerAddr* FindWorker(const Fleet& fleet, const std::string& name) {
  for (const auto& w : fleet.workers()) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

std::vector<uint32_t> PromptIds(uint32_t seed, uint32_t n, uint32_t vocab, uint32_t prefix_seed,
                                uint32_t shared) {
  std::vector<uint32_t> out;
  std::mt19937 shared_rng(prefix_seed * 7919 + 1);
  std::mt19937 rng(seed * 104729 + 17);
  for (uint32_t i = 0; i < n; ++i) {
    out.push_back(i < shared ? shared_rng() % vocab : rng() % vocab);
  }
  return out;
}

bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds limit) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < give_up) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<size_t> WaitForLogLine(const std::string& path, const std::string& needle,
                                     std::chrono::milliseconds limit, size_t from) {
  std::optional<size_t> at;
  WaitUntil(
      [&] {
        const std::string text = ReadText(path);
        const size_t pos = text.size() > from ? text.find(needle, from) : std::string::npos;
        if (pos != std::string::npos) at = pos + needle.size();
        return at.has_value();
      },
      limit);
  return at;
}

Result<WorkerAddr> JoinWorker(const Fleet& fleet, const std::string& role, const std::string& name,
                              const std::string& log, const std::vector<std::string>& env,
                              std::chrono::seconds limit, const std::vector<std::string>& join,
                              const std::string& config) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return InternalError("pipe failed");
  // Everything the child needs is built before fork (it only execs).
  constexpr int kReadyFd = 100;
  std::vector<std::string> args = {Tandem(), role, "--config",
                                   config.empty() ? fleet.config_path() : config, "--grpc",
                                   "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--name", name,
                                   "--ready-fd", std::to_string(kReadyFd)};
  // --join proxy.internal and the state file's identity (the internal mTLS).
  const std::vector<std::string> join_args = fleet.JoinArgs(name);
  if (join.empty()) {
    args.insert(args.end(), join_args.begin(), join_args.end());
  } else {  // JoinArgs is {"--join", ADDRESS, TLS flags...}
    args.insert(args.end(), join.begin(), join.end());
    args.insert(args.end(), join_args.begin() + 2, join_args.end());
  }
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) envs.emplace_back(*e);
  envs.insert(envs.end(), env.begin(), env.end());
  // The fleet's random salt (Fleet::cache_salt), unless `env` sets one.
  const bool own_salt = std::any_of(env.begin(), env.end(), [](const std::string& e) {
    return e.rfind("TANDEM_CACHE_SALT=", 0) == 0;
  });
  if (!own_salt && !fleet.cache_salt().empty()) {
    envs.insert(envs.begin(), "TANDEM_CACHE_SALT=" + fleet.cache_salt());
  }
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    dup2(fds[1], kReadyFd);  // without O_CLOEXEC: the worker writes its ready line here
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return InternalError("fork failed");
  }
  ReapOnExit(pid);
  // The ready line, or end of file when the worker exits; bounded by `limit`.
  std::string line;
  const auto give_up = std::chrono::steady_clock::now() + limit;
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  while (line.find('\n') == std::string::npos && std::chrono::steady_clock::now() < give_up) {
    char buf[512];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n == 0) break;
    if (n > 0) {
      line.append(buf, static_cast<size_t>(n));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  close(fds[0]);
  auto field = [&](const std::string& key) -> std::string {
    const auto q = line.find("\"" + key + "\":\"");
    if (q == std::string::npos) return "";
    const size_t from = q + key.size() + 4;
    return line.substr(from, line.find('"', from) - from);
  };
  WorkerAddr w{role, name, field("grpc"), field("metrics"), pid};
  if (w.grpc.empty() || w.metrics.empty()) {
    StopProcess(pid, std::chrono::seconds(5));
    return UnavailableError(fmt::format("{} did not join within {} s; ready line '{}'; log:\n{}", name,
                                        limit.count(), line, ReadText(log)));
  }
  return w;
}

const std::vector<std::string>& HeldGauges() {
  static const std::vector<std::string> names = {
      "tandem_num_requests_running", "tandem_num_requests_waiting",  "tandem_kv_reservations",
      "tandem_kv_parked_prefills",   "tandem_prefill_queue_requests", "tandem_kv_cache_usage_ratio",
      "tandem_kv_quarantined_blocks"};
  return names;
}

std::string WaitFleetIdle(const std::vector<WorkerAddr>& workers, const std::string& proxy_metrics,
                          std::chrono::milliseconds limit) {
  std::string held;
  WaitUntil(
      [&] {
        held.clear();
        for (const auto& w : workers) {
          auto m = Scrape(w.metrics);
          if (!m.ok()) {
            held += fmt::format("{}: no metrics ({}); ", w.name, m.status().ToString());
            continue;
          }
          for (const auto& g : HeldGauges()) {
            const double v = MetricValue(*m, g);
            if (v != 0) held += fmt::format("{} {}={}; ", w.name, g, v);
          }
        }
        if (!proxy_metrics.empty()) {
          auto p = Scrape(proxy_metrics);
          const double inflight = p.ok() ? MetricValue(*p, "tandem_requests_inflight") : -1;
          if (inflight != 0) held += fmt::format("proxy tandem_requests_inflight={}; ", inflight);
        }
        return held.empty();
      },
      limit);
  return held;
}

int StopProcess(pid_t pid, std::chrono::seconds grace) {
  if (pid <= 0) return -1;
  kill(pid, SIGCONT);
  kill(pid, SIGTERM);
  int st = -1;
  const auto give_up = std::chrono::steady_clock::now() + grace;
  bool exited = false;
  while (std::chrono::steady_clock::now() < give_up) {
    const pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid || r < 0) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  Forget(pid);
  return st;
}

}  // namespace tandem::testing
