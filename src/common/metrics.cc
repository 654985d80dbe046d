#include "common/metrics.h"

#include <fmt/format.h>
#include <prometheus/text_serializer.h>

#include <sstream>

#include "common/net.h"

namespace tandem {

MetricsRegistry::MetricsRegistry(MetricLabels labels)
    : labels_(std::move(labels)), registry_(std::make_shared<prometheus::Registry>()) {}

MetricsRegistry::~MetricsRegistry() = default;

Status MetricsRegistry::Serve(const std::string& address) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  try {
    // civetweb: "host:port"; port 0 makes the kernel pick a free one.
    exposer_ = std::make_unique<prometheus::Exposer>(hp.ToString(), /*num_threads=*/1);
  } catch (const std::exception& e) {
    return UnavailableError(fmt::format("metrics exposer cannot listen on {}: {}", address, e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  const auto ports = exposer_->GetListeningPorts();
  hp.port = ports.empty() ? hp.port : static_cast<uint16_t>(ports.front());
  bound_address_ = hp.ToString();
  return Status::Ok();
}

std::map<std::string, std::string> MetricsRegistry::Labels(
    const std::map<std::string, std::string>& extra) const {
  std::map<std::string, std::string> out = extra;
  out["model"] = labels_.model;
  out["role"] = labels_.role;
  out["worker"] = labels_.worker;
  return out;
}

prometheus::Counter& MetricsRegistry::Counter(const std::string& name, const std::string& help,
                                              const std::map<std::string, std::string>& extra) {
  auto& fam = counters_[name];
  if (!fam) fam = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  return fam->Add(Labels(extra));
}

prometheus::Gauge& MetricsRegistry::Gauge(const std::string& name, const std::string& help,
                                          const std::map<std::string, std::string>& extra) {
  auto& fam = gauges_[name];
  if (!fam) fam = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  return fam->Add(Labels(extra));
}

prometheus::Histogram& MetricsRegistry::Histogram(const std::string& name,
                                                  const std::string& help,
                                                  const std::vector<double>& buckets,
                                                  const std::map<std::string, std::string>& extra) {
  auto& fam = histograms_[name];
  if (!fam) fam = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
  return fam->Add(Labels(extra), prometheus::Histogram::BucketBoundaries(buckets));
}

std::string MetricsRegistry::Render() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

std::vector<double> MetricsRegistry::ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  b.reserve(count);
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

}  // namespace tandem
