// Arrival processes of `tandem bench serve`: when a new session starts.
//   poisson      sessions start at exponential gaps of mean 1/rate
//                (rate infinite: all at once)
//   concurrency  a fixed number of sessions run at once; one starts when
//                another ends
//   trace        sessions start at their trace timestamps (time-scaled)
// Follow-up turns of a conversation are sent when the previous turn ends,
// whatever the process.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace tandem::loadgen {

enum class ArrivalKind { kPoisson, kConcurrency, kTrace };

struct ArrivalOptions {
  ArrivalKind kind = ArrivalKind::kPoisson;
  double rate = std::numeric_limits<double>::infinity();  // sessions/s (poisson)
  uint32_t concurrency = 1;                                // concurrency
  // Requests in flight at most, for poisson and trace (0: no cap). A
  // session due while the cap is reached is sent as soon as one finishes;
  // its latency counts from when it is sent.
  uint32_t max_concurrency = 0;
  uint64_t seed = 0;
};

std::string Describe(const ArrivalOptions& o);

// Exponential gaps of mean 1/rate from a seeded generator (the same seed
// gives the same gaps); an infinite rate gives gaps of 0.
class PoissonArrivals {
 public:
  PoissonArrivals(double rate, uint64_t seed);
  double NextGapSeconds();

 private:
  double rate_;
  std::mt19937_64 rng_;
};

// Start times (seconds from the start of the run) of `n` sessions.
std::vector<double> PoissonSchedule(double rate, uint64_t seed, size_t n);

}  // namespace tandem::loadgen
