// LoadTracker: each worker's load as its last report said, plus what the
// router has sent it since (predictions), so that a burst routed between
// two reports spreads instead of landing on one worker.
//
// A prediction is dropped when a report arrives that was received at least
// `report_lag_ns` after the prediction was made (the request has had time
// to reach the worker, so the report counts it), or when it is older than
// `max_prediction_age_ns` (bounds memory if reports stop). A prediction with
// a key (the prompt's last full block hash) also ends its prefill part when
// the worker reports that block stored (Complete): the prefill is done, so
// a request sent right after a short one does not see it as queued.
//
// Thread-safety: none. Router owns one and calls it under its mutex.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <span>

#include "router/types.h"

namespace tandem::router {

// Effective load: last report + predictions since.
struct WorkerLoad {
  int64_t queued_prefill_tokens = 0;
  int64_t active_decode_blocks = 0;
  int64_t free_blocks = 0;  // may be under 0 when predictions overshoot
  int64_t running_requests = 0;
  bool free_known = false;  // false: no report and no pool size yet
};

struct LoadDelta {
  int64_t prefill_tokens = 0;  // added to queued_prefill_tokens
  int64_t decode_blocks = 0;   // added to active blocks, taken from free blocks
  int64_t running = 0;
};

class LoadTracker {
 public:
  LoadTracker(int64_t report_lag_ns, int64_t max_prediction_age_ns)
      : report_lag_ns_(report_lag_ns), max_prediction_age_ns_(max_prediction_age_ns) {}

  // A worker joins: no report yet; `num_blocks` free (0: unknown).
  void Reset(WorkerId worker, uint32_t num_blocks);
  void ApplyReport(WorkerId worker, const LoadReport& report, int64_t now_ns);
  // `key` != 0: the prompt's last full block hash, for Complete.
  void Predict(WorkerId worker, const LoadDelta& delta, int64_t now_ns, uint64_t key = 0);
  // The worker stored the blocks `hashes` (a KV event). The oldest pending
  // keyed prediction whose key is among them has finished its prefill: its
  // prefill tokens are dropped, and so is the prediction itself unless it
  // also holds decode blocks (a local prefill: the request goes on running
  // there). Returns how many predictions completed (0 or 1).
  uint32_t Complete(WorkerId worker, std::span<const uint64_t> hashes);
  // Pending predictions with a key (a hint for callers: 0 = Complete is a no-op).
  uint32_t keyed_predictions(WorkerId worker) const { return workers_[worker].keyed; }
  // Drops predictions past their age (call before reading loads).
  void Expire(WorkerId worker, int64_t now_ns);

  const WorkerLoad& load(WorkerId worker) const { return workers_[worker].effective; }
  size_t pending_predictions(WorkerId worker) const { return workers_[worker].pending.size(); }

 private:
  struct Prediction {
    int64_t time_ns;
    LoadDelta delta;
    uint64_t key = 0;  // 0: none, or completed
  };
  struct State {
    LoadReport report;
    bool free_known = false;
    std::deque<Prediction> pending;  // oldest first
    uint32_t keyed = 0;              // pending entries with key != 0
    WorkerLoad effective;
  };
  void Recompute(State& s);
  void Drop(State& s, int64_t cutoff_ns);  // predictions made before cutoff

  const int64_t report_lag_ns_;
  const int64_t max_prediction_age_ns_;
  std::array<State, kMaxWorkers> workers_;
};

}  // namespace tandem::router
