#include "loadgen/arrival.h"

#include <fmt/format.h>

#include <cmath>

namespace tandem::loadgen {

std::string Describe(const ArrivalOptions& o) {
  std::string cap = o.max_concurrency > 0 ? fmt::format(", at most {} in flight", o.max_concurrency)
                                          : std::string();
  switch (o.kind) {
    case ArrivalKind::kPoisson:
      if (std::isinf(o.rate)) return "all at once" + cap;
      return fmt::format("Poisson, {} sessions/s (seed {})", o.rate, o.seed) + cap;
    case ArrivalKind::kConcurrency:
      return fmt::format("fixed concurrency {}", o.concurrency);
    case ArrivalKind::kTrace:
      return "trace timestamps" + cap;
  }
  return "";
}

PoissonArrivals::PoissonArrivals(double rate, uint64_t seed) : rate_(rate), rng_(seed) {}

double PoissonArrivals::NextGapSeconds() {
  if (std::isinf(rate_)) return 0.0;
  // Inverse-CDF sampling from a 53-bit uniform in (0, 1]: the same numbers
  // from the same seed with any standard library (std::exponential_
  // distribution's algorithm is implementation-defined).
  const double u = (double((rng_() >> 11) + 1)) * 0x1.0p-53;
  return -std::log(u) / rate_;
}

std::vector<double> PoissonSchedule(double rate, uint64_t seed, size_t n) {
  PoissonArrivals a(rate, seed);
  std::vector<double> out;
  out.reserve(n);
  double t = 0.0;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(t);
    t += a.NextGapSeconds();
  }
  return out;
}

}  // namespace tandem::loadgen
