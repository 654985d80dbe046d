// `tandem bench kvtransfer`: KV transfer bandwidth and latency between two
// processes.
#include "cli/commands.h"

namespace tandem::cli {

void RegisterBenchKvTransfer(CLI::App& bench, GlobalOptions& g) {
  auto* cmd = bench.add_subcommand("kvtransfer", "KV transfer bandwidth between two processes");
  cmd->allow_extras();
  cmd->callback([&g] {
    g.exit_code = NotYetAvailable("bench kvtransfer", "the KV transport (issue #4)");
  });
}

}  // namespace tandem::cli
