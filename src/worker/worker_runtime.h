// `tandem prefill|decode|both`: one worker process (DESIGN.md sections 2
// and 7). Loads the model from the fleet file, creates the KV transport
// (which allocates the KV pool) before anything else touches UCX, the
// engine on that pool, the metrics, and serves on one gRPC server:
//   every role:       tandem.v1.Worker (GetInfo, Watch), health, reflection
//   decode and both:  tandem.v1.Decoder (Decode, Reserve)
//   prefill and both: tandem.v1.Prefiller (Prefill)
// With --join A,B,... (and/or --join-dns HOST:PORT) it registers with every
// proxy's internal listener (a refusal: message, exit 1) and keeps
// registering (ProxyRegistrar: a restarted proxy gets it back, DNS answers
// are followed). Every internal call (its server, Reserve to decoders,
// Register) uses the internal plane's credentials: mutual TLS unless
// security.internal_tls is off (docs/security.md).
// Once serving (and registered) it writes one JSON line
// {"grpc":"host:port","metrics":"host:port"} to --ready-fd and closes it.
// SIGTERM/SIGINT: health NOT_SERVING, new work UNAVAILABLE, in-flight work
// gets `drain_seconds` to finish, then exit 0.
//
// Threads: RunWorker runs on the process's main thread and blocks
// SIGINT/SIGTERM in it (and so in every thread it starts) first.
#pragma once

#include <string>

namespace tandem::worker {

struct WorkerCommand {
  std::string role;         // prefill | decode | both
  std::string config_path;  // fleet YAML
  // The proxies' internal listeners, "A,B,..."; empty (and no join_dns):
  // do not register. docs/serving-workers.md, "Proxy replicas".
  std::string join;
  std::string join_dns;     // HOST:PORT: register with every A record of HOST
  uint32_t discovery_interval_ms = 10000;  // how often join_dns is re-resolved
  std::string grpc;         // empty: the role section's
  std::string metrics;      // empty: the role section's
  std::string name;         // empty: ROLE-PORT (or ROLE-PID with port 0)
  std::string node;         // router label; empty: the role section's `node`
  std::string zone;         // router label; empty: the role section's `zone`
  // --advertise HOST[:PORT]: the address registered with the proxy (and
  // returned by GetInfo) instead of the bound one, for a worker behind NAT
  // or in a pod listening on 0.0.0.0 (docs/kubernetes.md). HOST replaces
  // the host of both the gRPC and the metrics address; PORT, when given,
  // the gRPC port. Empty: the bound addresses (a wildcard host stays as is).
  std::string advertise;
  int ready_fd = -1;
  std::string log_level;    // empty: the config's
  std::string log_format;   // empty: the config's
  double drain_seconds = 5.0;
  // --tls-ca/--tls-cert/--tls-key: the internal plane's identity (tandem
  // launch passes them); empty: the config's security.internal_tls.
  std::string tls_ca, tls_cert, tls_key;
  // Model parallelism (issue 18, docs/parallelism.md "Rank processes"):
  // --tensor-parallel/--pipeline-parallel replace the role section's
  // (0: the section's). A worker of more than one rank is one process per
  // rank, all started with the same --group NAME (a name unique on the
  // host; `tandem launch` makes one): --rank 0 serves (gRPC, metrics,
  // registration), --rank R > 0 is a follower that listens on nothing and
  // follows rank 0's step plan.
  uint32_t tensor_parallel = 0;
  uint32_t pipeline_parallel = 0;
  uint32_t rank = 0;
  std::string group;
};

// Returns the process exit code.
int RunWorker(const WorkerCommand& command);

}  // namespace tandem::worker
