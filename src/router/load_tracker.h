// LoadTracker: each worker's load as the router sees it, so that a burst
// routed between two reports spreads instead of landing on one worker, and
// so that a finished prefill stops counting at once.
//
// Two kinds of prediction per routed request:
//
// - Prefill work (AddPrefill): the request's uncached prompt tokens on the
//   worker that prefills it. It counts until the prefill ends: End (the
//   caller's ticket: the proxy got the prefill reply, or gave the attempt
//   up), Complete (the worker stored the prompt's last full block, keyed by
//   that hash), or max_prediction_age_ns. Load reports do not end it.
// - Timed part (Predict): decode blocks and running requests. A report
//   received at least `report_lag_ns` after the prediction replaces it (the
//   request has had time to reach the worker, so the report counts it);
//   max_prediction_age_ns bounds it when reports stop. Withdraw drops it
//   sooner: the attempt it predicts is over (finished, failed, abandoned,
//   or the decision was not used), so no later report will count it.
//
// A report's queued prefill tokens are the whole prompts of the requests
// waiting at the worker when it sampled them, up to one report interval
// earlier; the router's own requests among them are better known to the
// router (their uncached tokens, and when their prefill ended). So a report
// adds only the tokens beyond the reported size (the whole prompt) of this
// router's prefill work it may count: open, or ended since the previous
// report. With one proxy that is the work of nobody else: zero.
//
// Thread-safety: none. Router owns one and calls it under its mutex.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "common/growth_reserve.h"
#include "common/handle_table.h"
#include "router/types.h"

namespace tandem::router {

// Effective load: last report + predictions.
struct WorkerLoad {
  int64_t queued_prefill_tokens = 0;
  int64_t active_decode_blocks = 0;
  int64_t free_blocks = 0;  // may be under 0 when predictions overshoot
  int64_t running_requests = 0;
  bool free_known = false;  // false: no report and no pool size yet
  int64_t reported_free_blocks = 0;  // the last report's alone (before one: the pool size)
  // Decoder: requests registered there (each holds or will need a decode
  // seat): the report's plus the routes made since that it does not count.
  int64_t seat_demand = 0;
  // Decoder, by its last report: reservations held, and the requests
  // registered that hold no KV blocks there yet (registered - running -
  // reservations): they take blocks before a request routed now.
  int64_t reservations = 0;
  int64_t pending_reserves = 0;
  // Decoder: blocks its growth reserve keeps free (the last report's, plus
  // the own shares of the routes made since that it does not count).
  int64_t growth_reserve_blocks = 0;
  double growth_ratio = 0;            // decoder: the reserve's ratio (last report; 0: off)
};

// The blocks a decoder's growth reserve keeps free for a new request beyond
// its prompt's: `ratio` x what it may generate past its prompt's blocks
// (its KV ends at prompt + max_tokens - 1 tokens; at most kGrowthClipTokens
// past them), rounded up. 0 when max_tokens is unknown (0) or the reserve
// is off (ratio 0).
inline int64_t OwnGrowthBlocks(double ratio, uint32_t prompt_tokens, uint32_t max_tokens,
                               uint32_t block_size) {
  if (!(ratio > 0) || max_tokens == 0 || block_size == 0) return 0;
  const uint64_t prompt_blocks = (uint64_t{prompt_tokens} + block_size - 1) / block_size;
  const uint64_t past =
      GrowthTokensPast(uint64_t{prompt_tokens} + max_tokens - 1, prompt_blocks, block_size);
  return static_cast<int64_t>(std::ceil(ratio * static_cast<double>(past) / block_size));
}

// The timed part of a prediction.
struct LoadDelta {
  int64_t decode_blocks = 0;  // added to active blocks, taken from free blocks
  int64_t running = 0;
  // Added to a decoder's growth reserve (its own share, OwnGrowthBlocks):
  // the decoder's reserve counts a reservation's growth from its Reserve on.
  int64_t growth_blocks = 0;

  LoadDelta& operator+=(const LoadDelta& d) {
    decode_blocks += d.decode_blocks;
    running += d.running;
    growth_blocks += d.growth_blocks;
    return *this;
  }
  LoadDelta& operator-=(const LoadDelta& d) {
    decode_blocks -= d.decode_blocks;
    running -= d.running;
    growth_blocks -= d.growth_blocks;
    return *this;
  }
  bool empty() const { return decode_blocks == 0 && running == 0 && growth_blocks == 0; }
};

// The prefill a routed request brings to the worker that prefills it.
struct PrefillWork {
  uint64_t ticket = 0;           // the router's id for it (RouteDecision::prefill_ticket), > 0
  uint64_t key = 0;              // the prompt's last full block hash; 0: none (nothing to store)
  int64_t tokens = 0;            // uncached prompt tokens: the work
  int64_t reported_tokens = 0;   // what the worker's report counts while it waits (0: never)
  int64_t running = 0;           // a running request there while it lasts
};

class LoadTracker {
 public:
  LoadTracker(int64_t report_lag_ns, int64_t max_prediction_age_ns)
      : report_lag_ns_(report_lag_ns), max_prediction_age_ns_(max_prediction_age_ns) {}

  // A worker joins: no report, no predictions; `num_blocks` free (0: unknown).
  void Reset(WorkerId worker, uint32_t num_blocks);
  void ApplyReport(WorkerId worker, const LoadReport& report, int64_t now_ns);
  // `ticket`: the route's (RouteDecision::prefill_ticket.id, > 0), for
  // Withdraw; increasing from call to call like AddPrefill's (Withdraw
  // finds it by binary search).
  void Predict(WorkerId worker, const LoadDelta& delta, int64_t now_ns, uint64_t ticket);
  // The attempt of the route `ticket` is over: its timed part stops counting
  // if no report has replaced it yet. Returns false when none was pending.
  bool Withdraw(WorkerId worker, uint64_t ticket);
  // Tickets must increase from call to call (Router hands them out in order).
  void AddPrefill(WorkerId worker, const PrefillWork& work, int64_t now_ns);
  // The prefill with this ticket is over (done, failed or abandoned).
  // Returns false when it had already ended (or never was).
  bool End(WorkerId worker, uint64_t ticket);
  // The worker stored the blocks `hashes` (a KV event). The oldest open
  // prefill whose key is among them has finished. Returns how many ended
  // (0 or 1): one stored event is one sequence's commit, not a second
  // identical prompt still computing. One pass over `hashes` and at most
  // two over the worker's prefills, whatever their number (a filter of the
  // open keys, then the hashes that pass it). The filter is kept between
  // calls (session 39): a new prefill's key is added to it, an ended one's
  // bit stays until the filter is rebuilt, once as many keys ended as are
  // open; and a hash that passes it is looked up among the open keys
  // (`open_keys`) before any prefill is: so an event that ends none (the
  // filter passes a hash by chance at most once in 32) costs one pass over
  // its hashes and a lookup or two, not passes over the open prefills.
  uint32_t Complete(WorkerId worker, std::span<const uint64_t> hashes);
  // Open prefills with a key (a hint for callers: 0 = Complete is a no-op).
  uint32_t keyed_predictions(WorkerId worker) const { return workers_[worker].keyed; }
  // Drops predictions past their age (call before reading loads).
  void Expire(WorkerId worker, int64_t now_ns);

  const WorkerLoad& load(WorkerId worker) const { return workers_[worker].effective; }
  // Timed parts and prefills not yet dropped (ended ones may linger until
  // they reach the front of their queue).
  size_t pending_predictions(WorkerId worker) const {
    return workers_[worker].timed.size() + workers_[worker].prefills.size();
  }

 private:
  struct Timed {
    int64_t time_ns;
    uint64_t ticket;
    LoadDelta delta;  // zero once withdrawn
  };
  struct Prefill {
    int64_t time_ns;
    PrefillWork work;
    bool open = true;
  };
  struct State {
    LoadReport report;
    bool free_known = false;
    std::deque<Timed> timed;      // oldest first (so by ticket too)
    std::deque<Prefill> prefills;  // by ticket, oldest first
    uint32_t keyed = 0;            // open prefills with a key
    // Complete's filter of the open keys (a bit per key hash, at least 64
    // bits per key; empty: to be built) and the keys ended since it was
    // built, whose bits may still be set.
    std::vector<uint64_t> key_filter;
    uint32_t filter_stale = 0;
    // key -> open prefills with it: open addressing (common/handle_table.h;
    // a block hash's low bits serve as its home slot), so that a routed
    // prefill's key costs no allocation. Keys are never 0.
    HandleTable<uint32_t> open_keys;
    // Sums over the live entries, kept as they change (no rescans: a
    // worker may hold many, e.g. a router fed by a benchmark).
    LoadDelta timed_sum;
    int64_t open_tokens = 0, open_running = 0, open_reported = 0;
    int64_t ended_reported = 0, ended_running = 0;  // ended since the last report
    int64_t foreign_tokens = 0, foreign_running = 0;  // the report's beyond ours
    WorkerLoad effective;
  };
  static void Refresh(State& s);
  static void DropTimedBefore(State& s, int64_t cutoff_ns);
  void EndAt(State& s, Prefill& p);
  static void PopEnded(State& s);
  // The filter's size for `keyed` open keys, in bits (a power of two).
  static size_t FilterBits(uint32_t keyed);
  static void SetFilterBit(std::vector<uint64_t>& filter, uint64_t key);
  static void BuildFilter(State& s);

  const int64_t report_lag_ns_;
  const int64_t max_prediction_age_ns_;
  std::array<State, kMaxWorkers> workers_;
  // Complete's scratch, kept between calls: the event's hashes that pass
  // the filter.
  std::vector<uint64_t> passed_;
};

}  // namespace tandem::router
