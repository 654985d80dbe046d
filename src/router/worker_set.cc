#include "router/worker_set.h"

#include <algorithm>

#include "parallel/kv_compat.h"

namespace tandem::router {

std::string_view WorkerRoleName(WorkerRole role) {
  switch (role) {
    case WorkerRole::kPrefill: return "prefill";
    case WorkerRole::kDecode: return "decode";
    case WorkerRole::kBoth: return "both";
  }
  return "?";
}

uint32_t WorkerSet::Intern(std::vector<std::string>& table, const std::string& label) {
  auto it = std::find(table.begin(), table.end(), label);
  if (it != table.end()) return static_cast<uint32_t>(it - table.begin());
  table.push_back(label);
  return static_cast<uint32_t>(table.size() - 1);
}

Result<WorkerId> WorkerSet::Add(const WorkerInfo& info) {
  if (info.name.empty()) return InvalidArgumentError("worker name is empty");
  if (IdOf(info.name)) return AlreadyExistsError("worker '" + info.name + "' is already registered");
  WorkerId id = kNoWorker;
  for (WorkerId i = 0; i < kMaxWorkers; ++i) {
    if (!slots_[i]) {
      id = i;
      break;
    }
  }
  if (id == kNoWorker) {
    return ResourceExhaustedError("cannot add worker '" + info.name + "': the router holds at most " +
                                  std::to_string(kMaxWorkers) + " workers");
  }
  const LayoutKey key{std::max(1u, info.tensor_parallel), std::max(1u, info.pipeline_parallel),
                      info.num_layers, info.num_kv_heads};
  auto lit = std::find(layouts_.begin(), layouts_.end(), key);
  if (lit == layouts_.end()) {
    if (layouts_.size() == kMaxLayouts) {
      return ResourceExhaustedError("cannot add worker '" + info.name + "': the router holds at most " +
                                    std::to_string(kMaxLayouts) + " distinct rank layouts");
    }
    layouts_.push_back(key);
    lit = layouts_.end() - 1;
    // The new layout's row and column of the compatibility table.
    const uint32_t n = static_cast<uint32_t>(layouts_.size() - 1);
    auto compatible = [](const LayoutKey& p, const LayoutKey& d) {
      return parallel::KvLayoutsPairable({p.tp, p.pp}, {d.tp, d.pp},
                                           {.num_layers = p.layers, .num_kv_heads = p.kv_heads});
    };
    for (uint32_t j = 0; j <= n; ++j) {
      if (compatible(layouts_[n], layouts_[j])) compat_[n] |= uint64_t{1} << j;
      if (compatible(layouts_[j], layouts_[n])) compat_[j] |= uint64_t{1} << n;
    }
  }
  slots_[id] = Entry{info, Intern(nodes_, info.node), Intern(zones_, info.zone),
                     static_cast<uint32_t>(lit - layouts_.begin())};
  ids_.insert(std::lower_bound(ids_.begin(), ids_.end(), id), id);
  return id;
}

Status WorkerSet::Remove(WorkerId id) {
  if (id >= kMaxWorkers || !slots_[id]) return NotFoundError("no worker with id " + std::to_string(id));
  slots_[id].reset();
  ids_.erase(std::find(ids_.begin(), ids_.end(), id));
  return Status::Ok();
}

const WorkerSet::Entry* WorkerSet::Find(WorkerId id) const {
  return id < kMaxWorkers && slots_[id] ? &*slots_[id] : nullptr;
}

std::optional<WorkerId> WorkerSet::IdOf(std::string_view name) const {
  for (WorkerId id : ids_) {
    if (slots_[id]->info.name == name) return id;
  }
  return std::nullopt;
}

}  // namespace tandem::router
