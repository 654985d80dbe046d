#include "router/load_tracker.h"

namespace tandem::router {

void LoadTracker::Recompute(State& s) {
  WorkerLoad& e = s.effective;
  e.queued_prefill_tokens = s.report.queued_prefill_tokens;
  e.active_decode_blocks = s.report.active_decode_blocks;
  e.free_blocks = s.report.free_blocks;
  e.running_requests = s.report.running_requests;
  e.free_known = s.free_known;
  for (const Prediction& p : s.pending) {
    e.queued_prefill_tokens += p.delta.prefill_tokens;
    e.active_decode_blocks += p.delta.decode_blocks;
    e.free_blocks -= p.delta.decode_blocks;
    e.running_requests += p.delta.running;
  }
}

void LoadTracker::Drop(State& s, int64_t cutoff_ns) {
  bool changed = false;
  while (!s.pending.empty() && s.pending.front().time_ns < cutoff_ns) {
    if (s.pending.front().key != 0) --s.keyed;
    s.pending.pop_front();
    changed = true;
  }
  if (changed) Recompute(s);
}

void LoadTracker::Reset(WorkerId worker, uint32_t num_blocks) {
  State& s = workers_[worker];
  s = State{};
  s.report.free_blocks = num_blocks;
  s.free_known = num_blocks > 0;
  Recompute(s);
}

void LoadTracker::ApplyReport(WorkerId worker, const LoadReport& report, int64_t now_ns) {
  State& s = workers_[worker];
  s.report = report;
  s.free_known = true;
  Recompute(s);
  Drop(s, now_ns - report_lag_ns_ + 1);
}

void LoadTracker::Predict(WorkerId worker, const LoadDelta& delta, int64_t now_ns, uint64_t key) {
  State& s = workers_[worker];
  s.pending.push_back({now_ns, delta, key});
  if (key != 0) ++s.keyed;
  WorkerLoad& e = s.effective;
  e.queued_prefill_tokens += delta.prefill_tokens;
  e.active_decode_blocks += delta.decode_blocks;
  e.free_blocks -= delta.decode_blocks;
  e.running_requests += delta.running;
}

uint32_t LoadTracker::Complete(WorkerId worker, std::span<const uint64_t> hashes) {
  State& s = workers_[worker];
  if (s.keyed == 0) return 0;
  uint32_t done = 0;
  for (auto it = s.pending.begin(); it != s.pending.end();) {
    bool hit = false;
    if (it->key != 0) {
      for (uint64_t h : hashes) {
        if (h == it->key) {
          hit = true;
          break;
        }
      }
    }
    if (!hit) {
      ++it;
      continue;
    }
    // One stored event is one sequence's commit: complete one prediction
    // (the oldest), not a second identical prompt still computing.
    ++done;
    --s.keyed;
    if (it->delta.decode_blocks == 0) {
      s.pending.erase(it);
    } else {
      it->delta.prefill_tokens = 0;
      it->key = 0;
    }
    break;
  }
  if (done > 0) Recompute(s);
  return done;
}

void LoadTracker::Expire(WorkerId worker, int64_t now_ns) {
  State& s = workers_[worker];
  if (!s.pending.empty() && s.pending.front().time_ns < now_ns - max_prediction_age_ns_) {
    Drop(s, now_ns - max_prediction_age_ns_);
  }
}

}  // namespace tandem::router
