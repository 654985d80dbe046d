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

// A tenant's standing in one FairShare: what the order reads per item, by
// pointer (FairShare::Enqueue gives it; it lives as long as the FairShare:
// tenants are never forgotten), so a pass over a queue of many tenants
// compares numbers, not names (issue 23).
struct FairTenant {
  double weight = 1;
  double virtual_time = 0;
  uint64_t served = 0;  // tokens, total
};

// What the ordering needs of a queued item.
struct QueueKey {
  int32_t priority = 0;
  const FairTenant* tenant = nullptr;  // never null when given to FairShare
  uint64_t arrival = 0;                // smaller = earlier
};

class FairShare {
 public:
  // A tenant's item was queued; `weight` <= 0 counts as 1. Returns the
  // tenant's entry, for the item's QueueKey, Charge and Picked.
  FairTenant* Enqueue(const std::string& tenant, double weight);
  // The tenant was served `tokens` tokens, `times` times over (the virtual
  // time moves exactly as by `times` single charges).
  static void Charge(FairTenant& tenant, uint64_t tokens, uint64_t times = 1);
  double VirtualTime(const std::string& tenant) const;
  // The queue's virtual time: the largest virtual time of a tenant when it
  // was picked.
  double SystemTime() const { return system_time_; }
  // Marks `tenant` as served next (moves the system time forward).
  void Picked(const FairTenant& tenant);
  // Tokens served per tenant, totals.
  std::map<std::string, uint64_t> served() const;

  // Whether `a` is served before `b`.
  static bool Before(const QueueKey& a, const QueueKey& b);

  // The first item of [begin, end) in service order; `key(*it)` gives its
  // QueueKey. end when empty.
  template <class It, class KeyFn>
  static It PickNext(It begin, It end, KeyFn key) {
    return PickNextIf(begin, end, key, [](const auto&) { return true; });
  }

  // The first item of [begin, end) in service order among those for which
  // `eligible(*it)` holds; end when there is none.
  template <class It, class KeyFn, class Pred>
  static It PickNextIf(It begin, It end, KeyFn key, Pred eligible) {
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
  std::map<std::string, FairTenant> tenants_;  // node-based: entries never move
  double system_time_ = 0;
};

}  // namespace tandem::engine
