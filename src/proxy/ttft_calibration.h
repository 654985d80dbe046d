// How late admitted requests' first tokens come against SLO admission's
// prediction, and the margin that admission adds for it (docs/scheduling.md,
// "Calibrated admission").
//
// The TTFT prediction (router/ttft_predictor.h) is a mean: the queue ahead
// over a measured rate, a seat wait over a measured turnover. Work leaves
// queues in lumps, so a request predicted just under its SLO misses it about
// as often as not (bench/results/slo_admission.md: 24-28 % of the admitted
// missed at twice a seat-bound fleet's capacity, prediction unbiased).
// `proxy.slo.attainment: q` asks for q of the admitted to meet their SLO:
// each admitted request's error at its first token, (actual - predicted) /
// its SLO, is kept (the last `window`, none older than `max_age`), and
// admission refuses a request when prediction + the errors' q-quantile x SLO
// exceeds the SLO. Only requests predicted at least kMinPredictedShare of
// their SLO count: those near the line are the ones the margin decides, and
// an idle fleet's near-zero predictions say nothing about a queue's spread.
// The margin is bounded to +-kMaxMargin of the SLO, so a request predicted
// under half its SLO is always admitted: new errors keep coming and the
// margin cannot shut admission for good. It is 0 until `min_samples` errors
// are known, and again once the newest is older than `max_age` (load gone).
//
// Thread-safety: all methods from any thread; Margin reads two atomics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/metrics.h"

namespace tandem::proxy {

class TtftCalibration {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    double attainment = 0;  // proxy.slo.attainment, in [0, 1); 0: no margin
    size_t window = 128;
    size_t min_samples = 16;
    Clock::duration max_age = std::chrono::seconds(60);
  };
  static constexpr double kMaxMargin = 0.5;           // of the SLO, either way
  static constexpr double kMinPredictedShare = 0.25;  // of the SLO, to count

  // `registry` (may be null) gets the gauge tandem_slo_admission_margin_ratio,
  // brought up to date at each collection.
  explicit TtftCalibration(Options options, MetricsRegistry* registry = nullptr);
  ~TtftCalibration();
  TtftCalibration(const TtftCalibration&) = delete;
  TtftCalibration& operator=(const TtftCalibration&) = delete;

  bool enabled() const { return options_.attainment > 0; }
  double attainment() const { return options_.attainment; }

  // An admitted request's first token: admission's prediction, the time it
  // took, both in ms from its arrival, and its TTFT SLO.
  void Observe(double predicted_ms, double actual_ms, uint32_t slo_ms, Clock::time_point now);

  // The margin to add to a prediction, as a fraction of the request's SLO.
  double Margin(Clock::time_point now) const;

 private:
  struct Sample {
    Clock::time_point at;
    double error;  // (actual - predicted) / SLO
  };

  const Options options_;
  MetricsRegistry* const registry_;
  prometheus::Gauge* gauge_ = nullptr;
  size_t hook_ = 0;

  std::mutex mu_;
  std::vector<Sample> ring_;  // guarded by mu_; at most options_.window
  size_t next_ = 0;           // guarded by mu_: the slot the next sample overwrites once full
  std::vector<double> scratch_;  // guarded by mu_
  std::atomic<double> margin_{0};
  std::atomic<int64_t> newest_ns_{0};  // Clock's count of the newest sample; 0: none
};

}  // namespace tandem::proxy
