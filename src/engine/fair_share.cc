#include "engine/fair_share.h"

#include <algorithm>

namespace tandem::engine {

FairTenant* FairShare::Enqueue(const std::string& tenant, double weight) {
  FairTenant& t = tenants_[tenant];
  t.weight = weight > 0 ? weight : 1.0;
  t.virtual_time = std::max(t.virtual_time, system_time_);
  return &t;
}

void FairShare::Charge(FairTenant& t, uint64_t tokens, uint64_t times) {
  for (uint64_t i = 0; i < times; ++i) t.virtual_time += static_cast<double>(tokens) / t.weight;
  t.served += tokens * times;
}

double FairShare::VirtualTime(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? system_time_ : it->second.virtual_time;
}

void FairShare::Picked(const FairTenant& t) {
  system_time_ = std::max(system_time_, t.virtual_time);
}

std::map<std::string, uint64_t> FairShare::served() const {
  std::map<std::string, uint64_t> out;
  for (const auto& [name, t] : tenants_) out.emplace_hint(out.end(), name, t.served);
  return out;
}

bool FairShare::Before(const QueueKey& a, const QueueKey& b) {
  if (a.priority != b.priority) return a.priority < b.priority;
  if (a.tenant != b.tenant && a.tenant->virtual_time != b.tenant->virtual_time) {
    return a.tenant->virtual_time < b.tenant->virtual_time;
  }
  return a.arrival < b.arrival;
}

}  // namespace tandem::engine
