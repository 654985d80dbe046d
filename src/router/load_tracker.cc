#include "router/load_tracker.h"

#include <algorithm>
#include <bit>

namespace tandem::router {

void LoadTracker::Refresh(State& s) {
  WorkerLoad& e = s.effective;
  e.queued_prefill_tokens = s.foreign_tokens + s.open_tokens;
  e.active_decode_blocks = s.report.active_decode_blocks + s.timed_sum.decode_blocks;
  e.free_blocks = s.report.free_blocks - s.timed_sum.decode_blocks;
  e.reported_free_blocks = s.report.free_blocks;
  e.running_requests = s.foreign_running + s.open_running + s.timed_sum.running;
  e.seat_demand = int64_t{s.report.registered_requests} + s.timed_sum.running;
  e.free_known = s.free_known;
  e.reservations = s.report.num_reservations;
  e.growth_reserve_blocks = int64_t{s.report.kv_growth_reserve_blocks} + s.timed_sum.growth_blocks;
  e.growth_ratio = s.report.kv_growth_ratio;
  e.pending_reserves = std::max<int64_t>(0, int64_t{s.report.registered_requests} - s.report.running_requests -
                                                s.report.num_reservations);
}

void LoadTracker::DropTimedBefore(State& s, int64_t cutoff_ns) {
  while (!s.timed.empty() && s.timed.front().time_ns < cutoff_ns) {
    s.timed_sum -= s.timed.front().delta;
    s.timed.pop_front();
  }
}

void LoadTracker::EndAt(State& s, Prefill& p) {
  p.open = false;
  s.open_tokens -= p.work.tokens;
  s.open_running -= p.work.running;
  s.open_reported -= p.work.reported_tokens;
  s.ended_reported += p.work.reported_tokens;
  s.ended_running += p.work.running;
  if (p.work.key != 0) {
    --s.keyed;
    ++s.filter_stale;  // its bit stays set until the filter is rebuilt
    if (uint32_t* n = s.open_keys.Find(p.work.key); n != nullptr && --*n == 0) {
      s.open_keys.Take(p.work.key);
    }
  }
}

size_t LoadTracker::FilterBits(uint32_t keyed) {
  constexpr size_t kMinFilterBits = 1024;
  return std::bit_ceil(std::max<size_t>(kMinFilterBits, size_t{keyed} * 64));
}

void LoadTracker::SetFilterBit(std::vector<uint64_t>& filter, uint64_t key) {
  const uint64_t mask = filter.size() * 64 - 1;
  filter[(key & mask) >> 6] |= uint64_t{1} << (key & 63);
}

void LoadTracker::BuildFilter(State& s) {
  s.key_filter.assign(FilterBits(s.keyed) / 64, 0);
  for (const Prefill& p : s.prefills) {
    if (p.open && p.work.key != 0) SetFilterBit(s.key_filter, p.work.key);
  }
  s.filter_stale = 0;
}

void LoadTracker::PopEnded(State& s) {
  while (!s.prefills.empty() && !s.prefills.front().open) s.prefills.pop_front();
}

void LoadTracker::Reset(WorkerId worker, uint32_t num_blocks) {
  State& s = workers_[worker];
  s = State{};
  s.report.free_blocks = num_blocks;
  s.free_known = num_blocks > 0;
  Refresh(s);
}

void LoadTracker::ApplyReport(WorkerId worker, const LoadReport& report, int64_t now_ns) {
  State& s = workers_[worker];
  // What the report counts beyond our own prefills that it may count (open,
  // or ended after it may have been sampled).
  s.foreign_tokens = std::max<int64_t>(0, int64_t{report.queued_prefill_tokens} - s.open_reported - s.ended_reported);
  s.foreign_running = std::max<int64_t>(0, int64_t{report.running_requests} - s.open_running - s.ended_running);
  s.ended_reported = s.ended_running = 0;
  s.report = report;
  s.free_known = true;
  // Timed parts made long enough before it: the report counts them.
  DropTimedBefore(s, now_ns - report_lag_ns_ + 1);
  Refresh(s);
}

void LoadTracker::Predict(WorkerId worker, const LoadDelta& delta, int64_t now_ns, uint64_t ticket) {
  State& s = workers_[worker];
  s.timed.push_back({now_ns, ticket, delta});
  s.timed_sum += delta;
  Refresh(s);
}

bool LoadTracker::Withdraw(WorkerId worker, uint64_t ticket) {
  State& s = workers_[worker];
  if (ticket == 0) return false;
  auto it = std::lower_bound(s.timed.begin(), s.timed.end(), ticket,
                             [](const Timed& t, uint64_t k) { return t.ticket < k; });
  if (it == s.timed.end() || it->ticket != ticket) return false;
  if (it->delta.empty()) return false;
  s.timed_sum -= it->delta;
  it->delta = {};  // stays queued until a report or its age drops it
  Refresh(s);
  return true;
}

void LoadTracker::AddPrefill(WorkerId worker, const PrefillWork& work, int64_t now_ns) {
  State& s = workers_[worker];
  s.prefills.push_back({now_ns, work, true});
  s.open_tokens += work.tokens;
  s.open_running += work.running;
  s.open_reported += work.reported_tokens;
  if (work.key != 0) {
    ++s.keyed;
    if (uint32_t* n = s.open_keys.Find(work.key)) {
      ++*n;
    } else {
      s.open_keys.Insert(work.key, 1);
    }
    // Into the kept filter while it has its 64 bits per key; else it is
    // built again, larger, at the next Complete.
    if (s.key_filter.size() * 64 >= FilterBits(s.keyed)) {
      SetFilterBit(s.key_filter, work.key);
    } else {
      s.key_filter.clear();
    }
  }
  Refresh(s);
}

bool LoadTracker::End(WorkerId worker, uint64_t ticket) {
  State& s = workers_[worker];
  auto it = std::lower_bound(s.prefills.begin(), s.prefills.end(), ticket,
                             [](const Prefill& p, uint64_t t) { return p.work.ticket < t; });
  if (it == s.prefills.end() || it->work.ticket != ticket || !it->open) return false;
  EndAt(s, *it);
  PopEnded(s);
  Refresh(s);
  return true;
}

uint32_t LoadTracker::Complete(WorkerId worker, std::span<const uint64_t> hashes) {
  State& s = workers_[worker];
  if (s.keyed == 0 || hashes.empty()) return 0;
  // Issue 23 (session 36): the event was scanned once per open prefill, k
  // x its hashes under the router's lock for every stored event of a
  // prefiller with k prompts queued. Now: a bit filter of the open keys
  // (at least 64 bits per key, so a hash passes by chance at most once in
  // 64), one pass over the event, and the oldest open prefill whose key is
  // one of the hashes that passed (exact: every open key is in the filter).
  // Session 39: the filter is kept (see the header); rebuilt, one pass over
  // the prefills, only once as many keys ended as are open.
  if (s.key_filter.empty() || s.filter_stale > s.keyed) BuildFilter(s);
  const std::vector<uint64_t>& filter = s.key_filter;
  const uint64_t mask = filter.size() * 64 - 1;
  passed_.clear();
  for (const uint64_t h : hashes) {
    if ((filter[(h & mask) >> 6] >> (h & 63)) & 1) passed_.push_back(h);
  }
  // Only open keys go on: a chance pass or an ended key's stale bit ends here.
  std::erase_if(passed_, [&s](uint64_t h) { return s.open_keys.Find(h) == nullptr; });
  if (passed_.empty()) return 0;
  std::sort(passed_.begin(), passed_.end());
  for (Prefill& p : s.prefills) {
    if (!p.open || p.work.key == 0) continue;
    if (!std::binary_search(passed_.begin(), passed_.end(), p.work.key)) continue;
    EndAt(s, p);
    PopEnded(s);
    Refresh(s);
    return 1;
  }
  return 0;
}

void LoadTracker::Expire(WorkerId worker, int64_t now_ns) {
  State& s = workers_[worker];
  const int64_t cutoff = now_ns - max_prediction_age_ns_;
  bool changed = !s.timed.empty() && s.timed.front().time_ns < cutoff;
  DropTimedBefore(s, cutoff);
  while (!s.prefills.empty() && s.prefills.front().time_ns < cutoff) {
    if (s.prefills.front().open) EndAt(s, s.prefills.front());
    s.prefills.pop_front();
    PopEnded(s);
    changed = true;
  }
  if (changed) Refresh(s);
}

}  // namespace tandem::router
