#include "cli/commands.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "common/config.h"
#include "common/version.h"
#ifdef TANDEM_HAVE_CUDA
#include <ucp/api/ucp.h>

#include "kernels/cuda/device.h"
#endif

namespace tandem::cli {

namespace fs = std::filesystem;

#ifdef TANDEM_HAVE_CUDA
// How KV in device memory (the cuda backend) would move between workers:
// registered with UCX directly when this UCX build supports CUDA memory
// (cuda_copy / cuda_ipc / GPUDirect RDMA), otherwise staged through pinned
// host buffers (docs/cuda.md).
std::string DeviceKvTransferPath() {
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return "unknown (ucp_config_read failed)";
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) return fmt::format("unknown (ucp_init: {})", ucs_status_string(st));
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                    (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_cleanup(context);
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return cuda ? fmt::format("UCX {}.{}.{} with CUDA memory support (device KV registered directly)",
                            major, minor, release)
              : fmt::format("staging through pinned host memory (UCX {}.{}.{} has no CUDA memory "
                            "support)",
                            major, minor, release);
}
#endif

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
    std::cout << fmt::format("cuda kv transfer path: {}\n", DeviceKvTransferPath());
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
