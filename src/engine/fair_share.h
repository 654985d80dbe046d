// Priority bands and weighted fair queueing on tokens between tenants
// (issue 22, docs/scheduling.md). One instance per queue: the engine's
// waiting list and the prefiller's service queue each keep one.
//
// Order of service: the lowest priority value first (as vLLM: lower =
// earlier); within a band, the tenant with the least virtual time (tokens
// served / weight) first; within a tenant, the earliest arrival first.
// Charge() adds the tokens a tenant was served (prefill + decode). A tenant
// that becomes active again starts at the queue's current virtual time
// (start-time fair queueing), so an idle tenant banks no credit.
//
// Thread-safety: none; the owner calls it under its own lock.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>

namespace tandem::engine {

// What the ordering needs of a queued item.
struct QueueKey {
  int32_t priority = 0;
  const std::string* tenant = nullptr;  // never null when given to FairShare
  uint64_t arrival = 0;                 // smaller = earlier
};

class FairShare {
 public:
  // A tenant's item was queued; `weight` <= 0 counts as 1.
  void Enqueue(const std::string& tenant, double weight);
  // The tenant was served `tokens` tokens, `times` times over (one lookup
  // for a run of sequences of one tenant; the virtual time moves exactly as
  // by `times` single charges).
  void Charge(const std::string& tenant, uint64_t tokens, uint64_t times = 1);
  double VirtualTime(const std::string& tenant) const;
  // The queue's virtual time: the largest virtual time of a tenant when it
  // was picked.
  double SystemTime() const { return system_time_; }
  // Marks `tenant` as served next (moves the system time forward).
  void Picked(const std::string& tenant);
  // Tokens served per tenant, totals.
  const std::map<std::string, uint64_t>& served() const { return served_; }

  // Whether `a` is served before `b`.
  bool Before(const QueueKey& a, const QueueKey& b) const;

  // The first item of [begin, end) in service order; `key(*it)` gives its
  // QueueKey. end when empty.
  template <class It, class KeyFn>
  It PickNext(It begin, It end, KeyFn key) const {
    return PickNextIf(begin, end, key, [](const auto&) { return true; });
  }

  // The first item of [begin, end) in service order among those for which
  // `eligible(*it)` holds; end when there is none.
  template <class It, class KeyFn, class Pred>
  It PickNextIf(It begin, It end, KeyFn key, Pred eligible) const {
    It best = end;
    QueueKey best_key;
    for (It it = begin; it != end; ++it) {
      if (!eligible(*it)) continue;
      QueueKey k = key(*it);
      if (best == end || Before(k, best_key)) {
        best = it;
        best_key = k;
      }
    }
    return best;
  }

 private:
  struct TenantState {
    double weight = 1;
    double virtual_time = 0;
  };
  std::map<std::string, TenantState> tenants_;
  std::map<std::string, uint64_t> served_;
  double system_time_ = 0;
};

}  // namespace tandem::engine
