// The metrics registry of one process over prometheus-cpp, with an exposer
// serving Prometheus text at http://ADDRESS/metrics. Every metric carries
// the constant labels model, role and worker.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem {

struct MetricLabels {
  std::string model;
  std::string role;    // proxy | prefill | decode | both
  std::string worker;  // e.g. prefill-0
};

class MetricsRegistry {
 public:
  explicit MetricsRegistry(MetricLabels labels);
  ~MetricsRegistry();

  // Starts serving /metrics on `address` ("host:port", port 0 picks one).
  Status Serve(const std::string& address);
  // The address actually bound ("host:port"), after Serve.
  const std::string& bound_address() const { return bound_address_; }

  // Families are created on first use; `extra` labels are added to the
  // constant ones. The returned reference lives as long as the registry.
  prometheus::Counter& Counter(const std::string& name, const std::string& help,
                               const std::map<std::string, std::string>& extra = {});
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help,
                           const std::map<std::string, std::string>& extra = {});
  prometheus::Histogram& Histogram(const std::string& name, const std::string& help,
                                   const std::vector<double>& buckets,
                                   const std::map<std::string, std::string>& extra = {});

  // Prometheus text format of everything registered (for tests and /metrics
  // on the HTTP API).
  std::string Render() const;

  // Called before every scrape (Render and /metrics), on the scraping
  // thread: values sampled from elsewhere (engine and worker counts) are
  // brought up to date there, so a scrape includes everything that
  // happened before it, watched by a proxy or not. Must be thread-safe.
  // OnScrape({}) returns once no refresh runs any more.
  void OnScrape(std::function<void()> refresh);

  // Collect hooks: each runs before every collection (Render, /metrics,
  // RunCollectHooks), on the collecting thread, until removed; they fold
  // values held elsewhere into their metrics (the proxy's token path keeps
  // its samples in atomics between scrapes: ProxyMetrics). Thread-safe;
  // RemoveCollectHook returns once the hook no longer runs.
  size_t AddCollectHook(std::function<void()> hook);
  void RemoveCollectHook(size_t id);
  // Runs them now: for readers of a metric's Collect() (the planner).
  void RunCollectHooks() const;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Bucket helpers: `count` boundaries from `start`, each `factor` times the last.
  static std::vector<double> ExponentialBuckets(double start, double factor, int count);
  // The boundaries of every inter-token histogram: the proxy's ITL and
  // TPOT, the decoder's emitted ITL. 20 us to 5 s, in steps of 0.5 ms from
  // 1 to 8 ms and of 1-2.5 ms to 20 ms, where decode steps lie: one layout,
  // so that the decoder's and the proxy's quantiles can be set against
  // each other (and the client's) to well under a step.
  static std::vector<double> InterTokenBuckets();

 private:
  std::map<std::string, std::string> Labels(const std::map<std::string, std::string>& extra) const;

  class Refreshing;  // the collectable the exposer serves: refresh, then collect

  MetricLabels labels_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Refreshing> refreshing_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string bound_address_;
  std::map<std::string, prometheus::Family<prometheus::Counter>*> counters_;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> gauges_;
  std::map<std::string, prometheus::Family<prometheus::Histogram>*> histograms_;
};

// A histogram observed on a hot path (one sample per generated token, on
// the engine's thread): Observe counts the sample in the atomic of its
// bucket (relaxed; no lock, no allocation) and every collection of the
// registry (Render, /metrics, RunCollectHooks: a collect hook) first folds
// what was counted into the prometheus histogram with one ObserveMultiple,
// so a scrape shows every sample observed before it began. Buckets as
// prometheus-cpp counts them: a sample goes to the first boundary >= it,
// past the last to +Inf. Thread-safe; the registry must outlive it (its
// destructor folds what is left).
class HeldHistogram {
 public:
  HeldHistogram(MetricsRegistry& registry, const std::string& name, const std::string& help,
                std::vector<double> buckets);
  ~HeldHistogram();
  HeldHistogram(const HeldHistogram&) = delete;
  HeldHistogram& operator=(const HeldHistogram&) = delete;

  void Observe(double value) {
    Add(BucketOf(value), 1);
    AddSum(value);
  }
  // For a caller that sums a batch of samples itself (the proxy's token
  // path): `n` samples in bucket `i` (BucketOf), and their values' sum.
  size_t BucketOf(double value) const {
    return static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                               bounds_.begin());
  }
  size_t num_buckets() const { return bounds_.size() + 1; }  // the last is +Inf
  void Add(size_t bucket, uint64_t n) { counts_[bucket].fetch_add(n, std::memory_order_relaxed); }
  void AddSum(double sum) { sum_.fetch_add(sum, std::memory_order_relaxed); }
  // Moves what was observed since the last fold into the histogram (the
  // collect hook does this before every collection).
  void Fold();

 private:
  MetricsRegistry& registry_;
  const std::vector<double> bounds_;
  prometheus::Histogram& histogram_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // [bounds_.size() + 1], the last +Inf
  std::atomic<double> sum_{0};
  size_t hook_ = 0;
};

// The median of the last `window` observations, checked against a threshold
// with a rate limit: Observe answers "warn now" at most once per
// `min_interval`, and only while at least `min_samples` observations are in
// the window and their median is above `threshold`. The proxy uses it for the
// KV transfer overhead ratio (docs/metrics.md). Thread-safe.
class RecentMedianCheck {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    size_t window = 64;
    size_t min_samples = 8;
    double threshold = 0.3;
    Clock::duration min_interval = std::chrono::seconds(60);
  };

  explicit RecentMedianCheck(Options options);

  // Records `value`; returns the window's median when a warning is due.
  std::optional<double> Observe(double value, Clock::time_point now = Clock::now());
  // The median of the window (0 when empty).
  double Median() const;
  size_t size() const;

 private:
  double MedianLocked() const;

  const Options options_;
  mutable std::mutex mu_;
  std::vector<double> ring_;             // guarded by mu_: [min(observed, window)]
  size_t next_ = 0;                      // guarded by mu_: slot of the next observation
  std::optional<Clock::time_point> last_warning_;  // guarded by mu_
};

}  // namespace tandem
