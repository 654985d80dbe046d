#include "cli/commands.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "common/config.h"
#include "common/version.h"
#include "kvtransfer/staging/device_path.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/device.h"
#endif

namespace tandem::cli {

namespace fs = std::filesystem;


void AddTlsOptions(CLI::App& cmd, std::string& ca, std::string& cert, std::string& key) {
  auto* a = cmd.add_option("--tls-ca", ca, "internal plane: the fleet CA certificate (PEM)");
  auto* c = cmd.add_option("--tls-cert", cert, "internal plane: this process's certificate (PEM)");
  auto* k = cmd.add_option("--tls-key", key, "internal plane: its private key (PEM)");
  a->needs(c)->needs(k);
  c->needs(a)->needs(k);
  k->needs(a)->needs(c);
  for (auto* o : {a, c, k}) o->group("Internal TLS (default: security.internal_tls)");
}

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
    // What transport.device_path auto picks on this machine (ucx backend).
    const auto path = kvtransfer::ChooseDeviceTransferPath("auto", "ucx",
                                                           kvtransfer::DetectUcxCudaSupport());
    std::cout << fmt::format("cuda kv transfer path: {}\n",
                             path.ok() ? path->detail : path.status().message());
#else
    std::cout << "cuda kernels: not compiled\n";
#endif
    // The sim backend is always built; its fleets say `simulated` everywhere (docs/sim.md).
    std::cout << "sim backend: built (simulated GPUs, roofline timing: H100, H200, A100, L40S)\n";
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
        "{}: ok\nmodel: {} ({}), backend {}, batch_invariant {}\nworkers: {} prefill, {} decode, {} both\n"
        "proxy: grpc {} http {} metrics {}\nrouter: {}\n",
        *path, cfg->model.name, cfg->model.path, cfg->model.backend, cfg->model.batch_invariant,
        cfg->prefill.replicas,
        cfg->decode.replicas, cfg->both.replicas, cfg->proxy.grpc, cfg->proxy.http,
        cfg->proxy.metrics, cfg->router.policy);
    g.exit_code = 0;
  });
}

}  // namespace tandem::cli
