// TTFT prediction for SLO-aware routing and admission (issue 22;
// docs/scheduling.md, "Deadlines and SLOs").
//
// Each worker's prefill rate is measured, not configured: its load reports
// carry the engine's totals of prefill tokens computed and of the seconds
// of the steps that computed them (LoadReport.prefill_tokens_total /
// prefill_seconds_total); PrefillRate turns the deltas between reports into
// tokens per second (an exponential moving average over windows of at
// least kMinWindowSeconds of prefill compute).
//
// A request's predicted time to first token on a prefiller p and decoder d:
//   ttft(p, d) = max(queued_prefill_tokens_p / rate_p, seat_wait_d)
//              + (uncached_p + onboard_p + cost_p * pairs) / work_rate_p
//              + transfer(p, d)
//   uncached_p = prompt tokens beyond p's cached prefix (device and lower tiers)
//   pairs      = the causal-attention (query, key) pairs of those tokens:
//                (L(L+1) - C(C+1)) / 2 for a prompt of L tokens, C covered
//   cost_p     = one pair's compute in prefill tokens (LoadReport.
//                prefill_pair_cost: FLOPs over FLOPs, from the model's shape)
//   work_rate_p = (prefill tokens + cost_p x their pairs) per second of
//                prefill compute (LoadReport.prefill_attention_pairs_total);
//                with no cost reported (an older worker): rate_p, no pairs
// (attention grows with the context: a 32k-token prompt of an 8B Llama
// costs 1.6x what its tokens alone would; docs/router.md, "Attention in
// the TTFT prediction"). The queue ahead is timed at rate_p, the recent
// mix's tokens per second: its own attention share is that mix's.
//   onboard_p  = p's lower-tier blocks x their onboarding cost (in blocks of
//                prefill work, RouterOptions) x block size
//   transfer   = blocks the decoder lacks x block bytes / link bandwidth(p, d);
//                0 for a local prefill (p == d)
//   seat_wait_d = 0 while d has a decode seat free, else the seat releases
//                ahead of the request x d's mean seat hold / its seats
//                (SeatWaitMs); 0 for a local prefill
//   kv_wait_d  = 0 while d's free KV blocks hold the prompt's blocks it does
//                not cache, else the requests that must end there to free
//                the rest x d's mean seat hold / its running requests
//                (KvWaitMs); 0 for a local prefill. The request waits for
//                both in one line: max(seat_wait_d, kv_wait_d) stands for
//                seat_wait_d above.
// queued_prefill_tokens_p is the router's effective load (the worker's
// report plus the router's own routed, unfinished prefills): the work ahead.
// A prefiller whose rate is not measured yet has no prediction (unknown):
// it is never excluded and never the reason for a refusal.
//
// Thread-safety: none; the Router calls these under its mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "router/router_options.h"
#include "router/scoring.h"

namespace tandem::router {

// The average of d(numerator) / d(denominator) between successive reports
// of two totals since a worker started: windows whose denominator grew by
// less than `min_window` wait for more (the base stays), a window whose
// numerator did not grow leaves the average as it was, and totals that go
// backwards (a restarted worker) start the measurement over. Each window's
// ratio enters an exponential moving average with weight kAlpha.
class TotalsRatio {
 public:
  static constexpr double kAlpha = 0.3;

  explicit TotalsRatio(double min_window) : min_window_(min_window) {}
  void Reset() { *this = TotalsRatio(min_window_); }
  void Update(double numerator_total, double denominator_total);
  // The average; 0 while unknown.
  double value() const { return value_; }

 private:
  double min_window_;
  bool have_base_ = false;
  double base_num_ = 0;
  double base_den_ = 0;
  double value_ = 0;
};

// A worker's prefill rate: prefill tokens computed over the seconds of the
// steps that computed them (LoadReport.prefill_tokens_total /
// prefill_seconds_total).
// What the prediction knows of one prefiller's speed (PrefillRate). A plain
// tokens-per-second number converts: no attention term.
struct PrefillSpeed {
  double tokens_per_s = 0;  // 0: unknown
  double work_per_s = 0;    // (tokens + pair_cost x pairs) per second; 0: unknown
  double pair_cost = 0;     // 0: not reported
  PrefillSpeed() = default;
  PrefillSpeed(double tokens_per_second) : tokens_per_s(tokens_per_second) {}  // NOLINT: implicit
};

class PrefillRate {
 public:
  // Deltas below this much prefill compute wait for more (one short step
  // says little about the rate).
  static constexpr double kMinWindowSeconds = 0.02;
  // Weight of a new window in the average.
  static constexpr double kAlpha = TotalsRatio::kAlpha;

  void Reset() {
    tokens_.Reset();
    work_.Reset();
    pair_cost_ = 0;
  }
  // The worker's totals from a load report, and one attention pair's cost
  // (0: not reported; the work rate is then not measured). Totals that go
  // backwards (a restarted worker) start the measurement over.
  void Update(uint64_t tokens_total, double seconds_total, uint64_t pairs_total = 0,
              double pair_cost = 0) {
    tokens_.Update(static_cast<double>(tokens_total), seconds_total);
    pair_cost_ = pair_cost > 0 ? pair_cost : 0;
    if (pair_cost_ > 0) {
      work_.Update(static_cast<double>(tokens_total) + pair_cost_ * static_cast<double>(pairs_total),
                   seconds_total);
    }
  }
  // Tokens per second; 0 while unknown.
  double tokens_per_s() const { return tokens_.value(); }
  PrefillSpeed speed() const {
    PrefillSpeed s(tokens_.value());
    if (pair_cost_ > 0) {
      s.work_per_s = work_.value();
      s.pair_cost = pair_cost_;
    }
    return s;
  }

 private:
  TotalsRatio tokens_{kMinWindowSeconds};
  TotalsRatio work_{kMinWindowSeconds};
  double pair_cost_ = 0;
};

// A decoder's mean seat hold time (docs/router.md, "Seat waits in the TTFT
// prediction"): its load reports carry the decode seats it gave back and
// the time integral of the seats it held (seat-seconds), totals since
// start (LoadReport.seats_released_total / seat_seconds_total). Over the
// window between reports, Little's law gives the mean time a request held
// its seat = seat-seconds / seats given back.
class SeatTurnover {
 public:
  // Windows with fewer releases wait for more (one release says little).
  static constexpr uint64_t kMinReleases = 4;
  static constexpr double kAlpha = TotalsRatio::kAlpha;

  void Reset() { ratio_.Reset(); }
  // The decoder's totals from a load report. Totals that go backwards (a
  // restarted worker) start the measurement over.
  void Update(uint64_t released_total, double seat_seconds_total) {
    ratio_.Update(seat_seconds_total, static_cast<double>(released_total));
  }
  // Seconds a request holds a seat, on average; 0 while unknown.
  double hold_seconds() const { return ratio_.value(); }

 private:
  TotalsRatio ratio_{static_cast<double>(kMinReleases)};
};

struct TtftInputs {
  uint32_t prompt_tokens = 0;
  uint32_t prompt_blocks = 0;  // ceil(prompt_tokens / block size)
  uint32_t block_size = 16;
  uint32_t max_tokens = 0;  // 0: unknown (no growth reserve share counted)
};

// Prefill-side time in ms of the request on `p` (queue ahead, its own
// uncached tokens with their attention, onboarding), or nullopt when p's
// rate is unknown.
std::optional<double> PrefillSideMs(const Candidate& p, const PrefillSpeed& speed, const TtftInputs& in);
// KV transfer time in ms from p to d of the blocks d lacks; 0 when p == d.
double TransferMs(const Candidate& p, const Candidate& d, const TtftInputs& in, const RouterOptions& options);
// How long in ms a request sent to decoder d now waits for a decode seat:
// 0 while a seat is free (seat_demand < decode_seats) or d's seats are
// unknown; otherwise it is number n = seat_demand - decode_seats + 1 in
// line and a seat comes free every hold / decode_seats seconds on average,
// so n x hold / decode_seats. `hold_seconds` 0 (not measured yet): 0, the
// request is admitted as if a seat were free.
double SeatWaitMs(const Candidate& d, double hold_seconds);
// How long in ms a request sent to decoder d now waits for the KV blocks
// its reservation takes there (docs/router.md, "KV-block waits in the TTFT
// prediction"): 0 while d's free blocks (the router's estimate: its last
// report less the routes made since) hold the prompt's blocks d does not
// cache, or they are unknown, or `hold_seconds` is 0 (not measured).
// Otherwise blocks come free as d's requests end: h = its running requests
// and reservations hold the blocks in use, b = in use / h each; the
// deficit is the prompt's blocks plus those d's growth reserve keeps free
// (its last report; docs/engine.md, "Growth reserve") and the request's own
// share of it (OwnGrowthBlocks at d's reported ratio) less the free ones,
// plus b for each request registered there that holds none yet
// (pending_reserves: it takes its blocks first); k = ceil(deficit / b)
// requests must end, one every hold / h seconds on average: k x hold / h
// (h at least 1).
double KvWaitMs(const Candidate& d, double hold_seconds, const TtftInputs& in);
// The predicted TTFT of the pair: the request waits both for the queue
// ahead on p and for its seat and KV blocks on d (the prefiller reserves
// them before it prefills the prompt), so the longest of those, then its
// own prefill and the transfer. nullopt when p's rate is unknown.
std::optional<double> PairTtftMs(const Candidate& p, const Candidate& d, const PrefillSpeed& speed,
                                 double hold_seconds, const TtftInputs& in, const RouterOptions& options);

// The best predicted TTFT of each prefill-capable candidate over the
// decoders it may pair with (`ms[i]` for candidates[i]; nullopt: unknown
// rate, or not prefill-capable, or no decoder to pair with).
// `speeds[id]`: worker id's prefill speed (unknown: 0); `holds[id]`: its mean
// seat hold in seconds (SeatTurnover; 0: unknown). `layout_compat`: as
// ScoringParams::layout_compat (a decoder whose rank layout the prefiller's
// KV cannot reach is not a pair; null: every pair is).
void PredictPerPrefiller(std::span<const Candidate> candidates, std::span<const PrefillSpeed> speeds,
                         std::span<const double> holds, const TtftInputs& in, const RouterOptions& options,
                         std::span<std::optional<double>> ms,
                         const uint64_t* layout_compat = nullptr);

}  // namespace tandem::router
