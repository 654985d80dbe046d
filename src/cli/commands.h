// Subcommands of the `tandem` binary. Each Register* adds one subcommand to
// the CLI11 app and sets its callback; the callback stores an exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace tandem::cli {

struct GlobalOptions {
  std::string log_level;   // empty: the config's, else "info"
  std::string log_format;  // empty: the config's, else "text"
  int exit_code = 0;
};

void RegisterVersion(CLI::App& app, GlobalOptions& g);
void RegisterConfigCheck(CLI::App& app, GlobalOptions& g);
void RegisterLaunch(CLI::App& app, GlobalOptions& g);
void RegisterProxy(CLI::App& app, GlobalOptions& g);
void RegisterWorker(CLI::App& app, GlobalOptions& g, const std::string& role);
void RegisterGenerate(CLI::App& app, GlobalOptions& g);
// `tandem rank` (rank_cmd.cc, hidden): a follower rank of a TP x PP group.
void RegisterRank(CLI::App& app, GlobalOptions& g);
void RegisterBench(CLI::App& app, GlobalOptions& g);
void RegisterClient(CLI::App& app, GlobalOptions& g);
// `tandem certs` (certs_cmd.cc): a certificate of a tandem CA.
void RegisterCerts(CLI::App& app, GlobalOptions& g);
// `tandem health` (health_cmd.cc): one gRPC health check, for pod probes.
void RegisterHealth(CLI::App& app, GlobalOptions& g);
// `tandem plan` (plan_cmd.cc): aggregated vs disaggregated from the sim timing model.
void RegisterPlan(CLI::App& app, GlobalOptions& g);
// `tandem bench kvtransfer` (bench_kvtransfer.cc) and `tandem bench serve`
// (bench_serve.cc) register under `bench`.
void RegisterBenchKvTransfer(CLI::App& bench, GlobalOptions& g);
void RegisterBenchServe(CLI::App& bench, GlobalOptions& g);
void RegisterBenchProxy(CLI::App& bench, GlobalOptions& g);
// `tandem bench engine` (bench_engine.cc): cpu engine tokens/s + bandwidth.
void RegisterBenchEngine(CLI::App& bench, GlobalOptions& g);

// --tls-ca/--tls-cert/--tls-key: a process's internal-plane identity
// (docs/security.md); all three or none.
void AddTlsOptions(CLI::App& cmd, std::string& ca, std::string& cert, std::string& key);

// The config used when none is given: configs/1p1d.yaml next to the build
// folder that holds this binary, or under the working directory.
std::string DefaultConfigPath();

// Prints "tandem <cmd>: not available yet: <what is missing>" and returns 2.
int NotYetAvailable(const std::string& command, const std::string& missing);

}  // namespace tandem::cli
