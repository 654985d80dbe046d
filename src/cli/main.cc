// The `tandem` binary: launch, proxy, prefill, decode, both, generate,
// bench, version, config-check. See docs/cli.md.
#include <CLI/CLI.hpp>
#include <absl/synchronization/mutex.h>

#include "cli/commands.h"

int main(int argc, char** argv) {
  // Debian's abseil is built without NDEBUG, so every absl::Mutex lock (all
  // of gRPC's) runs the debug-mode deadlock detector: a global lock and a
  // lock-order graph update per acquisition, a few per cent of the proxy's
  // and workers' CPU per token (issue 23; bench/results/proxy_cost.md).
  // tandem's own locks are std::mutex; TSan runs find lock-order bugs.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"tandem: disaggregated prefill/decode LLM serving"};
  app.require_subcommand(1);
  tandem::cli::GlobalOptions g;
  app.add_option("--log-level", g.log_level, "trace|debug|info|warn|error (default: config's)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  app.add_option("--log-format", g.log_format, "text|json (default: config's)")
      ->check(CLI::IsMember({"text", "json"}));

  tandem::cli::RegisterLaunch(app, g);
  tandem::cli::RegisterProxy(app, g);
  tandem::cli::RegisterWorker(app, g, "prefill");
  tandem::cli::RegisterWorker(app, g, "decode");
  tandem::cli::RegisterWorker(app, g, "both");
  tandem::cli::RegisterGenerate(app, g);
  tandem::cli::RegisterRank(app, g);
  tandem::cli::RegisterBench(app, g);
  tandem::cli::RegisterClient(app, g);
  tandem::cli::RegisterCerts(app, g);
  tandem::cli::RegisterHealth(app, g);
  tandem::cli::RegisterPlan(app, g);
  tandem::cli::RegisterVersion(app, g);
  tandem::cli::RegisterConfigCheck(app, g);

  CLI11_PARSE(app, argc, argv);
  return g.exit_code;
}
