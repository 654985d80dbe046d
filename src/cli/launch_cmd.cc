// `tandem launch CONFIG [--state-file PATH]` (DESIGN.md section 7): starts the
// proxies (proxy.replicas), then every worker with --join naming all of
// them, waits until each is ready, writes the state file, prints a table,
// and stops everything on SIGINT/SIGTERM. A dead worker is logged and the
// rest keep serving. A proxy that dies abnormally is restarted on the same
// addresses (proxy.restart) and takes traffic again once the workers'
// snapshots rebuilt its index (--warm-workers); the fleet stops when no
// proxy is left (docs/failure-handling.md, "Proxy replicas").
//
// A worker of tensor_parallel x pipeline_parallel > 1 (issue 18,
// docs/parallelism.md "Rank processes") is a group of rank processes
// started together (followers first, then rank 0, which serves once every
// rank joined its group); if any rank exits the group is stopped (the
// supervisor's rule) and the worker leaves routing.
//
// Stopping drains (docs/failure-handling.md): the proxy first (new requests
// UNAVAILABLE, in-flight ones get proxy.drain_seconds to finish while every
// worker still serves them), then the workers, which have nothing left by
// then; whatever is still alive kWorkerStopGrace after the proxy is gone is
// killed.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string_view>
#include <vector>

#include "cli/autoscaler.h"
#include "cli/commands.h"
#include "cli/launch_tls.h"
#include "cli/supervisor.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/request_id.h"
#include "kvtransfer/staging/device_path.h"
#include "model/model_config.h"
#include "worker/rank_layout.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/device.h"
#endif

namespace tandem::cli {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// After the proxy has drained, workers only stop their servers and engines.
constexpr std::chrono::milliseconds kWorkerStopGrace = 5s;

// Port 0 stays 0 (each process picks one); port P gives P + index.
std::string NthAddress(const std::string& base, uint32_t index) {
  auto hp = ParseHostPort(base);  // validated when the config was loaded
  if (!hp.ok() || hp->port == 0) return base;
  hp->port = static_cast<uint16_t>(hp->port + index);
  return hp->ToString();
}

// A cuda fleet on a machine without a usable device: refused before any
// process starts, in one line naming the device (not as a worker that dies
// later). Asking the CUDA runtime here is safe: children exec right after
// fork, so no CUDA state is inherited.
Status CheckBackendDevice(const FleetConfig& cfg) {
  if (cfg.model.backend != "cuda") return Status::Ok();
#ifdef TANDEM_HAVE_CUDA
  char why[256] = "";
  if (kernels::cuda::DeviceCount(why, sizeof(why)) == 0) {
    return FailedPreconditionError(fmt::format(
        "model.backend is cuda but this machine has no usable CUDA device ({}); use "
        "model.backend: cpu here",
        why));
  }
  return Status::Ok();
#else
  return FailedPreconditionError(
      "model.backend is cuda but this tandem build has no CUDA kernels, so no CUDA device can be "
      "used (configure with -DTANDEM_CUDA=ON where nvcc is installed)");
#endif
}

// transport.device_path direct on a machine whose UCX cannot register CUDA
// memory: refused before any process starts (and before the device check),
// in one line naming the key and the missing capability. UCX is asked with
// ucp_init/ucp_cleanup only; children exec right after fork.
Status CheckDevicePath(const FleetConfig& cfg) {
  if (cfg.model.backend != "cuda" || cfg.transport.device_path != "direct") return Status::Ok();
  return kvtransfer::ChooseDeviceTransferPath(cfg.transport.device_path, cfg.transport.backend,
                                              kvtransfer::DetectUcxCudaSupport())
      .status();
}

// The role sections' rank layouts against the model (issue 18): refused
// before any process starts, naming the key. Backend sim models its
// layouts inside one process and checks them itself.
Status CheckRankLayouts(const FleetConfig& cfg) {
  if (cfg.model.backend == "sim") return Status::Ok();
  bool any = false;
  for (const auto* role : {"prefill", "decode", "both"}) {
    any = any || worker::RoleLayout(cfg, role).world() > 1;
  }
  if (!any) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(auto model, model::LoadModelConfig(cfg.model.path));
  for (const auto* role : {"prefill", "decode", "both"}) {
    TANDEM_RETURN_IF_ERROR(
        worker::CheckRoleLayout(role, worker::RoleLayout(cfg, role), model, cfg.model.path));
  }
  return Status::Ok();
}

// Backend cuda, one device per rank (docs/parallelism.md, "Rank
// processes"): rank r of every multi-rank worker gets the r-th entry of the
// launcher's CUDA_VISIBLE_DEVICES (device r when it is unset), modulo its
// length.
std::vector<std::string> RankEnvironment(const FleetConfig& cfg, uint32_t rank, uint32_t ranks) {
  if (cfg.model.backend != "cuda" || ranks <= 1) return {};
  std::vector<std::string> devices;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr && *v != '\0') {
    std::string_view s(v);
    while (!s.empty()) {
      const size_t comma = s.find(',');
      devices.emplace_back(s.substr(0, comma));
      s = comma == std::string_view::npos ? std::string_view() : s.substr(comma + 1);
    }
  }
  const std::string device =
      devices.empty() ? std::to_string(rank) : devices[rank % devices.size()];
  return {"CUDA_VISIBLE_DEVICES=" + device};
}

std::string SelfExe() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "tandem" : p.string();
}

// `cache_salt`: the fleet salt this launcher made ("" when the config or
// the environment gave one), for workers joined by hand (docs/security.md).
// `proxies`: the current process of each proxy replica, in index order.
Status WriteStateFile(const std::string& path, const Supervisor& sup,
                      const std::vector<const Child*>& proxies, const LaunchCertificates& certs,
                      const std::string& cache_salt) {
  nlohmann::json state;
  state["workers"] = nlohmann::json::array();
  state["proxies"] = nlohmann::json::array();
  certs.AddToState(state);
  for (const Child* c : proxies) {
    state["proxies"].push_back({{"grpc", c->grpc},         {"http", c->http},
                                {"metrics", c->metrics},   {"internal", c->internal},
                                {"pid", c->pid},           {"name", c->spec.name}});
  }
  if (!proxies.empty()) state["proxy"] = state["proxies"][0];
  for (const auto& c : sup.children()) {
    // Autoscaled workers come and go; a worker is its rank 0 (issue 18).
    if (c.spec.role != "proxy" && c.alive && !c.draining && c.spec.rank == 0) {
      // Every live rank of the worker group, by rank (rank 0 alone for a
      // one-process worker).
      std::vector<std::pair<uint32_t, pid_t>> ranks;
      for (const auto& r : sup.children()) {
        if (r.alive && r.spec.name == c.spec.name && r.spec.role == c.spec.role) {
          ranks.emplace_back(r.spec.rank, r.pid);
        }
      }
      std::sort(ranks.begin(), ranks.end());
      nlohmann::json jr = nlohmann::json::array();
      for (const auto& [rank, pid] : ranks) jr.push_back({{"rank", rank}, {"pid", pid}});
      state["workers"].push_back({{"role", c.spec.role},
                                  {"name", c.spec.name},
                                  {"grpc", c.grpc},
                                  {"metrics", c.metrics},
                                  {"pid", c.pid},
                                  {"ranks", std::move(jr)}});
    }
  }
  if (!cache_salt.empty()) state["cache_salt"] = cache_salt;
  // Write then rename, so a reader never sees half a file. Owner-only: it
  // may hold the fleet salt, a secret.
  const std::string tmp = path + ".tmp";
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return InternalError(fmt::format("cannot write the state file {}", tmp));
    ::fchmod(fd, 0600);  // an existing file keeps its mode otherwise
    const std::string text = state.dump(2) + "\n";
    const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    ::close(fd);
    if (!ok) return InternalError(fmt::format("cannot write the state file {}", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return InternalError(fmt::format("cannot rename {} to {}: {}", tmp, path, ec.message()));
  return Status::Ok();
}

// Workers of `role` started at launch: the fleet file's replicas, brought
// into autoscale.{prefill,decode}.{min,max} when autoscaling.
uint32_t InitialReplicas(const FleetConfig& cfg, const std::string& role) {
  const RoleConfig& rc = role == "prefill" ? cfg.prefill : role == "decode" ? cfg.decode : cfg.both;
  if (!cfg.autoscale.enabled || role == "both") return rc.replicas;
  const AutoscaleRoleConfig& b = role == "prefill" ? cfg.autoscale.prefill : cfg.autoscale.decode;
  return std::clamp(rc.replicas, b.min, b.max);
}

void PrintTable(const Supervisor& sup) {
  std::cout << fmt::format("{:<12} {:<8} {:>8}  {:<22} {:<22} {:<22} {}\n", "process", "role",
                           "pid", "grpc", "metrics", "http", "rank");
  for (const auto& c : sup.children()) {
    // Follower ranks (issue 18) serve nothing: their addresses read "-".
    const bool follower = c.spec.rank > 0;
    std::cout << fmt::format("{:<12} {:<8} {:>8}  {:<22} {:<22} {:<22} {}\n", c.spec.name,
                             c.spec.role, c.pid, follower ? "-" : c.grpc,
                             follower ? "-" : c.metrics, c.http.empty() ? "-" : c.http,
                             c.spec.ranks > 1 ? fmt::format("{} of {}", c.spec.rank, c.spec.ranks)
                                              : "-");
  }
  std::cout.flush();
}

// One proxy replica: its current process and what a restart needs.
struct ProxySlot {
  std::string name;                // "proxy" (one replica) or "proxy-I"
  std::vector<std::string> extra;  // its TLS flags (internal identity, public certificate)
  Child* child = nullptr;          // the current process
  std::chrono::steady_clock::time_point started;
  int quick_deaths = 0;            // deaths within kQuickDeath of their start, in a row
};

// A proxy that dies this soon after its start, kMaxQuickDeaths times in a
// row, is not restarted again (a crash loop: the config or the host is wrong).
constexpr std::chrono::seconds kQuickDeath{10};
constexpr int kMaxQuickDeaths = 5;

// Restarts a proxy that died abnormally (a signal, a non-zero exit) on the
// addresses it had, so the workers' --join list still names it; it writes
// its ready line once `num_workers` snapshots rebuilt its index (they
// register again within about a second: worker/proxy_registrar.h). A
// proxy that exited 0 (a SIGTERM by hand) is left down.
template <typename Make>
Status RestartProxy(Supervisor& sup, ProxySlot& p, const Make& make, uint32_t num_workers) {
  const Child old = *p.child;
  if (WIFEXITED(old.exit_status) && WEXITSTATUS(old.exit_status) == 0) {
    return FailedPreconditionError(fmt::format("{} exited cleanly (status 0)", p.name));
  }
  const auto now = std::chrono::steady_clock::now();
  p.quick_deaths = now - p.started < kQuickDeath ? p.quick_deaths + 1 : 0;
  if (p.quick_deaths >= kMaxQuickDeaths) {
    return FailedPreconditionError(fmt::format(
        "it died {} times within {} s of its start", p.quick_deaths, kQuickDeath.count()));
  }
  std::vector<std::string> extra = {"--grpc", old.grpc, "--metrics", old.metrics, "--internal",
                                    old.internal, "--warm-workers",
                                    fmt::format("{}", num_workers)};
  if (!old.http.empty()) {
    extra.push_back("--http");
    extra.push_back(old.http);
  }
  std::vector<std::string> argv = make("proxy", extra);
  argv.insert(argv.end(), p.extra.begin(), p.extra.end());
  spdlog::warn("{}; restarting it on the same addresses (proxy.restart)", DescribeExit(old));
  auto child = sup.Start({p.name, "proxy", argv}, 120s);
  if (!child.ok()) {
    p.started = std::chrono::steady_clock::now();
    return child.status();
  }
  p.child = *child;
  p.started = std::chrono::steady_clock::now();
  spdlog::info("{} restarted (pid {}) and ready in {:.0f} ms: index rebuilt from the workers' "
               "snapshots",
               p.name, p.child->pid,
               std::chrono::duration<double, std::milli>(p.started - now).count());
  return Status::Ok();
}

int RunLaunch(const std::string& config_path, const std::string& state_file,
              const GlobalOptions& g) {
  auto cfg = LoadFleetConfig(config_path);
  if (!cfg.ok()) {
    std::cerr << cfg.status().message() << "\n";
    return 1;
  }
  const std::string level = g.log_level.empty() ? cfg->logging.level : g.log_level;
  const std::string format = g.log_format.empty() ? cfg->logging.format : g.log_format;
  if (auto s = SetupLogging("launch", level, format); !s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  if (auto s = CheckDevicePath(*cfg); !s.ok()) {
    spdlog::error("fleet not started: {}", s.message());
    return 1;
  }
  if (auto s = CheckBackendDevice(*cfg); !s.ok()) {
    spdlog::error("fleet not started: {}", s.message());
    return 1;
  }
  if (auto s = CheckRankLayouts(*cfg); !s.ok()) {
    spdlog::error("fleet not started: {}", s.message());
    return 1;
  }
  // The fleet salt (cache.salt; docs/security.md): unless the file or
  // $TANDEM_CACHE_SALT gives one, a random one for this fleet, handed to
  // every child in its environment.
  std::string made_salt;
  if (cfg->cache.salt.empty()) {
    made_salt = RandomHex128();
    ::setenv(kCacheSaltEnv, made_salt.c_str(), 1);
  }
  const std::string exe = SelfExe();
  std::vector<std::string> common = {"--log-level", level, "--log-format", format};

  // Certificates first: every child gets its identity on its command line.
  auto certs = LaunchCertificates::Prepare(cfg->security, state_file);
  if (!certs.ok()) {
    spdlog::error("fleet not started: {}", certs.status().message());
    return 1;
  }
  auto with_tls = [&](const std::string& name, const std::vector<std::string>& addresses,
                      std::vector<std::string> argv) -> Result<std::vector<std::string>> {
    TANDEM_ASSIGN_OR_RETURN(auto extra, certs->InternalArgs(name, addresses));
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };

  // Everything is forked here, before this process touches UCX.
  Supervisor sup;
  auto make = [&](const std::string& sub, std::vector<std::string> extra) {
    std::vector<std::string> argv = {exe};
    argv.insert(argv.end(), common.begin(), common.end());
    argv.push_back(sub);
    argv.push_back("--config");
    argv.push_back(config_path);
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  // The proxies first (proxy.replicas; replica i on port + i of each key).
  const uint32_t num_proxies = cfg->proxy.replicas;
  std::vector<std::string> public_addresses;
  for (uint32_t i = 0; i < num_proxies; ++i) {
    public_addresses.push_back(NthAddress(cfg->proxy.grpc, i));
    public_addresses.push_back(NthAddress(cfg->proxy.http, i));
  }
  auto public_args = certs->PublicArgs(public_addresses);
  if (!public_args.ok()) {
    spdlog::error("fleet not started: {}", public_args.status().message());
    return 1;
  }
  std::vector<ProxySlot> proxies(num_proxies);
  std::string join;  // every proxy's internal listener: A,B,...
  for (uint32_t i = 0; i < num_proxies; ++i) {
    ProxySlot& p = proxies[i];
    p.name = num_proxies == 1 ? "proxy" : fmt::format("proxy-{}", i);
    const std::string internal = NthAddress(cfg->proxy.internal, i);
    auto tls = certs->InternalArgs(p.name, {internal});
    if (!tls.ok()) {
      spdlog::error("fleet not started: {}", tls.status().message());
      return 1;
    }
    p.extra = *tls;
    p.extra.insert(p.extra.end(), public_args->begin(), public_args->end());
    std::vector<std::string> argv =
        make("proxy", {"--grpc", NthAddress(cfg->proxy.grpc, i), "--http",
                       NthAddress(cfg->proxy.http, i), "--metrics",
                       NthAddress(cfg->proxy.metrics, i), "--internal", internal});
    argv.insert(argv.end(), p.extra.begin(), p.extra.end());
    auto proxy = sup.Start({p.name, "proxy", argv}, 120s);
    if (!proxy.ok()) {
      spdlog::error("fleet not started: {}", proxy.status().message());
      return 1;
    }
    p.child = *proxy;
    p.started = std::chrono::steady_clock::now();
    join += (join.empty() ? "" : ",") + p.child->internal;
  }
  uint64_t groups_started = 0;  // makes every worker group's name unique on the host
  auto start_worker = [&](const std::string& role, uint32_t i) -> Status {
    const RoleConfig& rc = role == "prefill" ? cfg->prefill
                           : role == "decode" ? cfg->decode
                                              : cfg->both;
    const std::string name = fmt::format("{}-{}", role, i);
    TANDEM_ASSIGN_OR_RETURN(
        auto argv, with_tls(name, {rc.grpc},
                            make(role, {"--join", join, "--name", name, "--grpc",
                                        NthAddress(rc.grpc, i), "--metrics",
                                        NthAddress(rc.metrics, i), "--drain-seconds",
                                        fmt::format("{}", cfg->proxy.drain_seconds)})));
    const uint32_t ranks = worker::RankProcesses(*cfg, role);
    if (ranks == 1) return sup.Start({name, role, argv}, 300s).status();
    // Issue 18: the followers first (each writes its ready line once it
    // runs; it then waits for rank 0 to join), then rank 0, ready once
    // every rank joined its group. Followers listen on nothing.
    const std::string group = fmt::format("tandem-{}-{}-{}", ::getpid(), name, ++groups_started);
    for (uint32_t r = 1; r < ranks; ++r) {
      auto follower = sup.Start({name, role,
                                 make(role, {"--name", name, "--rank", fmt::format("{}", r),
                                             "--group", group}),
                                 r, ranks, RankEnvironment(*cfg, r, ranks)},
                                120s);
      if (!follower.ok()) {
        sup.KillGroup(name);
        return follower.status();
      }
    }
    argv.insert(argv.end(), {"--rank", "0", "--group", group});
    auto rank0 = sup.Start({name, role, argv, 0, ranks, RankEnvironment(*cfg, 0, ranks)}, 300s);
    if (!rank0.ok()) {
      sup.KillGroup(name);
      return rank0.status();
    }
    spdlog::info("{}: {} ranks (group {}) serving on {}", name, ranks, group, (*rank0)->grpc);
    return Status::Ok();
  };
  std::map<std::string, uint32_t> started;  // per role: workers started at launch
  for (const auto* role : {"decode", "prefill", "both"}) {
    started[role] = InitialReplicas(*cfg, role);
    for (uint32_t i = 0; i < started[role]; ++i) {
      if (Status s = start_worker(role, i); !s.ok()) {
        spdlog::error("fleet not started: {}", s.message());
        return 1;  // ~Supervisor stops what did start
      }
    }
  }
  auto write_state = [&]() -> Status {
    if (state_file.empty()) return Status::Ok();
    std::vector<const Child*> current;
    for (const auto& p : proxies) current.push_back(p.child);
    return WriteStateFile(state_file, sup, current, *certs, made_salt);
  };
  if (auto s = write_state(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  PrintTable(sup);
  const Child& first = *proxies[0].child;
  spdlog::info("fleet ready: send requests to {} (gRPC{}){}; Ctrl-C stops it", first.grpc,
               first.http.empty() ? "; the HTTP API is not built yet"
                                  : fmt::format(") or http://{} (HTTP", first.http),
               num_proxies > 1 ? fmt::format(" or any of the {} proxies in the table",
                                             num_proxies)
                               : "");

  std::vector<std::string> proxy_names;
  for (const auto& p : proxies) proxy_names.push_back(p.name);
  // Live workers, not draining: what a restarted proxy waits for.
  auto serving_workers = [&sup] {
    return static_cast<uint32_t>(
        std::count_if(sup.children().begin(), sup.children().end(), [](const Child& c) {
          return c.spec.role != "proxy" && c.alive && !c.draining && c.spec.rank == 0;
        }));
  };
  // docs/scheduling.md, "Autoscaling": follow the largest count the
  // replicas' planners want (a restarted replica keeps its metrics address).
  std::unique_ptr<Autoscaler> scaler;
  // Without the autoscaler: a second's poll keeps the state file current
  // when a worker (or one rank of its group) exits.
  auto poll = std::chrono::milliseconds(1000);
  if (cfg->autoscale.enabled) {
    std::vector<std::string> metrics;
    for (const auto& p : proxies) metrics.push_back(p.child->metrics);
    scaler = std::make_unique<Autoscaler>(cfg->autoscale, std::move(metrics), &sup, start_worker,
                                          started);
    poll = std::chrono::milliseconds(static_cast<int64_t>(cfg->autoscale.interval_s * 1000));
  }
  int sig = 0;
  size_t exited = 0;
  while (true) {
    std::string died;
    sig = sup.WaitForSignalOrDeath(proxy_names, poll, &died);
    if (sig > 0) break;
    if (sig < 0) {  // the autoscaler's poll interval passed
      const size_t now_exited = static_cast<size_t>(std::count_if(
          sup.children().begin(), sup.children().end(), [](const Child& c) { return !c.alive; }));
      const bool scaled = scaler && scaler->Poll();
      if (scaled || now_exited != exited) {
        if (auto s = write_state(); !s.ok()) spdlog::error("{}", s.message());
      }
      exited = now_exited;
      continue;
    }
    ProxySlot& p = *std::find_if(proxies.begin(), proxies.end(),
                                 [&](const ProxySlot& x) { return x.name == died; });
    if (cfg->proxy.restart) {
      if (Status s = RestartProxy(sup, p, make, serving_workers()); !s.ok()) {
        spdlog::error("{} not restarted: {}", p.name, s.message());
      } else if (auto w = write_state(); !w.ok()) {
        spdlog::error("{}", w.message());
      }
    }
    const bool any_alive = std::any_of(proxies.begin(), proxies.end(),
                                       [](const ProxySlot& x) { return x.child->alive; });
    if (!any_alive) break;
    if (!p.child->alive) {
      spdlog::warn("{} stays down; {} other proxies keep serving", p.name,
                   std::count_if(proxies.begin(), proxies.end(),
                                 [](const ProxySlot& x) { return x.child->alive; }));
    }
  }
  int killed = 0;
  if (sig == 0) {
    spdlog::error("no proxy is left; stopping the fleet");
  } else {
    const auto drain = std::chrono::milliseconds(
        static_cast<int64_t>(cfg->proxy.drain_seconds * 1000));
    spdlog::info("signal {}: draining the proxies (up to {} s), then stopping the workers", sig,
                 cfg->proxy.drain_seconds);
    // The proxy waits up to `drain` for in-flight requests, then cancels
    // the rest; the margin covers its own shutdown.
    killed += sup.StopRole("proxy", drain + 2s);
  }
  killed += sup.StopAll(kWorkerStopGrace);
  if (killed > 0) spdlog::warn("{} process(es) had to be killed", killed);
  return sig == 0 ? 1 : 0;
}

}  // namespace

void RegisterLaunch(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("launch", "Start the fleet described by CONFIG in the foreground");
  auto config = std::make_shared<std::string>();
  auto state = std::make_shared<std::string>();
  cmd->add_option("config", *config, "fleet YAML file (default: configs/1p1d.yaml)");
  cmd->add_option("--state-file", *state, "write the fleet's real addresses here (JSON) when ready");
  cmd->callback([&g, config, state] {
    g.exit_code = RunLaunch(config->empty() ? DefaultConfigPath() : *config, *state, g);
  });
}

}  // namespace tandem::cli
