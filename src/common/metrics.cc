#include "common/metrics.h"

#include <fmt/format.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <sstream>

#include "common/net.h"

namespace tandem {

class MetricsRegistry::Refreshing final : public prometheus::Collectable {
 public:
  explicit Refreshing(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      // Held while it runs: once Set({}) returns, no refresh is running
      // (the owner may then tear down what it reads).
      std::lock_guard lock(mu_);
      RunHooksLocked();
      if (refresh_) refresh_();
    }
    return registry_->Collect();
  }
  void Set(std::function<void()> refresh) {
    std::lock_guard lock(mu_);
    refresh_ = std::move(refresh);
  }
  size_t AddHook(std::function<void()> hook) {
    std::lock_guard lock(mu_);
    hooks_.emplace(++last_hook_, std::move(hook));
    return last_hook_;
  }
  void RemoveHook(size_t id) {
    std::lock_guard lock(mu_);
    hooks_.erase(id);
  }
  void RunHooks() const {
    std::lock_guard lock(mu_);
    RunHooksLocked();
  }

 private:
  void RunHooksLocked() const {
    for (const auto& [id, hook] : hooks_) hook();
  }

  const std::shared_ptr<prometheus::Registry> registry_;
  mutable std::mutex mu_;
  std::function<void()> refresh_;                   // guarded by mu_
  std::map<size_t, std::function<void()>> hooks_;  // guarded by mu_
  size_t last_hook_ = 0;                            // guarded by mu_
};

MetricsRegistry::MetricsRegistry(MetricLabels labels)
    : labels_(std::move(labels)),
      registry_(std::make_shared<prometheus::Registry>()),
      refreshing_(std::make_shared<Refreshing>(registry_)) {}

void MetricsRegistry::OnScrape(std::function<void()> refresh) { refreshing_->Set(std::move(refresh)); }

size_t MetricsRegistry::AddCollectHook(std::function<void()> hook) {
  return refreshing_->AddHook(std::move(hook));
}

void MetricsRegistry::RemoveCollectHook(size_t id) { refreshing_->RemoveHook(id); }

void MetricsRegistry::RunCollectHooks() const { refreshing_->RunHooks(); }

MetricsRegistry::~MetricsRegistry() = default;

Status MetricsRegistry::Serve(const std::string& address) {
  TANDEM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address));
  try {
    // civetweb: "host:port"; port 0 makes the kernel pick a free one.
    exposer_ = std::make_unique<prometheus::Exposer>(hp.ToString(), /*num_threads=*/1);
  } catch (const std::exception& e) {
    return UnavailableError(fmt::format("metrics exposer cannot listen on {}: {}", address, e.what()));
  }
  exposer_->RegisterCollectable(refreshing_);
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
  prometheus::TextSerializer().Serialize(out, refreshing_->Collect());
  return out.str();
}

std::vector<double> MetricsRegistry::ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  b.reserve(count);
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<double> MetricsRegistry::InterTokenBuckets() {
  return {0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003,
          0.0035,  0.004,   0.0045, 0.005,   0.0055, 0.006, 0.0065, 0.007, 0.0075, 0.008,
          0.009,   0.01,    0.0125, 0.015,   0.0175, 0.02,  0.025,  0.03,   0.04,   0.05,
          0.075,   0.1,     0.15,   0.2,     0.3,    0.5,   0.75,   1.0,    2.5,    5.0};
}

HeldHistogram::HeldHistogram(MetricsRegistry& registry, const std::string& name,
                             const std::string& help, std::vector<double> buckets)
    : registry_(registry), bounds_(std::move(buckets)),
      histogram_(registry.Histogram(name, help, bounds_)),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  hook_ = registry_.AddCollectHook([this] { Fold(); });
}

HeldHistogram::~HeldHistogram() {
  registry_.RemoveCollectHook(hook_);
  Fold();  // the histogram (the registry's) keeps what was observed
}

void HeldHistogram::Fold() {
  std::vector<double> counts(bounds_.size() + 1);
  bool any = false;
  for (size_t i = 0; i < counts.size(); ++i) {
    const uint64_t n = counts_[i].exchange(0, std::memory_order_relaxed);
    counts[i] = static_cast<double>(n);
    any = any || n > 0;
  }
  // A sample observed during a fold may have its count folded now and its
  // value by the next fold: each is folded exactly once.
  const double sum = sum_.exchange(0, std::memory_order_relaxed);
  if (any || sum != 0) histogram_.ObserveMultiple(counts, sum);
}

RecentMedianCheck::RecentMedianCheck(Options options) : options_(options) {
  ring_.reserve(std::max<size_t>(options_.window, 1));
}

std::optional<double> RecentMedianCheck::Observe(double value, Clock::time_point now) {
  std::lock_guard lock(mu_);
  const size_t window = std::max<size_t>(options_.window, 1);
  if (ring_.size() < window) {
    ring_.push_back(value);
  } else {
    ring_[next_] = value;
  }
  next_ = (next_ + 1) % window;
  if (ring_.size() < std::max<size_t>(options_.min_samples, 1)) return std::nullopt;
  const double median = MedianLocked();
  if (!(median > options_.threshold)) return std::nullopt;
  if (last_warning_ && now - *last_warning_ < options_.min_interval) return std::nullopt;
  last_warning_ = now;
  return median;
}

double RecentMedianCheck::Median() const {
  std::lock_guard lock(mu_);
  return MedianLocked();
}

size_t RecentMedianCheck::size() const {
  std::lock_guard lock(mu_);
  return ring_.size();
}

double RecentMedianCheck::MedianLocked() const {
  if (ring_.empty()) return 0.0;
  std::vector<double> v = ring_;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  if (v.size() % 2 == 1) return v[mid];
  const double upper = v[mid];
  const double lower = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid));
  return (lower + upper) / 2.0;
}

}  // namespace tandem
