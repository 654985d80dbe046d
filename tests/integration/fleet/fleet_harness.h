// Test harness: a real fleet started with `tandem launch` (real processes,
// real gRPC, real UCX, loopback only), a public-API client, /metrics
// scraping and `tandem generate` as the reference.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::testing {

struct FleetOptions {
  int prefill = 1;
  int decode = 1;
  int both = 0;
  uint32_t num_blocks = 512;
  uint32_t max_batched_tokens = 128;  // small, so that long prompts are chunked
  uint32_t max_num_seqs = 64;
  uint32_t max_waiting = 256;
  uint32_t max_inflight = 1024;
  std::string policy = "round_robin";
  std::string extra_yaml;  // appended verbatim
  // Lines added inside the `proxy` section, e.g. "  drain_seconds: 5\n".
  std::string proxy_yaml;
  // Lines added inside the `router` section, e.g. "  max_prediction_age_s: 0.05\n".
  std::string router_yaml;
  // Lines added inside the `model` section, e.g. "  backend: sim\n".
  std::string model_yaml;
  // The model folder (empty: the bundled model).
  std::string model_path;
  // Lines added inside the `cache` section, e.g. "  host_tier_blocks: 64\n".
  std::string cache_yaml;
  // Lines added inside the `scheduler` section, e.g. "  schedule_conservativeness: 0\n".
  std::string scheduler_yaml;
  // Lines added inside a role section, e.g. "  tensor_parallel: 2\n" (issue 18).
  std::string prefill_yaml, decode_yaml, both_yaml;
  // The `logging` section's level and format (every process logs to log_path()).
  // TANDEM_TEST_LOG_LEVEL in the environment replaces the default level.
  std::string log_level = "warn";
  std::string log_format = "text";
};

struct WorkerAddr {
  std::string role, name, grpc, metrics;
  pid_t pid = -1;
  // The state file's `ranks` (issue 18): {rank, pid} of every rank process
  // of the worker, rank 0 (== pid) first; empty for a worker started by hand.
  std::vector<std::pair<uint32_t, pid_t>> ranks;
};

// One proxy replica of the state file's `proxies` (proxy.replicas).
struct ProxyAddr {
  std::string name, grpc, http, metrics, internal;
  pid_t pid = -1;
};

class Fleet {
 public:
  // Writes a fleet file into a fresh temp dir and runs `tandem launch` on it;
  // waits (bounded) for the state file. Every process of the fleet is
  // registered with the test's reaper (reaper.h): if the test process dies,
  // the fleet is killed.
  static Result<std::unique_ptr<Fleet>> Launch(const FleetOptions& options);
  ~Fleet();  // SIGTERM to the launcher, SIGKILL after a grace period

  const std::string& proxy_grpc() const { return proxy_grpc_; }
  // The proxy's internal listener (Registry; mutual TLS by default).
  const std::string& proxy_internal() const { return proxy_internal_; }
  // The state file's `tls`: the fleet CA and an operator client identity
  // (all empty with security.internal_tls: off).
  const std::string& tls_ca() const { return tls_ca_; }
  const std::string& tls_cert() const { return tls_cert_; }
  const std::string& tls_key() const { return tls_key_; }
  // The flags that make a worker started by hand join this fleet:
  // --join <proxy.internal> and the TLS identity: the launcher's certificate
  // for `name` when it issued one (a restart under the same name), else the
  // state file's operator identity.
  std::vector<std::string> JoinArgs(const std::string& name = "") const;
  const std::string& proxy_metrics() const { return proxy_metrics_; }
  // The OpenAI-compatible HTTP API ("host:port"; docs/http-api.md).
  const std::string& proxy_http() const { return proxy_http_; }
  const std::vector<WorkerAddr>& workers() const { return workers_; }
  const std::string& config_path() const { return config_path_; }
  // The state file `tandem launch` wrote (and rewrites when it restarts a proxy).
  std::string state_path() const { return dir_ + "/state.json"; }
  // Every proxy replica as the state file listed them at launch (index order).
  const std::vector<ProxyAddr>& proxies() const { return proxies_; }
  // The random fleet salt `tandem launch` made (state file `cache_salt`):
  // a worker joining by hand needs it in TANDEM_CACHE_SALT.
  const std::string& cache_salt() const { return cache_salt_; }
  // stdout and stderr of the launcher and every process of the fleet.
  std::string log_path() const { return dir_ + "/launch.log"; }
  pid_t launcher_pid() const { return pid_; }
  pid_t proxy_pid() const { return proxy_pid_; }
  // Sends SIGTERM to the launcher and waits (bounded) for it; returns its exit status.
  Result<int> Stop(std::chrono::seconds grace);

 private:
  void ForgetAll();

  pid_t pid_ = -1;
  pid_t proxy_pid_ = -1;
  std::string dir_, config_path_, proxy_grpc_, proxy_metrics_;
  std::string proxy_http_, proxy_internal_;
  std::string tls_ca_, tls_cert_, tls_key_;
  std::string cache_salt_;
  std::vector<WorkerAddr> workers_;
  std::vector<ProxyAddr> proxies_;
};

// The state file's `proxies` (empty when it cannot be read).
std::vector<ProxyAddr> ReadProxies(const std::string& state_path);

// The bundled model's folder.
std::string BundledModel();
// Whether the bundled model's weights are there (fleet tests skip without them).
bool HaveBundledModel();

struct Completion {
  std::vector<uint32_t> token_ids;
  std::string text;
  int finish_reason = 0;  // tandem.v1.FinishReason
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_prompt_tokens = 0;
  int messages = 0;
  std::string request_id;  // as the responses echo it
};

struct GenerateArgs {
  std::string prompt;
  std::vector<uint32_t> prompt_ids;
  std::optional<uint32_t> max_tokens;
  std::optional<float> temperature = 0.0f;
  std::optional<float> top_p;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = true;
  std::string model;
  std::string request_id;  // empty: the proxy assigns one
  std::string api_key;     // sent as `authorization: Bearer KEY` when not empty
  std::chrono::milliseconds timeout{60000};
};

// One Generate call on the public API; non-OK status as the error.
Result<Completion> Generate(const std::string& proxy, const GenerateArgs& args);

// `tandem generate --json` in a subprocess (the single-process reference).
Result<std::vector<uint32_t>> ReferenceGenerate(const std::vector<uint32_t>& prompt_ids,
                                                uint32_t max_tokens);
// The same with seeded sampling (`--temperature T --seed S`).
Result<std::vector<uint32_t>> ReferenceGenerate(const std::vector<uint32_t>& prompt_ids,
                                                uint32_t max_tokens, float temperature,
                                                uint64_t seed);
// Greedy, on the model in `model_dir`.
Result<std::vector<uint32_t>> ReferenceGenerateWith(const std::string& model_dir,
                                                    const std::vector<uint32_t>& prompt_ids,
                                                    uint32_t max_tokens);

// GET http://ADDRESS/metrics.
Result<std::string> Scrape(const std::string& address);
// Sum of the samples of `metric` (exact name, any labels) in Prometheus text.
double MetricValue(const std::string& text, const std::string& metric);
// Scrape + MetricValue; -1 when ADDRESS does not answer.
double Metric(const std::string& address, const std::string& metric);
// Sum of `metric`'s samples whose labels contain `label` (e.g.
// reason="target_lost"); -1 when ADDRESS does not answer.
double LabeledMetric(const std::string& address, const std::string& metric,
                     const std::string& label);
// The fleet's worker called `name` (e.g. "prefill-0"), or null.
const WorkerAddr* FindWorker(const Fleet& fleet, const std::string& name);

// Deterministic prompt token ids: `n` ids from a seeded stream, all below
// `vocab`; prompts with the same `prefix_seed` share their first
// `shared` tokens.
std::vector<uint32_t> PromptIds(uint32_t seed, uint32_t n, uint32_t vocab,
                                uint32_t prefix_seed = 0, uint32_t shared = 0);

// Polls `pred` every 20 ms until it holds or `limit` passed; returns
// whether it held (the bound keeps a broken fleet from hanging a test).
bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds limit);

// The whole file ("" when it cannot be read).
std::string ReadText(const std::string& path);

// Waits (bounded) until the file at `path` contains `needle` at or after
// byte `from`; returns the offset just past the match, or nullopt.
std::optional<size_t> WaitForLogLine(const std::string& path, const std::string& needle,
                                     std::chrono::milliseconds limit, size_t from = 0);

// `tandem ROLE --config <the fleet's file> --join <its proxy> --name NAME`
// (a worker restarted into a running fleet, e.g. after a kill -9), with
// `env` ("KEY=VALUE") added to its environment and stdout+stderr appended
// to `log`. Waits (bounded) for its ready line, which it writes once the
// proxy registered it; registered with the reaper. Stop it with
// StopProcess (Fleet's destructor does not know it). `join`, when not
// empty, replaces `--join <proxy>` (e.g. {"--join-dns", "localhost:PORT"});
// `config`, when not empty, replaces the fleet's file (e.g. a copy with
// other scheduler settings).
Result<WorkerAddr> JoinWorker(const Fleet& fleet, const std::string& role, const std::string& name,
                              const std::string& log, const std::vector<std::string>& env = {},
                              std::chrono::seconds limit = std::chrono::seconds(60),
                              const std::vector<std::string>& join = {},
                              const std::string& config = "");
// The gauges that read 0 on an idle worker: running and waiting sequences,
// reservations, parked and queued prefills, KV blocks used, quarantined
// blocks (a build without a gauge reads 0 for it).
const std::vector<std::string>& HeldGauges();
// Waits (bounded) until no worker in `workers` holds anything of
// HeldGauges() and, when `proxy_metrics` is not empty, the proxy has no
// request in flight. Returns what is still held ("" when idle).
std::string WaitFleetIdle(const std::vector<WorkerAddr>& workers, const std::string& proxy_metrics,
                          std::chrono::milliseconds limit);

// SIGTERM (SIGCONT first, in case it is stopped), a bounded wait for the
// exit, SIGKILL after it; then forgets it in the reaper. Returns the wait
// status (or -1 when it was not our child or already gone).
int StopProcess(pid_t pid, std::chrono::seconds grace);

}  // namespace tandem::testing
