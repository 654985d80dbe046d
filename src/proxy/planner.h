// The online planner (issue 22, "Autoscaling"; rules in docs/scheduling.md,
// "Autoscaling"): every autoscale.interval_s the proxy measures the load of
// each role and computes how many prefillers and decoders the fleet should
// have, bounded by autoscale.{prefill,decode}.{min,max}. It only advises:
// `tandem launch` (src/cli/autoscaler.h) or a Kubernetes HPA/KEDA object
// (deploy/kubernetes/autoscale/) reads the result from /metrics:
//   tandem_planner_desired_workers{role=prefill|decode}  (0 while disabled)
//   tandem_fleet_workers{role=prefill|decode|both}       (registered workers,
//                                                          counted at each scrape)
// Their `role` label is the workers' role, not the proxy's constant one.
//
// Inputs: TTFT and ITL p90 over the last autoscale.window_s (from the
// proxy's own histograms, as Prometheus' histogram_quantile over a rate
// would give), the queued prefill tokens per prefiller and the mean KV usage
// of the decoders (the router's view: last load report + its predictions),
// each averaged over the ticks of the same window (one tick's value swings
// with every arrival; a decision on it flaps).
//
// Thread-safety: PlannerPolicy none (one owner); Planner's methods may be
// called from any thread.
#pragma once

#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/metrics.h"

namespace tandem::proxy {

class Fleet;

// What one evaluation sees.
struct PlannerInputs {
  uint32_t prefillers = 0;  // registered
  uint32_t decoders = 0;
  double ttft_p90_s = -1;  // < 0: no first token in the window
  double itl_p90_s = -1;   // < 0: no gap in the window
  double queued_prefill_tokens = 0;  // summed over the prefillers
  double kv_usage = 0;               // mean over the decoders, 0..1
  // Requests waiting for their first token, averaged over the window: the
  // TTFT seconds that ended in it per second (Little's law). Its part that
  // is prefill compute is the prefillers' busy count, whatever the prompts' sizes.
  double awaiting_first_token = 0;
};

struct PlannerDecision {
  uint32_t prefill = 0;  // desired workers
  uint32_t decode = 0;
  double prefill_pressure = 0;  // load / target with the current workers (1 = at target)
  double decode_pressure = 0;
};

// The rules, without clocks or threads (unit-tested). Per role a latency
// ratio and a load ratio (1 = at target):
//   prefill: TTFT p90 / ttft_target;  the larger of queued tokens per prefiller / its
//            target and requests awaiting a first token per prefiller / its target
//   decode:  ITL p90 / itl_target;    mean KV usage / kv_usage_target
// pressure = the larger of the two.
// Up: pressure > 1 and scale_up_cooldown_s since the role's last change →
//   desired = min(max, ceil(current × pressure), 2 × current) (at least +1).
// Down: the role is settled (current ≥ desired), scale_down_cooldown_s since
//   its last change, the latency ratio < scale_down_below and the load ratio
//   on one worker fewer (× current / (current − 1)) < scale_down_below →
//   desired − 1. The gap between 1 and scale_down_below is the hysteresis.
class PlannerPolicy {
 public:
  // `initial_*`: the desired counts at start-up (the fleet file's replicas),
  // clamped into the bounds.
  PlannerPolicy(const AutoscaleConfig& config, uint32_t initial_prefill, uint32_t initial_decode);

  PlannerDecision Evaluate(const PlannerInputs& in, double now_s);
  uint32_t desired_prefill() const { return prefill_.desired; }
  uint32_t desired_decode() const { return decode_.desired; }

 private:
  struct RoleState {
    uint32_t desired = 1;
    double last_change_s = -1e300;
  };
  void Step(RoleState& s, const AutoscaleRoleConfig& bounds, uint32_t current, double latency,
            double load, double now_s) const;

  const AutoscaleConfig config_;
  RoleState prefill_;
  RoleState decode_;
};

// p `q` (0..1) of the observations between two cumulative snapshots of one
// histogram (`buckets` ascending, the last +Inf), interpolated inside the
// bucket as Prometheus' histogram_quantile does; -1 when no observation.
double WindowQuantile(const std::vector<prometheus::ClientMetric::Bucket>& before,
                      const std::vector<prometheus::ClientMetric::Bucket>& now, double q);

class Planner {
 public:
  // `ttft` and `itl` are the proxy's histograms; the gauges go into
  // `registry` with labels {model, role, worker: proxy}. Call Start to run.
  Planner(const FleetConfig& fleet, Fleet* workers, prometheus::Histogram* ttft,
          prometheus::Histogram* itl, MetricsRegistry& registry);
  ~Planner();

  void Start();  // the evaluation thread (every autoscale.interval_s)
  void Stop();
  // One evaluation now (the thread calls it; tests may too).
  PlannerDecision Tick();

 private:
  struct Snapshot {
    double time_s;
    std::vector<prometheus::ClientMetric::Bucket> ttft, itl;
    double ttft_sum = 0;               // the TTFT histogram's sum of observations
    double queued_prefill_tokens = 0;  // this tick's, summed over the prefillers
    double kv_usage = 0;               // this tick's mean over the decoders
  };
  PlannerInputs Measure(double now_s);
  // Counts the registered workers by role into the tandem_fleet_workers gauges.
  void CountWorkers();

  const AutoscaleConfig config_;
  MetricsRegistry& registry_;
  Fleet* const fleet_;
  prometheus::Histogram* const ttft_;
  prometheus::Histogram* const itl_;
  prometheus::Gauge* desired_prefill_;
  prometheus::Gauge* desired_decode_;
  prometheus::Gauge* fleet_prefill_;
  prometheus::Gauge* fleet_decode_;
  prometheus::Gauge* fleet_both_;

  std::mutex mu_;  // guards everything below
  PlannerPolicy policy_;
  std::deque<Snapshot> snapshots_;  // oldest first, covering window_s
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tandem::proxy
