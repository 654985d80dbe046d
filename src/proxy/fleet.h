// The proxy's view of the fleet: registered workers with their addresses,
// the KV-aware router fed by their KV events and load reports, and the
// compatibility rule every worker must pass to join.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "proxy/proxy_metrics.h"
#include "router/router.h"

namespace tandem::proxy {

// What the proxy needs from a worker's WorkerInfo (plain mirror of the proto).
struct WorkerRecord {
  std::string name;
  router::WorkerRole role = router::WorkerRole::kBoth;
  std::string grpc_address;
  std::string reserve_address;  // issue 23: WorkerInfo.reserve_address (decoders; "" = none)
  // Session 38: WorkerInfo.reserve_waits_for_registration (decoders): the
  // Prefill may go out with the decode start (docs/decode-stream.md).
  bool reserve_waits_for_registration = false;
  // Session 39: WorkerInfo.takes_prompt_from_reserve (decoders): the decode
  // start names the prompt by length and digest (docs/decode-stream.md).
  bool takes_prompt_from_reserve = false;
  std::string metrics_address;
  uint32_t protocol_version = 0;
  std::string model;
  std::string revision;
  uint32_t block_size = 0;
  std::string kv_dtype;
  std::string fleet_salt_fingerprint;  // FleetSaltFingerprint of its cache.salt
  uint64_t hash_root = 0;              // RootHash of its hash context, tenant salt empty
  uint64_t block_bytes = 0;
  uint32_t num_blocks = 0;
  uint32_t decode_seats = 0;  // WorkerInfo.decode_seats (0: unknown)
  uint64_t epoch = 0;
  std::string node;
  std::string zone;
  // Its rank layout (issue 18; 0 from an older worker reads as 1) and the
  // model dimensions the layout splits (router::WorkerInfo).
  uint32_t tensor_parallel = 1;
  uint32_t pipeline_parallel = 1;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  // Its KV snapshot is in the router's index (MarkIndexed); false from each
  // registration until the snapshot of its watch stream has been applied.
  bool indexed = false;
};

// What every worker of this fleet must match.
struct FleetRequirements {
  uint32_t protocol_version = 1;
  std::string model;
  std::string revision;
  uint32_t block_size = 16;
  std::string kv_dtype = "f32";
  // From the same HashContextFromFleet as the workers' (proxy_server.cc).
  std::string fleet_salt_fingerprint;
  uint64_t hash_root = 0;
  // Router labels for a worker that registers without its own `node` /
  // `zone` (the fleet file's role sections), by role: prefill, decode, both.
  struct Labels {
    std::string node, zone;
  };
  std::array<Labels, 3> role_labels;
};

struct RoutedPair {
  std::string prefill_name;  // empty when local
  std::string prefill_address;
  std::string decode_name;
  std::string decode_address;
  std::string decode_reserve_address;  // issue 23: its framed Reserve listener ("" = none)
  bool decode_waits_for_registration = false;  // session 38: its WorkerRecord's
  bool decode_takes_prompt_from_reserve = false;  // session 39: its WorkerRecord's
  bool local = false;
  router::RouteDecision decision;
};

class Fleet {
 public:
  Fleet(FleetRequirements req, std::unique_ptr<router::Router> router);

  // Checks compatibility (model, revision, block size, dtype, fleet salt
  // fingerprint, block-hash root, protocol, and block bytes equal to the
  // fleet's first worker's) and registers. A worker whose rank layout
  // cannot exchange KV with some registered workers of the other side is
  // still registered (the router never pairs those; parallel/kv_compat.h)
  // and the log names each such pair and why. A
  // worker re-registering under its name replaces the old entry.
  // FAILED_PRECONDITION says what differs.
  Status Register(const WorkerRecord& w);
  // `expected`: the worker closed its watch itself, or this proxy is
  // shutting down (logged at info; a lost worker at warning).
  void Remove(const std::string& name, bool expected = false);
  // The worker's snapshot has been applied to the router (no-op for an
  // unknown name).
  void MarkIndexed(const std::string& name);

  // Chooses workers for a prompt's block hashes; `exclude` names workers
  // not to use (e.g. a decoder that just refused). UNAVAILABLE when no live
  // worker of a needed role exists; RESOURCE_EXHAUSTED when only excluded
  // ones could take it. The caller ends the pair's prefill with
  // router().EndPrefill(decision.prefill_ticket) once it is over, and the
  // attempt with router().EndAttempt(decision.prefill_ticket) once that is.
  // `ttft_slo_ms` (0: none): prefillers predicted over it are left out while
  // another one meets it (router/ttft_predictor.h). `max_tokens` (0:
  // unknown): a decoder's growth reserve keeps a share of it free.
  Result<RoutedPair> Route(std::span<const uint64_t> hashes, uint32_t prompt_tokens,
                           const std::set<std::string>& exclude = {}, double ttft_slo_ms = 0,
                           uint32_t max_tokens = 0);

  // Counts every decision and error from now on (null: none). Call before
  // workers register (their series are created then).
  void SetMetrics(RouterMetrics* metrics) { metrics_ = metrics; }

  router::Router& router() { return *router_; }
  std::optional<WorkerRecord> Find(const std::string& name) const;
  std::vector<WorkerRecord> Workers() const;
  const FleetRequirements& requirements() const { return req_; }

 private:
  const FleetRequirements req_;
  std::unique_ptr<router::Router> router_;
  RouterMetrics* metrics_ = nullptr;
  mutable std::mutex mu_;
  std::map<std::string, WorkerRecord> workers_;  // guarded by mu_
  std::map<router::WorkerId, std::string> names_;  // guarded by mu_
  uint64_t block_bytes_ = 0;                     // guarded by mu_; 0 until the first worker
};

}  // namespace tandem::proxy
