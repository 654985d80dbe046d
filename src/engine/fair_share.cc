#include "engine/fair_share.h"

#include <algorithm>

namespace tandem::engine {

void FairShare::Enqueue(const std::string& tenant, double weight) {
  TenantState& t = tenants_[tenant];
  t.weight = weight > 0 ? weight : 1.0;
  t.virtual_time = std::max(t.virtual_time, system_time_);
}

void FairShare::Charge(const std::string& tenant, uint64_t tokens, uint64_t times) {
  TenantState& t = tenants_[tenant];
  for (uint64_t i = 0; i < times; ++i) t.virtual_time += static_cast<double>(tokens) / t.weight;
  served_[tenant] += tokens * times;
}

double FairShare::VirtualTime(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? system_time_ : it->second.virtual_time;
}

void FairShare::Picked(const std::string& tenant) {
  system_time_ = std::max(system_time_, VirtualTime(tenant));
}

bool FairShare::Before(const QueueKey& a, const QueueKey& b) const {
  if (a.priority != b.priority) return a.priority < b.priority;
  if (*a.tenant != *b.tenant) {
    const double va = VirtualTime(*a.tenant);
    const double vb = VirtualTime(*b.tenant);
    if (va != vb) return va < vb;
  }
  return a.arrival < b.arrival;
}

}  // namespace tandem::engine
