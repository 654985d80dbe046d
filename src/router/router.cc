#include "router/router.h"

#include <chrono>
#include <algorithm>
#include <cmath>

namespace tandem::router {
namespace {

Status CheckPositive(double v, const char* name) {
  if (!(v > 0) || !std::isfinite(v)) {
    return InvalidArgumentError(std::string("router option ") + name + " must be a positive number, got " +
                                std::to_string(v));
  }
  return Status::Ok();
}

Status CheckNonNegative(double v, const char* name) {
  if (!(v >= 0) || !std::isfinite(v)) {
    return InvalidArgumentError(std::string("router option ") + name + " must be >= 0, got " + std::to_string(v));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Router>> Router::Create(const RouterConfig& config, RouterOptions options) {
  TANDEM_ASSIGN_OR_RETURN(Policy policy, ParsePolicy(config.policy));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(config.prefill_weight, "router.prefill_weight"));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(config.temperature, "router.temperature"));
  if (options.block_size_tokens == 0) return InvalidArgumentError("router option block_size_tokens must be > 0");
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(options.hot_prefix_threshold, "hot_prefix_threshold"));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(options.hot_prefix_min_load_blocks, "hot_prefix_min_load_blocks"));
  TANDEM_RETURN_IF_ERROR(CheckPositive(options.same_node_bandwidth_bytes_per_s, "same_node_bandwidth_bytes_per_s"));
  TANDEM_RETURN_IF_ERROR(CheckPositive(options.cross_node_bandwidth_bytes_per_s, "cross_node_bandwidth_bytes_per_s"));
  TANDEM_RETURN_IF_ERROR(CheckPositive(options.cross_zone_bandwidth_bytes_per_s, "cross_zone_bandwidth_bytes_per_s"));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(options.transfer_cost_per_ms, "transfer_cost_per_ms"));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(options.host_tier_onboard_cost, "host_tier_onboard_cost"));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative(options.disk_tier_onboard_cost, "disk_tier_onboard_cost"));
  if (options.report_lag_ns < 0 || options.max_prediction_age_ns <= 0) {
    return InvalidArgumentError("router options report_lag_ns must be >= 0 and max_prediction_age_ns > 0");
  }
  return std::unique_ptr<Router>(new Router(config, policy, std::move(options)));
}

Router::Router(const RouterConfig& config, Policy policy, RouterOptions options)
    : config_(config),
      options_(std::move(options)),
      policy_(policy),
      loads_(options_.report_lag_ns, options_.max_prediction_age_ns),
      policy_state_(options_.seed) {
  candidates_.reserve(kMaxWorkers);
}

int64_t Router::Now() const {
  if (options_.clock) return options_.clock();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Result<WorkerId> Router::AddWorker(const WorkerInfo& info) {
  uint64_t fleet_blocks = 0;  // the registered workers' KV capacity
  TANDEM_ASSIGN_OR_RETURN(WorkerId id, AddWorkerEntry(info, &fleet_blocks));
  // Outside the router mutex: growing the tables must not hold up Route.
  index_.Reserve(fleet_blocks);
  return id;
}

Result<WorkerId> Router::AddWorkerEntry(const WorkerInfo& info, uint64_t* fleet_blocks) {
  std::lock_guard lock(mu_);
  TANDEM_ASSIGN_OR_RETURN(WorkerId id, workers_.Add(info));
  if (Status st = index_.AddWorker(id, info.epoch); !st.ok()) {
    workers_.Remove(id).IgnoreError();
    return st;
  }
  membership_generation_.fetch_add(1, std::memory_order_release);
  loads_.Reset(id, info.num_blocks);
  report_ns_[id].store(INT64_MIN, std::memory_order_relaxed);
  rates_[id].Reset();
  turnover_[id].Reset();
  tiers_.Replace(id, info.epoch, {}, {});
  keyed_pending_[id].store(0, std::memory_order_relaxed);
  WorkerCounters& c = worker_counters_[id];
  c.prefill_routes = 0;
  c.decode_routes = 0;
  c.local_routes = 0;
  c.predicted_hit_blocks = 0;
  for (WorkerId w : workers_.ids()) *fleet_blocks += workers_.Find(w)->info.num_blocks;
  return id;
}

Status Router::RemoveWorker(WorkerId id) {
  // The index scan runs first and outside the router mutex, so routing goes
  // on meanwhile (the worker stays a candidate, with a shrinking cache).
  // Its id is released only afterwards, so AddWorker cannot reuse it while
  // the index still holds it.
  TANDEM_RETURN_IF_ERROR(index_.RemoveWorker(id));
  tiers_.Clear(id);
  std::lock_guard lock(mu_);
  Status st = workers_.Remove(id);
  membership_generation_.fetch_add(1, std::memory_order_release);
  return st;
}

std::optional<WorkerId> Router::FindWorker(std::string_view name) const {
  std::lock_guard lock(mu_);
  return workers_.IdOf(name);
}

size_t Router::num_workers() const {
  std::lock_guard lock(mu_);
  return workers_.size();
}

Result<EventResult> Router::ApplyEvent(WorkerId id, const KvEventView& event) {
  Result<EventResult> r = index_.Apply(id, event);
  if (r.ok() && (*r == EventResult::kApplied || *r == EventResult::kNeedsSnapshot)) {
    tiers_.SetEpoch(id, event.epoch);  // a restarted worker's lower tiers are forgotten too
    if (*r == EventResult::kApplied && (event.tier != KvTier::kDevice || event.kind == KvEventKind::kCleared)) {
      tiers_.Apply(id, event.kind, event.tier, event.hashes);
    }
  }
  if (r.ok() && *r == EventResult::kApplied && event.kind == KvEventKind::kStored &&
      event.tier == KvTier::kDevice && id < kMaxWorkers &&
      keyed_pending_[id].load(std::memory_order_relaxed) > 0) {
    // A prompt's last full block stored: its prefill is done there.
    std::lock_guard lock(mu_);
    if (workers_.Find(id)) {
      if (loads_.Complete(id, event.hashes) > 0) prefills_completed_.fetch_add(1, std::memory_order_relaxed);
      keyed_pending_[id].store(loads_.keyed_predictions(id), std::memory_order_relaxed);
    }
  }
  if (r.ok()) {
    switch (*r) {
      case EventResult::kApplied: events_applied_.fetch_add(1, std::memory_order_relaxed); break;
      case EventResult::kNeedsSnapshot: snapshots_requested_.fetch_add(1, std::memory_order_relaxed); break;
      default: events_ignored_.fetch_add(1, std::memory_order_relaxed); break;
    }
  }
  return r;
}

Result<EventResult> Router::ApplySnapshot(WorkerId id, uint64_t epoch, uint64_t last_event_id,
                                          std::span<const uint64_t> hashes,
                                          std::span<const uint64_t> host_hashes,
                                          std::span<const uint64_t> disk_hashes) {
  Result<EventResult> r = index_.ApplySnapshot(id, epoch, last_event_id, hashes);
  if (r.ok() && *r == EventResult::kApplied) {
    tiers_.Replace(id, epoch, host_hashes, disk_hashes);
    snapshots_applied_.fetch_add(1, std::memory_order_relaxed);
  }
  return r;
}

Status Router::ApplyLoadReport(WorkerId id, const LoadReport& report) {
  std::lock_guard lock(mu_);
  if (!workers_.Find(id)) return NotFoundError("no worker with id " + std::to_string(id));
  const int64_t now = Now();
  loads_.ApplyReport(id, report, now);
  report_ns_[id].store(now, std::memory_order_relaxed);
  rates_[id].Update(report.prefill_tokens_total, report.prefill_seconds_total,
                    report.prefill_attention_pairs_total, report.prefill_pair_cost);
  turnover_[id].Update(report.seats_released_total, report.seat_seconds_total);
  keyed_pending_[id].store(loads_.keyed_predictions(id), std::memory_order_relaxed);
  return Status::Ok();
}

Status Router::Route(const RouteRequest& request, RouteDecision* out) {
  const uint32_t bs = options_.block_size_tokens;
  out->prefill_ticket = {};
  if (request.prompt_tokens == 0) return InvalidArgumentError("prompt is empty");
  if (request.block_hashes.size() > request.prompt_tokens / bs) {
    return InvalidArgumentError("request has " + std::to_string(request.block_hashes.size()) +
                                " block hashes but its " + std::to_string(request.prompt_tokens) +
                                " tokens fill at most " + std::to_string(request.prompt_tokens / bs) +
                                " blocks of " + std::to_string(bs));
  }
  OverlapBlocks overlap;  // [kMaxWorkers]
  index_.Overlap(request.block_hashes, &overlap);
  TierOverlap lower;      // host/disk blocks after each worker's device overlap
  tiers_.Extend(request.block_hashes, overlap, &lower);

  std::lock_guard lock(mu_);
  const int64_t now = Now();
  BuildCandidatesLocked(overlap, lower, now, request.exclude);
  const TtftInputs ttft_in{request.prompt_tokens, (request.prompt_tokens + bs - 1) / bs, bs,
                           request.max_tokens};
  const std::array<PrefillSpeed, kMaxWorkers> rates = RatesLocked();
  uint32_t slo_excluded = 0;
  if (request.ttft_slo_ms > 0) {
    // Leave out the prefillers predicted over the SLO, while one meets it
    // (or cannot be predicted yet).
    std::array<std::optional<double>, kMaxWorkers> ms;
    PredictPerPrefiller(candidates_, rates, HoldsLocked(), ttft_in, options_,
                        std::span(ms).first(candidates_.size()), workers_.layout_compat());
    bool any_meets = false;
    for (size_t i = 0; i < candidates_.size(); ++i) {
      if (CanPrefill(candidates_[i].role) && (!ms[i] || *ms[i] <= request.ttft_slo_ms)) any_meets = true;
    }
    if (any_meets) {
      size_t n = 0;
      for (size_t i = 0; i < candidates_.size(); ++i) {
        Candidate c = candidates_[i];
        if (ms[i] && *ms[i] > request.ttft_slo_ms) {
          ++slo_excluded;
          if (c.role == WorkerRole::kPrefill) continue;  // it cannot decode either
          c.role = WorkerRole::kDecode;                  // a 'both' worker may still decode
        }
        candidates_[n++] = c;
      }
      candidates_.resize(n);
    }
  }
  const ScoringParams params{policy_,
                             config_.prefill_weight,
                             config_.temperature,
                             config_.local_prefill_threshold_tokens,
                             &options_,
                             workers_.layout_compat(),
                             request.max_tokens};
  const size_t pi = static_cast<size_t>(policy_);
  if (Status st = Score(candidates_, request.prompt_tokens, params, &policy_state_, out); !st.ok()) {
    route_errors_[pi].fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  out->slo_excluded = slo_excluded;
  out->predicted_ttft_ms = -1;
  {
    const Candidate* p = nullptr;
    const Candidate* d = nullptr;
    for (const Candidate& c : candidates_) {
      if (c.id == out->prefill) p = &c;
      if (c.id == out->decode) d = &c;
    }
    if (p != nullptr && d != nullptr) {
      if (auto t = PairTtftMs(*p, *d, rates[p->id], HoldLocked(d->id), ttft_in, options_)) {
        out->predicted_ttft_ms = *t;
      }
    }
  }
  if (slo_excluded > 0) slo_steered_.fetch_add(1, std::memory_order_relaxed);
  if (out->room_by_report) room_by_report_.fetch_add(1, std::memory_order_relaxed);
  if (out->room_by_wait) room_by_wait_.fetch_add(1, std::memory_order_relaxed);

  // Count the request on its workers: its prefill until that ends
  // (EndPrefill, its stored event, or age), its decode blocks and running
  // request until the workers' reports do (or EndAttempt, before them).
  const int64_t prompt_tokens = request.prompt_tokens;
  const int64_t new_blocks = std::max<int64_t>(0, int64_t{out->prompt_blocks} - out->decode_overlap_blocks);
  PrefillWork work;
  work.ticket = ++next_ticket_;
  work.tokens = std::max<int64_t>(0, prompt_tokens - int64_t{out->prefill_overlap_blocks} * bs);
  // Keyed by the prompt's last full block: its stored event ends the
  // prefill (LoadTracker::Complete). No key when that block is already
  // cached there (nothing will be stored).
  const bool all_cached = out->prefill_overlap_blocks >= request.block_hashes.size();
  work.key = request.block_hashes.empty() || all_cached ? 0 : request.block_hashes.back();
  // The decoder's reserve grows by the request's own share from its
  // reservation (or local admission) on; its next report counts it.
  const LoadDelta decode_delta{new_blocks, 1,
                               OwnGrowthBlocks(loads_.load(out->decode).growth_ratio,
                                               request.prompt_tokens, request.max_tokens, bs)};
  if (out->local_prefill) {
    // A local prefill waits in the engine, not in a prefill queue that the
    // worker reports; the decode side counts the running request.
    loads_.AddPrefill(out->decode, work, now);
  } else {
    work.reported_tokens = prompt_tokens;  // a prefiller reports a waiting request's whole prompt
    work.running = 1;
    loads_.AddPrefill(out->prefill, work, now);
  }
  loads_.Predict(out->decode, decode_delta, now, work.ticket);
  out->prefill_ticket = {out->prefill, work.ticket, out->decode, now};
  if (work.key != 0) {
    keyed_pending_[out->prefill].store(loads_.keyed_predictions(out->prefill), std::memory_order_relaxed);
  }

  routes_[pi].fetch_add(1, std::memory_order_relaxed);
  if (out->hot_prefix_prefill || out->hot_prefix_decode) hot_prefix_guards_.fetch_add(1, std::memory_order_relaxed);
  if (out->local_prefill) {
    local_prefills_.fetch_add(1, std::memory_order_relaxed);
    if (out->conditional_local) conditional_local_.fetch_add(1, std::memory_order_relaxed);
    worker_counters_[out->decode].local_routes.fetch_add(1, std::memory_order_relaxed);
  } else {
    worker_counters_[out->prefill].prefill_routes.fetch_add(1, std::memory_order_relaxed);
    worker_counters_[out->decode].decode_routes.fetch_add(1, std::memory_order_relaxed);
  }
  worker_counters_[out->prefill].predicted_hit_blocks.fetch_add(out->prefill_overlap_blocks,
                                                                std::memory_order_relaxed);
  return Status::Ok();
}

void Router::BuildCandidatesLocked(const OverlapBlocks& overlap, const TierOverlap& lower, int64_t now,
                                   const WorkerMask* exclude) {
  candidates_.clear();
  for (WorkerId id : workers_.ids()) {
    if (exclude != nullptr && exclude->Test(id)) continue;
    const WorkerSet::Entry& e = *workers_.Find(id);
    loads_.Expire(id, now);
    const double held = static_cast<double>(index_.HeldBlocks(id));
    candidates_.push_back(Candidate{id, e.info.role, e.node_id, e.zone_id, e.info.block_bytes, loads_.load(id),
                                    overlap[id], lower.host[id] + lower.disk[id],
                                    lower.host[id] * std::max(0.0, 1.0 - options_.host_tier_onboard_cost) +
                                        lower.disk[id] * std::max(0.0, 1.0 - options_.disk_tier_onboard_cost),
                                    e.info.num_blocks ? held / e.info.num_blocks : held, e.layout_id,
                                    e.info.decode_seats, e.info.num_blocks});
  }
}

std::array<double, kMaxWorkers> Router::HoldsLocked() const {
  std::array<double, kMaxWorkers> h{};
  for (WorkerId id : workers_.ids()) h[id] = turnover_[id].hold_seconds();
  const double prior = MeanHoldLocked();
  for (WorkerId id : workers_.ids()) {
    if (h[id] == 0) h[id] = prior;
  }
  return h;
}

double Router::HoldLocked(WorkerId id) const {
  const double own = turnover_[id].hold_seconds();
  return own > 0 ? own : MeanHoldLocked();
}

double Router::MeanHoldLocked() const {
  double sum = 0;
  uint32_t n = 0;
  for (WorkerId id : workers_.ids()) {
    if (const double h = turnover_[id].hold_seconds(); h > 0) {
      sum += h;
      ++n;
    }
  }
  return n == 0 ? 0 : sum / n;
}

std::array<PrefillSpeed, kMaxWorkers> Router::RatesLocked() const {
  std::array<PrefillSpeed, kMaxWorkers> r{};
  for (WorkerId id : workers_.ids()) r[id] = rates_[id].speed();
  return r;
}

std::optional<double> Router::PredictTtftMs(const RouteRequest& request) {
  const uint32_t bs = options_.block_size_tokens;
  if (request.prompt_tokens == 0 || request.block_hashes.size() > request.prompt_tokens / bs) return std::nullopt;
  OverlapBlocks overlap;
  index_.Overlap(request.block_hashes, &overlap);
  TierOverlap lower;
  tiers_.Extend(request.block_hashes, overlap, &lower);
  std::lock_guard lock(mu_);
  BuildCandidatesLocked(overlap, lower, Now());
  const TtftInputs in{request.prompt_tokens, (request.prompt_tokens + bs - 1) / bs, bs,
                      request.max_tokens};
  std::array<std::optional<double>, kMaxWorkers> ms;
  PredictPerPrefiller(candidates_, RatesLocked(), HoldsLocked(), in, options_,
                      std::span(ms).first(candidates_.size()), workers_.layout_compat());
  std::optional<double> best;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (!CanPrefill(candidates_[i].role)) continue;
    if (!ms[i]) return std::nullopt;  // unknown: it may be the fast one
    if (!best || *ms[i] < *best) best = ms[i];
  }
  return best;
}

double Router::prefill_rate(WorkerId id) const {
  std::lock_guard lock(mu_);
  if (id >= kMaxWorkers || !workers_.Find(id)) return 0;
  return rates_[id].tokens_per_s();
}

void Router::EndPrefill(const PrefillTicket& ticket) {
  if (ticket.id == 0 || ticket.worker >= kMaxWorkers) return;
  std::lock_guard lock(mu_);
  EndPrefillLocked(ticket);
}

void Router::EndPrefillLocked(const PrefillTicket& ticket) {
  if (!workers_.Find(ticket.worker)) return;
  if (loads_.End(ticket.worker, ticket.id)) prefills_ended_.fetch_add(1, std::memory_order_relaxed);
  keyed_pending_[ticket.worker].store(loads_.keyed_predictions(ticket.worker), std::memory_order_relaxed);
}

void Router::EndAttempt(const PrefillTicket& ticket, bool prefill_ended) {
  if (ticket.id == 0) return;
  const bool prefill = !prefill_ended && ticket.worker < kMaxWorkers;
  // A report received report_lag_ns after the route replaced the decode
  // prediction (LoadTracker::ApplyReport): then there is nothing to withdraw
  // and, with the prefill ended, no need for the mutex.
  const bool decode = ticket.decode < kMaxWorkers &&
                      report_ns_[ticket.decode].load(std::memory_order_relaxed) <
                          ticket.time_ns + options_.report_lag_ns;
  if (!prefill && !decode) return;
  std::lock_guard lock(mu_);
  if (prefill) EndPrefillLocked(ticket);
  if (decode && workers_.Find(ticket.decode) && loads_.Withdraw(ticket.decode, ticket.id)) {
    predictions_withdrawn_.fetch_add(1, std::memory_order_relaxed);
  }
}

Result<RouteDecision> Router::Route(const RouteRequest& request) {
  RouteDecision d;
  TANDEM_RETURN_IF_ERROR(Route(request, &d));
  return d;
}

void Router::SetPolicy(Policy policy) {
  std::lock_guard lock(mu_);
  policy_ = policy;
}

Policy Router::policy() const {
  std::lock_guard lock(mu_);
  return policy_;
}

Result<WorkerLoad> Router::load(WorkerId id) const {
  std::lock_guard lock(mu_);
  if (!workers_.Find(id)) return NotFoundError("no worker with id " + std::to_string(id));
  return loads_.load(id);
}

RouterCounters Router::counters() const {
  RouterCounters c;
  for (uint32_t i = 0; i < kNumPolicies; ++i) {
    c.routes[i] = routes_[i].load(std::memory_order_relaxed);
    c.route_errors[i] = route_errors_[i].load(std::memory_order_relaxed);
  }
  c.local_prefills = local_prefills_.load(std::memory_order_relaxed);
  c.conditional_local = conditional_local_.load(std::memory_order_relaxed);
  c.hot_prefix_guards = hot_prefix_guards_.load(std::memory_order_relaxed);
  c.events_applied = events_applied_.load(std::memory_order_relaxed);
  c.events_ignored = events_ignored_.load(std::memory_order_relaxed);
  c.snapshots_requested = snapshots_requested_.load(std::memory_order_relaxed);
  c.snapshots_applied = snapshots_applied_.load(std::memory_order_relaxed);
  c.prefills_completed = prefills_completed_.load(std::memory_order_relaxed);
  c.prefills_ended = prefills_ended_.load(std::memory_order_relaxed);
  c.slo_steered = slo_steered_.load(std::memory_order_relaxed);
  c.predictions_withdrawn = predictions_withdrawn_.load(std::memory_order_relaxed);
  c.room_by_report = room_by_report_.load(std::memory_order_relaxed);
  c.room_by_wait = room_by_wait_.load(std::memory_order_relaxed);
  std::lock_guard lock(mu_);
  for (WorkerId id : workers_.ids()) {
    const WorkerCounters& wc = worker_counters_[id];
    c.workers.push_back({id, workers_.Find(id)->info.name, wc.prefill_routes.load(std::memory_order_relaxed),
                         wc.decode_routes.load(std::memory_order_relaxed),
                         wc.local_routes.load(std::memory_order_relaxed),
                         wc.predicted_hit_blocks.load(std::memory_order_relaxed)});
  }
  return c;
}

}  // namespace tandem::router
