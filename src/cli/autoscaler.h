// `tandem launch` with autoscale.enabled (docs/scheduling.md, "Autoscaling"):
// every autoscale.interval_s the launcher reads
// tandem_planner_desired_workers{role} from every proxy replica's /metrics
// (the same series a Prometheus/HPA reads; no extra RPC) and follows the
// largest value among the replicas it can read (so one replica that sees
// pressure scales the fleet up, it scales down only when every replica
// agrees, and a replica that is down stops nothing):
//   fewer live workers of a role than desired → starts one more (named
//     ROLE-N, N continuing after the fleet file's replicas), waiting for it
//     to be ready as at launch;
//   more than desired → drains the newest one: SIGTERM, the worker's own
//     graceful drain (it leaves routing at once, finishes what it holds
//     within proxy.drain_seconds, then exits), so no request is lost.
// The planner owns the timing (cooldowns, hysteresis); the launcher changes
// at most one worker per role per poll and never goes outside
// autoscale.{prefill,decode}.{min,max}. A worker that died on its own is
// replaced the same way when the planner still wants it.
//
// Thread-safety: single-threaded (the launcher's main thread, as Supervisor).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli/supervisor.h"
#include "common/config.h"
#include "common/status.h"

namespace tandem::cli {

// The value of tandem_planner_desired_workers{role="ROLE"} in Prometheus
// text; nullopt when absent.
std::optional<uint32_t> DesiredWorkers(const std::string& metrics_text, const std::string& role);

// The largest non-zero tandem_planner_desired_workers{role} among the
// replicas' metrics texts (0 or absent: that replica's planner is off or
// has not decided yet); nullopt when none has a number.
std::optional<uint32_t> DesiredAcrossReplicas(const std::vector<std::string>& metrics_texts,
                                              const std::string& role);

// GET http://ADDRESS/metrics with a short timeout (plain HTTP, loopback or
// cluster-internal: the proxy's metrics listener).
Result<std::string> FetchMetrics(const std::string& address);

class Autoscaler {
 public:
  // Starts worker `role`-`index` and waits until it is ready (the launcher's
  // own start, so it gets the same flags, TLS identity and --join).
  using StartWorker = std::function<Status(const std::string& role, uint32_t index)>;

  // `proxy_metrics`: every proxy replica's metrics address (a restarted
  // replica keeps its own). `next_index`: per role, the index of the next
  // worker to start (the fleet file's replicas).
  Autoscaler(const AutoscaleConfig& config, std::vector<std::string> proxy_metrics,
             Supervisor* supervisor, StartWorker start,
             std::map<std::string, uint32_t> next_index);

  // One poll: read the desired counts and start or drain at most one
  // worker per role. Returns true when the set of serving workers changed
  // (the caller rewrites the state file).
  bool Poll();

  // Live, not draining workers of `role`.
  uint32_t Serving(const std::string& role) const;

 private:
  bool Follow(const std::string& role, const AutoscaleRoleConfig& bounds, uint32_t desired);

  const AutoscaleConfig config_;
  const std::vector<std::string> proxy_metrics_;
  Supervisor* const sup_;
  const StartWorker start_;
  std::map<std::string, uint32_t> next_index_;
  bool warned_unreachable_ = false;
};

}  // namespace tandem::cli
