// The metrics registry of one process over prometheus-cpp, with an exposer
// serving Prometheus text at http://ADDRESS/metrics. Every metric carries
// the constant labels model, role and worker.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
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

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Bucket helpers: `count` boundaries from `start`, each `factor` times the last.
  static std::vector<double> ExponentialBuckets(double start, double factor, int count);

 private:
  std::map<std::string, std::string> Labels(const std::map<std::string, std::string>& extra) const;

  MetricLabels labels_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string bound_address_;
  std::map<std::string, prometheus::Family<prometheus::Counter>*> counters_;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> gauges_;
  std::map<std::string, prometheus::Family<prometheus::Histogram>*> histograms_;
};

}  // namespace tandem
