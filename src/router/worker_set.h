// WorkerSet: the router's registry of workers. Assigns each a small dense
// WorkerId (the lowest free one) and interns its node and zone labels into
// small integers so that topology checks in the scoring loop are integer
// compares.
//
// Thread-safety: none. Router owns one and calls it under its mutex.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "router/types.h"

namespace tandem::router {

class WorkerSet {
 public:
  struct Entry {
    WorkerInfo info;
    uint32_t node_id = 0;  // interned info.node ("" is its own value)
    uint32_t zone_id = 0;  // interned info.zone
    uint32_t layout_id = 0;  // interned (tp, pp, layers, kv heads); row of layout_compat()
  };

  // AlreadyExists for a name in use; ResourceExhausted past kMaxWorkers;
  // InvalidArgument for an empty name; ResourceExhausted past
  // kMaxLayouts distinct rank layouts.
  Result<WorkerId> Add(const WorkerInfo& info);
  Status Remove(WorkerId id);

  const Entry* Find(WorkerId id) const;
  std::optional<WorkerId> IdOf(std::string_view name) const;

  // Registered ids, ascending.
  const std::vector<WorkerId>& ids() const { return ids_; }
  size_t size() const { return ids_.size(); }

  // Rank layouts (issue 18): bit d of row p is set when a prefiller of
  // layout p may send KV to a decoder of layout d
  // (parallel::KvLayoutsPairable). Rows exist for every layout_id handed
  // out; the table only grows.
  static constexpr uint32_t kMaxLayouts = 64;
  const uint64_t* layout_compat() const { return compat_.data(); }

 private:
  static uint32_t Intern(std::vector<std::string>& table, const std::string& label);

  std::array<std::optional<Entry>, kMaxWorkers> slots_;
  std::vector<WorkerId> ids_;
  std::vector<std::string> nodes_;
  std::vector<std::string> zones_;
  struct LayoutKey {
    uint32_t tp, pp, layers, kv_heads;
    bool operator==(const LayoutKey&) const = default;
  };
  std::vector<LayoutKey> layouts_;
  std::array<uint64_t, kMaxLayouts> compat_{};
};

}  // namespace tandem::router
