// `tandem bench`: a parent for the benchmark subcommands.
#include "cli/commands.h"

namespace tandem::cli {

void RegisterBench(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("bench", "Benchmarks: kvtransfer, serve, proxy, engine");
  cmd->require_subcommand(1);
  RegisterBenchKvTransfer(*cmd, g);
  RegisterBenchServe(*cmd, g);
  RegisterBenchProxy(*cmd, g);
  RegisterBenchEngine(*cmd, g);
}

}  // namespace tandem::cli
