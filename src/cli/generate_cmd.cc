// `tandem generate`: one process, no network (DESIGN.md section 7).
#include "cli/commands.h"

namespace tandem::cli {

void RegisterGenerate(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("generate", "Generate in one process, no network");
  cmd->allow_extras();
  cmd->callback([&g] { g.exit_code = NotYetAvailable("generate", "the CPU engine (issue #3)"); });
}

}  // namespace tandem::cli
