// `tandem rank` (hidden): one follower rank of a tensor × pipeline parallel
// group (issue 18, docs/parallelism.md). Started by rank 0's process
// (`tandem generate --tensor-parallel N --pipeline-parallel M`), never by
// hand:
//
//   tandem rank --model DIR --tensor-parallel N --pipeline-parallel M
//               --rank R --group NAME --num-blocks B [--block-size S]
//               [--threads T] [--join-timeout-ms MS]
//
// Exit status: 0 after rank 0's shutdown plan, 2 for bad arguments, 1 for
// anything else (rank 0 gone: UNAVAILABLE naming the rank).
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "common/logging.h"
#include "parallel/follower.h"

namespace tandem::cli {

void RegisterRank(CLI::App& app, GlobalOptions& g) {
  // An empty group hides it from --help: users never start a rank by hand.
  auto* cmd = app.add_subcommand("rank", "A follower rank of a parallel group (internal)");
  cmd->group("");
  auto o = std::make_shared<parallel::FollowerOptions>();
  cmd->add_option("--model", o->model_dir, "Hugging Face model directory")->required();
  cmd->add_option("--tensor-parallel", o->layout.tp, "the group's tensor-parallel degree");
  cmd->add_option("--pipeline-parallel", o->layout.pp, "the group's pipeline-parallel degree");
  cmd->add_option("--rank", o->rank, "this rank (1 .. tp*pp-1)")->required();
  cmd->add_option("--group", o->group, "the group name rank 0 uses")->required();
  cmd->add_option("--num-blocks", o->num_blocks, "rank 0's KV pool size in blocks")->required();
  cmd->add_option("--block-size", o->block_size, "tokens per KV block (rank 0's)");
  cmd->add_option("--threads", o->threads, "compute threads");
  cmd->add_option("--join-timeout-ms", o->join_timeout_ms, "waiting for every rank to join");
  cmd->callback([&g, o] {
    const std::string level = g.log_level.empty() ? "warn" : g.log_level;
    if (Status s = SetupLogging(fmt::format("rank-{}", o->rank), level,
                                g.log_format.empty() ? "text" : g.log_format);
        !s.ok()) {
      std::cerr << "tandem rank: " << s.message() << "\n";
      g.exit_code = 2;
      return;
    }
    Status st = parallel::RunFollowerRank(*o);
    if (!st.ok()) {
      std::cerr << "tandem rank " << o->rank << ": " << st.message() << "\n";
      g.exit_code = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    g.exit_code = 0;
  });
}

}  // namespace tandem::cli
