#include "proxy/ttft_calibration.h"

#include <algorithm>
#include <cmath>

namespace tandem::proxy {

TtftCalibration::TtftCalibration(Options options, MetricsRegistry* registry)
    : options_(options), registry_(registry) {
  ring_.reserve(options_.window);
  scratch_.reserve(options_.window);
  if (registry_ == nullptr) return;
  gauge_ = &registry_->Gauge(
      "tandem_slo_admission_margin_ratio",
      "margin SLO admission adds to a predicted TTFT, as a fraction of the request's TTFT SLO "
      "(proxy.slo.attainment; 0 until calibrated)");
  hook_ = registry_->AddCollectHook([this] { gauge_->Set(Margin(Clock::now())); });
}

TtftCalibration::~TtftCalibration() {
  if (registry_ != nullptr) registry_->RemoveCollectHook(hook_);
}

void TtftCalibration::Observe(double predicted_ms, double actual_ms, uint32_t slo_ms,
                              Clock::time_point now) {
  if (!enabled() || slo_ms == 0 || predicted_ms < kMinPredictedShare * slo_ms) return;
  const Sample s{now, (actual_ms - predicted_ms) / slo_ms};
  std::lock_guard lock(mu_);
  if (ring_.size() < options_.window) {
    ring_.push_back(s);
  } else {
    ring_[next_] = s;
    next_ = (next_ + 1) % options_.window;
  }
  scratch_.clear();
  for (const Sample& r : ring_) {
    if (now - r.at <= options_.max_age) scratch_.push_back(r.error);
  }
  double margin = 0;
  if (scratch_.size() >= options_.min_samples) {
    // The smallest error that at least `attainment` of the samples are at
    // or under.
    const size_t n = scratch_.size();
    const size_t k = std::min(n - 1, static_cast<size_t>(std::ceil(options_.attainment * n)) - 1);
    std::nth_element(scratch_.begin(), scratch_.begin() + k, scratch_.end());
    margin = std::clamp(scratch_[k], -kMaxMargin, kMaxMargin);
  }
  margin_.store(margin, std::memory_order_relaxed);
  newest_ns_.store(now.time_since_epoch().count(), std::memory_order_release);
}

double TtftCalibration::Margin(Clock::time_point now) const {
  const int64_t newest = newest_ns_.load(std::memory_order_acquire);
  if (newest == 0) return 0;
  if (now - Clock::time_point(Clock::duration(newest)) > options_.max_age) return 0;
  return margin_.load(std::memory_order_relaxed);
}

}  // namespace tandem::proxy
