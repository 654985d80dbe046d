#include "proxy/fleet.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/config.h"
#include "parallel/kv_compat.h"

namespace tandem::proxy {

Fleet::Fleet(FleetRequirements req, std::unique_ptr<router::Router> router)
    : req_(std::move(req)), router_(std::move(router)) {}

Status Fleet::Register(const WorkerRecord& w) {
  auto refuse = [&](std::string what) {
    return FailedPreconditionError(fmt::format("worker '{}' refused: {}", w.name, what));
  };
  if (w.name.empty()) return InvalidArgumentError("a worker must have a name");
  if (w.protocol_version != req_.protocol_version) {
    return refuse(fmt::format("protocol version {} differs from the fleet's {}",
                              w.protocol_version, req_.protocol_version));
  }
  if (w.model != req_.model) {
    return refuse(fmt::format("model '{}' differs from the fleet's '{}'", w.model, req_.model));
  }
  if (w.revision != req_.revision) {
    return refuse(fmt::format("revision '{}' differs from the fleet's '{}'", w.revision,
                              req_.revision));
  }
  if (w.block_size != req_.block_size) {
    return refuse(fmt::format("block_size {} differs from the fleet's {}", w.block_size,
                              req_.block_size));
  }
  if (w.kv_dtype != req_.kv_dtype) {
    return refuse(fmt::format("KV dtype '{}' differs from the fleet's '{}'", w.kv_dtype,
                              req_.kv_dtype));
  }
  if (w.fleet_salt_fingerprint != req_.fleet_salt_fingerprint) {
    // Fingerprints only: the salt itself never travels (common/block_hash.h).
    return refuse(fmt::format(
        "fleet salt (cache.salt) differs from the fleet's (fingerprint {} vs {}); every process "
        "of a fleet must use the same salt: `tandem launch` makes a random one unless the fleet "
        "file sets cache.salt, and a worker joining by hand takes it from the launcher's state "
        "file (cache_salt) in the environment variable TANDEM_CACHE_SALT",
        w.fleet_salt_fingerprint.empty() ? "none" : w.fleet_salt_fingerprint,
        req_.fleet_salt_fingerprint.empty() ? "none" : req_.fleet_salt_fingerprint));
  }
  if (w.hash_root != req_.hash_root) {
    return refuse(fmt::format(
        "block-hash root {:016x} differs from the fleet's {:016x} although model, revision, "
        "block_size, KV dtype and fleet salt match (a tandem build with another hash function?)",
        w.hash_root, req_.hash_root));
  }
  for (const auto& [label, value] : {std::pair{"label 'node'", &w.node}, std::pair{"label 'zone'", &w.zone}}) {
    if (Status st = CheckRouterLabel(label, *value); !st.ok()) return refuse(st.message());
  }
  std::lock_guard lock(mu_);
  if (block_bytes_ != 0 && w.block_bytes != block_bytes_) {
    return refuse(fmt::format("KV block of {} bytes differs from the fleet's {} bytes",
                              w.block_bytes, block_bytes_));
  }
  if (auto old = router_->FindWorker(w.name)) {
    router_->RemoveWorker(*old).IgnoreError();
    names_.erase(*old);
  }
  router::WorkerInfo info;
  info.name = w.name;
  info.role = w.role;
  const auto& defaults = req_.role_labels[static_cast<size_t>(w.role)];
  info.node = w.node.empty() ? defaults.node : w.node;
  info.zone = w.zone.empty() ? defaults.zone : w.zone;
  info.epoch = w.epoch;
  info.num_blocks = w.num_blocks;
  info.decode_seats = w.decode_seats;
  info.block_bytes = w.block_bytes;
  info.tensor_parallel = std::max(1u, w.tensor_parallel);
  info.pipeline_parallel = std::max(1u, w.pipeline_parallel);
  info.num_layers = w.num_layers;
  info.num_kv_heads = w.num_kv_heads;
  auto id = router_->AddWorker(info);
  if (!id.ok()) return id.status();
  block_bytes_ = w.block_bytes;
  workers_[w.name] = w;
  workers_[w.name].indexed = false;  // until its new watch's snapshot lands
  names_[*id] = w.name;
  if (metrics_) metrics_->AddWorker(w.name, w.role, router_->policy());
  const parallel::ParallelLayout layout{info.tensor_parallel, info.pipeline_parallel};
  spdlog::info("worker {} ({}) joined at {} (node '{}', zone '{}', layout {})", w.name,
               router::WorkerRoleName(w.role), w.grpc_address, info.node, info.zone,
               parallel::ToString(layout));
  // Pairs the router will never form (issue 18): said once, at registration.
  for (const auto& [name, other] : workers_) {
    if (name == w.name) continue;
    const parallel::ParallelLayout other_layout{std::max(1u, other.tensor_parallel),
                                                std::max(1u, other.pipeline_parallel)};
    const parallel::ModelDims dims{.num_layers = w.num_layers, .num_kv_heads = w.num_kv_heads};
    auto explain = [&](const WorkerRecord& p, const parallel::ParallelLayout& pl,
                       const WorkerRecord& d, const parallel::ParallelLayout& dl) {
      if (p.role != router::WorkerRole::kPrefill || !router::CanDecode(d.role)) return;
      const std::string why = parallel::KvPairingRefusal(pl, dl, dims);
      if (!why.empty()) {
        spdlog::warn("prefiller {} will not be paired with decoder {}: {}", p.name, d.name, why);
      }
    };
    explain(w, layout, other, other_layout);
    explain(other, other_layout, w, layout);
  }
  return Status::Ok();
}

void Fleet::MarkIndexed(const std::string& name) {
  std::lock_guard lock(mu_);
  if (auto it = workers_.find(name); it != workers_.end()) it->second.indexed = true;
}

void Fleet::Remove(const std::string& name, bool expected) {
  std::lock_guard lock(mu_);
  if (workers_.erase(name) == 0) return;
  if (auto id = router_->FindWorker(name)) {
    router_->RemoveWorker(*id).IgnoreError();
    names_.erase(*id);
  }
  spdlog::log(expected ? spdlog::level::info : spdlog::level::warn, "worker {} left the fleet",
              name);
}

Result<RoutedPair> Fleet::Route(std::span<const uint64_t> hashes, uint32_t prompt_tokens,
                                const std::set<std::string>& exclude, double ttft_slo_ms,
                                uint32_t max_tokens) {
  // The router leaves the excluded workers out itself: one decision per
  // call. (Routing and dropping the decisions that landed on one used to
  // count each one's decode blocks until the decoder's next report: a few
  // retries on a 1-decoder fleet made it look full; docs/failure-handling.md
  // "Under load".)
  router::WorkerMask mask;
  bool refused = false;  // a worker that could take it is excluded
  for (const std::string& name : exclude) {
    if (auto id = router_->FindWorker(name)) {
      mask.Set(*id);
      refused = true;
    }
  }
  // A decision may still land on a worker that is leaving (out of workers_
  // already, not yet out of the router): then without it.
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto d = router_->Route(router::RouteRequest{hashes, prompt_tokens, ttft_slo_ms,
                                                 mask.Any() ? &mask : nullptr, max_tokens});
    if (!d.ok()) {
      if (metrics_) metrics_->CountError(router_->policy());
      if (refused) {
        return ResourceExhaustedError(fmt::format(
            "every worker that could take the request refused it ({})", d.status().message()));
      }
      return UnavailableError(fmt::format("no worker can take the request: {}",
                                          d.status().message()));
    }
    RoutedPair out;
    out.decision = *d;
    out.local = d->local_prefill;
    std::lock_guard lock(mu_);
    auto name_of = [&](router::WorkerId id) -> const WorkerRecord* {
      auto n = names_.find(id);
      if (n == names_.end()) return nullptr;
      auto w = workers_.find(n->second);
      return w == workers_.end() ? nullptr : &w->second;
    };
    const WorkerRecord* dec = name_of(d->decode);
    const WorkerRecord* pre = out.local ? dec : name_of(d->prefill);
    if (!dec || !pre) {
      router_->EndAttempt(d->prefill_ticket);  // not used: nothing of it reaches a worker
      if (!dec) mask.Set(d->decode);
      if (!pre) mask.Set(d->prefill);
      continue;
    }
    out.decode_name = dec->name;
    out.decode_address = dec->grpc_address;
    out.decode_reserve_address = dec->reserve_address;
    out.decode_waits_for_registration = dec->reserve_waits_for_registration;
    out.decode_takes_prompt_from_reserve = dec->takes_prompt_from_reserve;
    if (!out.local) {
      out.prefill_name = pre->name;
      out.prefill_address = pre->grpc_address;
    }
    if (metrics_) metrics_->CountDecision(*d, out.prefill_name, out.decode_name);
    if (spdlog::should_log(spdlog::level::debug)) {
      spdlog::debug("route prefill={} decode={} {}", out.local ? "-" : out.prefill_name,
                    out.decode_name, d->DebugString());
    }
    return out;
  }
  return ResourceExhaustedError("every worker that could take the request refused it");
}

std::optional<WorkerRecord> Fleet::Find(const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = workers_.find(name);
  if (it == workers_.end()) return std::nullopt;
  return it->second;
}

std::vector<WorkerRecord> Fleet::Workers() const {
  std::lock_guard lock(mu_);
  std::vector<WorkerRecord> out;
  for (const auto& [_, w] : workers_) out.push_back(w);
  return out;
}

}  // namespace tandem::proxy
