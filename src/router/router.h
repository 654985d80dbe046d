// Router: the KV-aware router of DESIGN.md section 5 as one object the proxy
// holds. It owns the worker registry, the prefix index, load tracking and
// the policies; it does no I/O. The proxy feeds it (worker membership, KV
// events and snapshots, load reports, all converted from protobuf to the
// plain structs of router/types.h) and asks it for a decision per request.
//
// Typical use by the proxy:
//   auto router = Router::Create(fleet.router, options).value();
//   WorkerId id = router->AddWorker(info).value();        // on Register
//   switch (router->ApplyEvent(id, event).value()) {       // on each KvEvent
//     case EventResult::kNeedsSnapshot: /* re-Watch with after_event_id 0 */
//   }
//   router->ApplySnapshot(id, epoch, last_id, hashes);     // on a snapshot
//   router->ApplyLoadReport(id, report);                   // on each LoadReport
//   RouteDecision d;  router->Route({hashes, n_tokens}, &d); // per request
//   router->EndPrefill(d.prefill_ticket);                  // its prefill is over
//   router->EndAttempt(d.prefill_ticket);                  // the attempt is over
//   router->RemoveWorker(id);                              // worker gone
//
// Thread-safety: every method may be called from any thread, concurrently.
// KV events and snapshots go to the prefix index (sharded locks, never the
// router mutex), so a flood of events does not stall routing. Membership,
// load reports and the choice itself take the router mutex briefly; Route
// reads the index before taking it. Counters are atomics.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "router/load_tracker.h"
#include "router/prefix_index.h"
#include "router/route_decision.h"
#include "router/router_options.h"
#include "router/scoring.h"
#include "router/tier_index.h"
#include "router/ttft_predictor.h"
#include "router/types.h"
#include "router/worker_set.h"

namespace tandem::router {

// A copy of the router's counters (the proxy exports them as metrics).
struct RouterCounters {
  std::array<uint64_t, kNumPolicies> routes{};        // decisions made, by policy
  std::array<uint64_t, kNumPolicies> route_errors{};  // no worker / no room, by policy
  uint64_t local_prefills = 0;        // decisions with local_prefill (aggregated or conditional)
  uint64_t conditional_local = 0;     // ... of them because the uncached part was short
  uint64_t hot_prefix_guards = 0;     // decisions where the guard ignored the cache
  uint64_t events_applied = 0;
  uint64_t events_ignored = 0;        // duplicate, stale epoch, awaiting snapshot
  uint64_t snapshots_requested = 0;   // kNeedsSnapshot returned
  uint64_t snapshots_applied = 0;
  uint64_t prefills_completed = 0;  // prefills ended by the prompt's stored event
  uint64_t prefills_ended = 0;      // ... by EndPrefill (before their stored event, or without one)
  uint64_t slo_steered = 0;         // decisions that left out prefillers predicted over the TTFT SLO
  uint64_t predictions_withdrawn = 0;  // decode predictions ended by EndAttempt before a report
  uint64_t room_by_report = 0;      // decisions whose decoder had room only by its last report
  uint64_t room_by_wait = 0;        // decisions whose decoder had no room now: its Reserve waits
  struct Worker {
    WorkerId id = kNoWorker;
    std::string name;
    uint64_t prefill_routes = 0;   // chosen as prefiller (not counting local prefills)
    uint64_t decode_routes = 0;    // chosen as decoder
    uint64_t local_routes = 0;     // chosen to prefill and decode
    uint64_t predicted_hit_blocks = 0;  // predicted cached blocks where the prefill runs
  };
  std::vector<Worker> workers;  // registered workers, by id
};

class Router {
 public:
  // InvalidArgument for an unknown policy or out-of-range numbers.
  static Result<std::unique_ptr<Router>> Create(const RouterConfig& config, RouterOptions options = {});

  // Membership. AddWorker registers the worker in the index with its epoch
  // and no cached blocks (the proxy then watches its events from the start
  // or asks for a snapshot), and sizes the index for the fleet's KV
  // capacity (PrefixIndex::Reserve).
  Result<WorkerId> AddWorker(const WorkerInfo& info);
  Status RemoveWorker(WorkerId id);
  std::optional<WorkerId> FindWorker(std::string_view name) const;
  // Changes whenever a worker is added or removed (after the change, with
  // release order): a caller may keep FindWorker's answer while it reads
  // the same value (issue 23: a Watch update per frame, without the router
  // mutex and a name lookup).
  uint64_t membership_generation() const {
    return membership_generation_.load(std::memory_order_acquire);
  }
  size_t num_workers() const;

  // KV events; see PrefixIndex for the rules. On kNeedsSnapshot the caller
  // asks the worker for a snapshot.
  Result<EventResult> ApplyEvent(WorkerId id, const KvEventView& event);
  // `host_hashes` / `disk_hashes`: the worker's lower-tier blocks.
  Result<EventResult> ApplySnapshot(WorkerId id, uint64_t epoch, uint64_t last_event_id,
                                    std::span<const uint64_t> hashes,
                                    std::span<const uint64_t> host_hashes = {},
                                    std::span<const uint64_t> disk_hashes = {});

  Status ApplyLoadReport(WorkerId id, const LoadReport& report);

  // Chooses the workers for one request and counts its predicted load on
  // them. `out`'s vectors are reused (no allocation once warm).
  Status Route(const RouteRequest& request, RouteDecision* out);
  Result<RouteDecision> Route(const RouteRequest& request);
  // The best predicted TTFT in ms of `request` over every pair it may take
  // (router/ttft_predictor.h), without routing it or counting any load.
  // nullopt when it cannot be predicted: a prefiller's rate is not
  // measured yet (an unknown prefiller may be fast), or no pair exists.
  std::optional<double> PredictTtftMs(const RouteRequest& request);
  // A worker's measured prefill rate in tokens/s (0: not measured yet).
  double prefill_rate(WorkerId id) const;
  // The prefill of a routed request is over: done (its reply, or for a
  // local prefill its first token), failed, or the decision was not used.
  // Its uncached tokens leave the worker's queue now rather than at its
  // stored event or after max_prediction_age. Idempotent; a ticket of a
  // worker that left is ignored.
  void EndPrefill(const PrefillTicket& ticket);
  // The attempt of a routed request is over: it finished, failed, was
  // abandoned (a retry, a migration, a cancel), or the decision was not
  // used. Ends its prefill as EndPrefill does, and its decode blocks and
  // running request stop counting on its decoder now if no load report has
  // replaced them yet (it holds nothing there any more, or the decoder's
  // next report shows what it still holds, e.g. a quarantined
  // reservation). Idempotent. `prefill_ended`: the caller already ended
  // its prefill (EndPrefill); then the call takes no lock when a report has
  // replaced the decode prediction already.
  void EndAttempt(const PrefillTicket& ticket, bool prefill_ended = false);

  // Switches the policy (experiments comparing policies on one fleet).
  void SetPolicy(Policy policy);
  Policy policy() const;

  RouterCounters counters() const;
  const PrefixIndex& index() const { return index_; }
  const TierIndex& tier_index() const { return tiers_; }
  // Effective load of a worker (report + predictions), for tests and debug.
  Result<WorkerLoad> load(WorkerId id) const;

 private:
  Router(const RouterConfig& config, Policy policy, RouterOptions options);
  int64_t Now() const;
  // AddWorker's part under mu_; sets *fleet_blocks to the registered
  // workers' KV capacity summed (the size the index reserves).
  Result<WorkerId> AddWorkerEntry(const WorkerInfo& info, uint64_t* fleet_blocks);
  // Fills candidates_ (with mu_ held) from the index's overlaps, leaving
  // out the workers in `exclude` (may be null).
  void BuildCandidatesLocked(const OverlapBlocks& overlap, const TierOverlap& lower, int64_t now,
                             const WorkerMask* exclude = nullptr);
  // Prefill rates by worker id, for router/ttft_predictor.h (with mu_ held).
  std::array<PrefillSpeed, kMaxWorkers> RatesLocked() const;
  // Each worker's mean seat hold in seconds (SeatTurnover). One not measured
  // yet (fewer than four seats given back since it joined or restarted)
  // gets the mean of the workers that are — the same model in the same
  // fleet: a better guess than none; 0 while none is (docs/router.md,
  // "Seat waits in the TTFT prediction").
  std::array<double, kMaxWorkers> HoldsLocked() const;
  double HoldLocked(WorkerId id) const;  // HoldsLocked()[id]
  double MeanHoldLocked() const;
  void EndPrefillLocked(const PrefillTicket& ticket);

  struct WorkerCounters {
    std::atomic<uint64_t> prefill_routes{0};
    std::atomic<uint64_t> decode_routes{0};
    std::atomic<uint64_t> local_routes{0};
    std::atomic<uint64_t> predicted_hit_blocks{0};
  };

  const RouterConfig config_;
  const RouterOptions options_;
  PrefixIndex index_;
  TierIndex tiers_;  // host/disk tiers of the workers that have them

  mutable std::mutex mu_;  // guards everything below up to the counters
  Policy policy_;
  WorkerSet workers_;
  LoadTracker loads_;
  PolicyState policy_state_;
  std::vector<Candidate> candidates_;  // scratch for Route, [workers]
  uint64_t next_ticket_ = 0;           // last PrefillTicket id handed out
  std::array<PrefillRate, kMaxWorkers> rates_;  // measured from load reports
  std::array<SeatTurnover, kMaxWorkers> turnover_;  // decoders' seat holds, from load reports

  std::array<std::atomic<uint64_t>, kNumPolicies> routes_{};
  std::array<std::atomic<uint64_t>, kNumPolicies> route_errors_{};
  std::atomic<uint64_t> membership_generation_{0};  // bumped under mu_
  std::atomic<uint64_t> local_prefills_{0};
  std::atomic<uint64_t> conditional_local_{0};
  std::atomic<uint64_t> hot_prefix_guards_{0};
  std::atomic<uint64_t> events_applied_{0};
  std::atomic<uint64_t> events_ignored_{0};
  std::atomic<uint64_t> snapshots_requested_{0};
  std::atomic<uint64_t> snapshots_applied_{0};
  std::array<WorkerCounters, kMaxWorkers> worker_counters_;
  // loads_.keyed_predictions mirrored (may be stale high, never stale low),
  // so ApplyEvent takes mu_ only when a stored event may complete a prefill.
  std::array<std::atomic<uint32_t>, kMaxWorkers> keyed_pending_{};
  std::atomic<uint64_t> prefills_completed_{0};
  std::atomic<uint64_t> prefills_ended_{0};
  std::atomic<uint64_t> slo_steered_{0};
  std::atomic<uint64_t> predictions_withdrawn_{0};
  // When each worker's last load report was applied (Now(); INT64_MIN:
  // none since it joined), so EndAttempt can tell without the mutex that a
  // report replaced a route's decode prediction.
  std::array<std::atomic<int64_t>, kMaxWorkers> report_ns_{};
  std::atomic<uint64_t> room_by_report_{0};
  std::atomic<uint64_t> room_by_wait_{0};
};

}  // namespace tandem::router
