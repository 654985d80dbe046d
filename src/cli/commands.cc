#include "cli/commands.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "common/config.h"
#include "common/version.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/device.h"
#endif

namespace tandem::cli {

namespace fs = std::filesystem;

int NotYetAvailable(const std::string& command, const std::string& missing) {
  std::cerr << fmt::format("tandem {}: not available yet: {}\n", command, missing);
  return 2;
}

std::string DefaultConfigPath() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
         dir = dir.parent_path()) {
      const fs::path candidate = dir / "configs" / "1p1d.yaml";
      if (fs::exists(candidate)) return candidate.string();
    }
  }
  return "configs/1p1d.yaml";
}

void RegisterVersion(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("version", "Print version, git revision and build features");
  cmd->callback([&g] {
    std::cout << fmt::format("tandem {}\ngit revision: {}\n", Version(), GitRevision());
#ifdef TANDEM_HAVE_CUDA
    char why[256] = {0};
    const int n = kernels::cuda::DeviceCount(why, sizeof(why));
    std::cout << fmt::format("cuda kernels: compiled (sm_{})\ncuda devices: {}{}\n",
                             kernels::cuda::CompiledArchitectures(), n,
                             n == 0 ? fmt::format(" ({})", why) : "");
#else
    std::cout << "cuda kernels: not compiled\n";
#endif
    g.exit_code = 0;
  });
}

void RegisterConfigCheck(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("config-check", "Validate a fleet file and print what it says");
  auto path = std::make_shared<std::string>();
  cmd->add_option("config", *path, "fleet YAML file")->required();
  cmd->callback([&g, path] {
    auto cfg = LoadFleetConfig(*path);
    if (!cfg.ok()) {
      std::cerr << cfg.status().message() << "\n";
      g.exit_code = 1;
      return;
    }
    std::cout << fmt::format(
        "{}: ok\nmodel: {} ({}), backend {}\nworkers: {} prefill, {} decode, {} both\n"
        "proxy: grpc {} http {} metrics {}\nrouter: {}\n",
        *path, cfg->model.name, cfg->model.path, cfg->model.backend, cfg->prefill.replicas,
        cfg->decode.replicas, cfg->both.replicas, cfg->proxy.grpc, cfg->proxy.http,
        cfg->proxy.metrics, cfg->router.policy);
    g.exit_code = 0;
  });
}

void RegisterWorker(CLI::App& app, GlobalOptions& g, const std::string& role) {
  auto* cmd = app.add_subcommand(role, fmt::format("Run one {} worker alone", role));
  auto config = std::make_shared<std::string>();
  auto join = std::make_shared<std::string>();
  auto grpc = std::make_shared<std::string>();
  auto metrics = std::make_shared<std::string>();
  cmd->add_option("--config", *config, "fleet YAML file (its role section gives defaults)")
      ->required();
  cmd->add_option("--join", *join, "proxy gRPC address to register with");
  cmd->add_option("--grpc", *grpc, "host:port to serve gRPC on");
  cmd->add_option("--metrics", *metrics, "host:port to serve /metrics on");
  auto name = std::make_shared<std::string>();
  auto ready_fd = std::make_shared<int>(-1);
  cmd->add_option("--name", *name, "worker name in logs and metrics (default: ROLE-PORT)");
  cmd->add_option("--ready-fd", *ready_fd, "(tandem launch) write the real addresses here")
      ->group("");
  cmd->callback([&g, role, config, join, grpc, metrics, name, ready_fd] {
    g.exit_code = NotYetAvailable(role, fmt::format("the {} worker service (issue #5)", role));
  });
}

}  // namespace tandem::cli
