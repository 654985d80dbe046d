#include "router/ttft_predictor.h"

#include <algorithm>
#include <cmath>

namespace tandem::router {

void PrefillRate::Update(uint64_t tokens_total, double seconds_total) {
  if (!std::isfinite(seconds_total) || seconds_total < 0) return;
  if (!have_base_ || tokens_total < base_tokens_ || seconds_total < base_seconds_) {
    const bool restarted = have_base_;
    have_base_ = true;
    base_tokens_ = tokens_total;
    base_seconds_ = seconds_total;
    if (restarted) rate_ = 0;
    return;
  }
  const double ds = seconds_total - base_seconds_;
  if (ds < kMinWindowSeconds) return;  // keep the base; the window grows
  const double sample = static_cast<double>(tokens_total - base_tokens_) / ds;
  base_tokens_ = tokens_total;
  base_seconds_ = seconds_total;
  if (sample <= 0) return;
  rate_ = rate_ == 0 ? sample : (1 - kAlpha) * rate_ + kAlpha * sample;
}

void SeatTurnover::Update(uint64_t released_total, double seat_seconds_total) {
  if (!std::isfinite(seat_seconds_total) || seat_seconds_total < 0) return;
  if (!have_base_ || released_total < base_released_ || seat_seconds_total < base_seconds_) {
    const bool restarted = have_base_;
    have_base_ = true;
    base_released_ = released_total;
    base_seconds_ = seat_seconds_total;
    if (restarted) hold_ = 0;
    return;
  }
  const uint64_t released = released_total - base_released_;
  if (released < kMinReleases) return;  // keep the base; the window grows
  const double sample = (seat_seconds_total - base_seconds_) / static_cast<double>(released);
  base_released_ = released_total;
  base_seconds_ = seat_seconds_total;
  if (!(sample > 0)) return;
  hold_ = hold_ == 0 ? sample : (1 - kAlpha) * hold_ + kAlpha * sample;
}

std::optional<double> PrefillSideMs(const Candidate& p, double rate_tokens_per_s, const TtftInputs& in) {
  if (!(rate_tokens_per_s > 0)) return std::nullopt;
  const int64_t covered = int64_t{p.overlap_blocks} + p.tier_blocks;
  const double uncached =
      static_cast<double>(std::max<int64_t>(0, int64_t{in.prompt_tokens} - covered * in.block_size));
  // tier_credit_blocks = tier blocks x (1 - onboarding cost): the rest is
  // the onboarding work, in blocks of prefill.
  const double onboard_tokens = std::max(0.0, p.tier_blocks - p.tier_credit_blocks) * in.block_size;
  const double queued = static_cast<double>(std::max<int64_t>(0, p.load.queued_prefill_tokens));
  return (queued + uncached + onboard_tokens) / rate_tokens_per_s * 1e3;
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

std::optional<double> PairTtftMs(const Candidate& p, const Candidate& d, double rate_tokens_per_s,
                                 double hold_seconds, const TtftInputs& in, const RouterOptions& options) {
  if (p.id == d.id) return PrefillSideMs(p, rate_tokens_per_s, in);  // a local prefill: no seat wait
  if (!(rate_tokens_per_s > 0)) return std::nullopt;
  Candidate idle = p;  // p's own work alone: the queue ahead is compared with the seat wait
  idle.load.queued_prefill_tokens = 0;
  const double queue_ms =
      static_cast<double>(std::max<int64_t>(0, p.load.queued_prefill_tokens)) / rate_tokens_per_s * 1e3;
  return std::max(queue_ms, SeatWaitMs(d, hold_seconds)) + *PrefillSideMs(idle, rate_tokens_per_s, in) +
         TransferMs(p, d, in, options);
}

void PredictPerPrefiller(std::span<const Candidate> candidates, std::span<const double> rates,
                         std::span<const double> holds, const TtftInputs& in, const RouterOptions& options,
                         std::span<std::optional<double>> ms, const uint64_t* layout_compat) {
  const auto at = [](std::span<const double> v, WorkerId id) { return id < v.size() ? v[id] : 0.0; };
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& p = candidates[i];
    ms[i] = std::nullopt;
    if (!CanPrefill(p.role)) continue;
    const double rate = at(rates, p.id);
    if (p.role == WorkerRole::kBoth) {  // a 'both' prefiller keeps the request
      ms[i] = PrefillSideMs(p, rate, in);
      continue;
    }
    for (const Candidate& d : candidates) {
      if (d.id == p.id || !CanDecode(d.role)) continue;
      if (layout_compat != nullptr && ((layout_compat[p.layout_id] >> d.layout_id) & 1) == 0) continue;
      const std::optional<double> t = PairTtftMs(p, d, rate, at(holds, d.id), in, options);
      if (!t) break;  // p's rate is unknown
      if (!ms[i] || *t < *ms[i]) ms[i] = t;
    }
  }
}

}  // namespace tandem::router
