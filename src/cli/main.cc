// The `tandem` binary: launch, proxy, prefill, decode, both, generate,
// bench, version, config-check. See docs/cli.md.
#include <CLI/CLI.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
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
