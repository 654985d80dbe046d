// `tandem prefill|decode|both` (DESIGN.md section 7): one worker process.
// The runtime lives in src/worker; this file only parses flags.
#include <fmt/format.h>

#include "cli/commands.h"
#include "worker/worker_runtime.h"

namespace tandem::cli {

void RegisterWorker(CLI::App& app, GlobalOptions& g, const std::string& role) {
  auto* cmd = app.add_subcommand(role, fmt::format("Run one {} worker alone", role));
  auto opts = std::make_shared<worker::WorkerCommand>();
  opts->role = role;
  cmd->add_option("--config", opts->config_path, "fleet YAML file (its role section gives defaults)")
      ->required();
  cmd->add_option("--join", opts->join,
                  "the proxies' internal listeners (proxy.internal) to register with: A,B,...");
  cmd->add_option("--join-dns", opts->join_dns,
                  "HOST:PORT: register with every proxy HOST resolves to (A records, else AAAA; e.g. a "
                  "headless Service) at PORT, re-resolved every --discovery-interval-ms");
  cmd->add_option("--discovery-interval-ms", opts->discovery_interval_ms,
                  "how often --join-dns is resolved again (default 10000)")
      ->check(CLI::Range(100u, 3600000u));
  cmd->add_option("--grpc", opts->grpc, "host:port to serve gRPC on");
  cmd->add_option("--metrics", opts->metrics, "host:port to serve /metrics on");
  cmd->add_option("--name", opts->name, "worker name in logs and metrics (default: ROLE-PORT)");
  cmd->add_option("--node", opts->node,
                  "router label: the host this worker runs on (default: the role section's node)");
  cmd->add_option("--zone", opts->zone, "router label: its zone (default: the role section's zone)");
  cmd->add_option("--advertise", opts->advertise,
                  "HOST[:PORT] to register with the proxy instead of the bound address (e.g. "
                  "the pod IP when --grpc is 0.0.0.0:PORT; default: the bound address)");
  cmd->add_option("--drain-seconds", opts->drain_seconds,
                  "on SIGTERM/SIGINT, how long in-flight requests may take to finish")
      ->check(CLI::Range(0.0, 3600.0));
  AddTlsOptions(*cmd, opts->tls_ca, opts->tls_cert, opts->tls_key);
  // Issue 18 (docs/parallelism.md, "Rank processes").
  cmd->add_option("--tensor-parallel", opts->tensor_parallel,
                  "ranks per pipeline stage (default: the role section's tensor_parallel)")
      ->check(CLI::Range(1u, 64u));
  cmd->add_option("--pipeline-parallel", opts->pipeline_parallel,
                  "pipeline stages (default: the role section's pipeline_parallel)")
      ->check(CLI::Range(1u, 64u));
  cmd->add_option("--rank", opts->rank,
                  "this process's rank in its worker group: 0 serves, R > 0 follows rank 0 "
                  "(default 0)")
      ->check(CLI::Range(0u, 4095u));
  cmd->add_option("--group", opts->group,
                  "the worker group's name, the same on every rank and unique on the host "
                  "(required with more than one rank; tandem launch sets it)");
  cmd->add_option("--ready-fd", opts->ready_fd, "(tandem launch) write the real addresses here")
      ->group("");
  cmd->callback([&g, opts] {
    worker::WorkerCommand c = *opts;
    c.log_level = g.log_level;
    c.log_format = g.log_format;
    g.exit_code = worker::RunWorker(c);
  });
}

}  // namespace tandem::cli
