#include "router/ttft_predictor.h"

#include <algorithm>
#include <cmath>

namespace tandem::router {

void TotalsRatio::Update(double numerator_total, double denominator_total) {
  if (!std::isfinite(numerator_total) || !std::isfinite(denominator_total) || numerator_total < 0 ||
      denominator_total < 0) {
    return;
  }
  if (!have_base_ || numerator_total < base_num_ || denominator_total < base_den_) {
    const bool restarted = have_base_;
    have_base_ = true;
    base_num_ = numerator_total;
    base_den_ = denominator_total;
    if (restarted) value_ = 0;
    return;
  }
  const double window = denominator_total - base_den_;
  if (window < min_window_) return;  // keep the base; the window grows
  const double sample = (numerator_total - base_num_) / window;
  base_num_ = numerator_total;
  base_den_ = denominator_total;
  if (!(sample > 0)) return;
  value_ = value_ == 0 ? sample : (1 - kAlpha) * value_ + kAlpha * sample;
}

namespace {

// The prefill work on p, in tokens: the queue ahead of the request and its
// own (uncached tokens and the onboarding of lower-tier blocks), and the
// attention pairs of its uncached tokens.
struct PrefillParts {
  double queued = 0;
  double own = 0;
  double own_pairs = 0;
};

PrefillParts PrefillPartsOn(const Candidate& p, const TtftInputs& in) {
  const int64_t covered = int64_t{p.overlap_blocks} + p.tier_blocks;
  const double total = in.prompt_tokens;
  const double cached = std::min(total, static_cast<double>(covered) * in.block_size);
  // tier_credit_blocks = tier blocks x (1 - onboarding cost): the rest is
  // the onboarding work, in blocks of prefill.
  const double onboard_tokens = std::max(0.0, p.tier_blocks - p.tier_credit_blocks) * in.block_size;
  return {static_cast<double>(std::max<int64_t>(0, p.load.queued_prefill_tokens)),
          total - cached + onboard_tokens,
          // Token i (from 0) attends to i + 1 keys: tokens cached..total-1.
          (total * (total + 1) - cached * (cached + 1)) / 2};
}

// Milliseconds of the request's own prefill: with its attention at the
// work rate when the worker reports one, else its tokens at tokens/s.
double OwnMs(const PrefillParts& w, const PrefillSpeed& speed) {
  if (speed.pair_cost > 0 && speed.work_per_s > 0) {
    return (w.own + speed.pair_cost * w.own_pairs) / speed.work_per_s * 1e3;
  }
  return w.own / speed.tokens_per_s * 1e3;
}

}  // namespace

std::optional<double> PrefillSideMs(const Candidate& p, const PrefillSpeed& speed, const TtftInputs& in) {
  if (!(speed.tokens_per_s > 0)) return std::nullopt;
  const PrefillParts w = PrefillPartsOn(p, in);
  return w.queued / speed.tokens_per_s * 1e3 + OwnMs(w, speed);
}

double TransferMs(const Candidate& p, const Candidate& d, const TtftInputs& in, const RouterOptions& options) {
  if (p.id == d.id) return 0;
  const int64_t need =
      std::max<int64_t>(0, int64_t{in.prompt_blocks} - int64_t{d.overlap_blocks} - int64_t{d.tier_blocks});
  const uint64_t block_bytes = d.block_bytes ? d.block_bytes : options.default_block_bytes;
  const double bw = p.node_id == d.node_id   ? options.same_node_bandwidth_bytes_per_s
                    : p.zone_id == d.zone_id ? options.cross_node_bandwidth_bytes_per_s
                                             : options.cross_zone_bandwidth_bytes_per_s;
  return static_cast<double>(need) * static_cast<double>(block_bytes) / bw * 1e3;
}

double SeatWaitMs(const Candidate& d, double hold_seconds) {
  const int64_t seats = d.decode_seats;
  if (seats == 0 || !(hold_seconds > 0) || d.load.seat_demand < seats) return 0;
  const int64_t place = d.load.seat_demand - seats + 1;  // seat releases it waits for
  return static_cast<double>(place) * hold_seconds / static_cast<double>(seats) * 1e3;
}

double KvWaitMs(const Candidate& d, double hold_seconds, const TtftInputs& in) {
  if (!d.load.free_known || !(hold_seconds > 0)) return 0;
  const int64_t need = std::max<int64_t>(0, int64_t{in.prompt_blocks} - int64_t{d.overlap_blocks});
  const double holders = static_cast<double>(std::max<int64_t>(1, d.load.running_requests + d.load.reservations));
  const double share = static_cast<double>(std::max<int64_t>(1, d.load.active_decode_blocks)) / holders;
  const int64_t own =
      OwnGrowthBlocks(d.load.growth_ratio, in.prompt_tokens, in.max_tokens, in.block_size);
  const double deficit =
      static_cast<double>(need + d.load.growth_reserve_blocks + own - d.load.free_blocks) +
      static_cast<double>(d.load.pending_reserves) * share;
  if (!(deficit > 0)) return 0;
  return std::ceil(deficit / share) * hold_seconds / holders * 1e3;
}

std::optional<double> PairTtftMs(const Candidate& p, const Candidate& d, const PrefillSpeed& speed,
                                 double hold_seconds, const TtftInputs& in, const RouterOptions& options) {
  if (p.id == d.id) return PrefillSideMs(p, speed, in);  // a local prefill: no seat wait
  if (!(speed.tokens_per_s > 0)) return std::nullopt;
  const PrefillParts w = PrefillPartsOn(p, in);
  const double decoder_wait = std::max(SeatWaitMs(d, hold_seconds), KvWaitMs(d, hold_seconds, in));
  return std::max(w.queued / speed.tokens_per_s * 1e3, decoder_wait) + OwnMs(w, speed) +
         TransferMs(p, d, in, options);
}

void PredictPerPrefiller(std::span<const Candidate> candidates, std::span<const PrefillSpeed> speeds,
                         std::span<const double> holds, const TtftInputs& in, const RouterOptions& options,
                         std::span<std::optional<double>> ms, const uint64_t* layout_compat) {
  const auto at = [](std::span<const double> v, WorkerId id) { return id < v.size() ? v[id] : 0.0; };
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& p = candidates[i];
    ms[i] = std::nullopt;
    if (!CanPrefill(p.role)) continue;
    const PrefillSpeed speed = p.id < speeds.size() ? speeds[p.id] : PrefillSpeed();
    if (p.role == WorkerRole::kBoth) {  // a 'both' prefiller keeps the request
      ms[i] = PrefillSideMs(p, speed, in);
      continue;
    }
    for (const Candidate& d : candidates) {
      if (d.id == p.id || !CanDecode(d.role)) continue;
      if (layout_compat != nullptr && ((layout_compat[p.layout_id] >> d.layout_id) & 1) == 0) continue;
      const std::optional<double> t = PairTtftMs(p, d, speed, at(holds, d.id), in, options);
      if (!t) break;  // p's rate is unknown
      if (!ms[i] || *t < *ms[i]) ms[i] = t;
    }
  }
}

}  // namespace tandem::router
