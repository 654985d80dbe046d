// `tandem bench serve`: load generator over the public API.
#include "cli/commands.h"

namespace tandem::cli {

void RegisterBenchServe(CLI::App& bench, GlobalOptions& g) {
  auto* cmd = bench.add_subcommand("serve", "Load generator against a running fleet");
  cmd->allow_extras();
  cmd->callback([&g] {
    g.exit_code = NotYetAvailable("bench serve", "the load generator (issue #8)");
  });
}

}  // namespace tandem::cli
