#include "worker/worker_metrics.h"

#include <string>

namespace tandem::worker {

namespace {

std::vector<double> SecondsBuckets() {
  return MetricsRegistry::ExponentialBuckets(0.0001, 2.0, 21);  // 0.1 ms .. ~105 s
}
// A few blocks over shared memory take tens of microseconds; a large
// prompt over TCP takes seconds.
std::vector<double> TransferBuckets() {
  return MetricsRegistry::ExponentialBuckets(0.00002, 2.0, 23);  // 20 us .. ~84 s
}
// 0.3 is a boundary: the share of requests past the point where adding
// nodes stops paying is exact.
std::vector<double> RatioBuckets() {
  return {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0};
}

constexpr const char* kQuarantineHelp =
    "Quarantined KV reservations released, by what proved no write of theirs is outstanding "
    "(acknowledged: the prefiller's notice; peer_dead: the transport declared it dead)";
constexpr const char* kNoticeRefusedHelp =
    "KV notices refused without acting on them (wrong capability, unreadable, failed decryption)";

void Advance(prometheus::Counter& c, uint64_t now, uint64_t before) {
  if (now > before) c.Increment(static_cast<double>(now - before));
}

}  // namespace

WorkerMetrics::WorkerMetrics(MetricsRegistry& r)
    : kv_usage_(
          r.Gauge("tandem_kv_cache_usage_ratio", "Fraction of KV blocks in use (1 - free/total)")),
      growth_ratio_(r.Gauge("tandem_kv_growth_reserve_ratio",
                            "Share of the remaining max_tokens of the requests holding KV blocks "
                            "that a decoder's reservation leaves free (0: off)")),
      running_(r.Gauge("tandem_num_requests_running", "Requests in the engine's running batch")),
      waiting_(r.Gauge("tandem_num_requests_waiting", "Requests in the engine's waiting queue")),
      prefix_queries_(r.Counter("tandem_prefix_cache_queries_tokens_total",
                                "Prompt tokens looked up in the prefix cache")),
      prefix_hits_(r.Counter("tandem_prefix_cache_hits_tokens_total",
                             "Prompt tokens served by the prefix cache")),
      transfer_bytes_(r.Counter("tandem_kv_transfer_bytes_total", "KV bytes pushed to decoders")),
      preemptions_(r.Counter("tandem_preemptions_total", "Sequences preempted (recompute)")),
      transfer_seconds_(r.Histogram("tandem_kv_transfer_seconds",
                                    "Time to push one request's KV and notice", TransferBuckets())),
      overhead_ratio_(r.Histogram("tandem_kv_transfer_overhead_ratio",
                                  "KV transfer time over prefill compute time, per request",
                                  RatioBuckets())),
      prefill_seconds_(r.Histogram("tandem_prefill_seconds",
                                   "Prefill compute time per request (to the first token)",
                                   SecondsBuckets())),
      decode_step_seconds_(r.Histogram("tandem_decode_step_seconds",
                                       "Duration of one decode-only engine step",
                                       SecondsBuckets())),
      reservations_(r.Gauge("tandem_kv_reservations",
                            "Decoder reservations held (incl. ones awaiting a late notice)")),
      parked_(r.Gauge("tandem_kv_parked_prefills",
                      "Finished prefills whose blocks stay pinned until their push ends")),
      queued_(
          r.Gauge("tandem_prefill_queue_requests", "Requests in the prefiller's service queue")),
      leases_expired_(r.Counter("tandem_kv_lease_expired_total",
                                "Reservations freed because their KV never arrived")),
      stale_notices_(r.Counter("tandem_kv_stale_notices_total",
                               "KV notices ignored: stale generation or unknown reservation")),
      refused_(r.Counter("tandem_kv_reservations_refused_total",
                         "Reservations refused for lack of KV blocks or of a decode seat")),
      notice_refused_capability_(r.Counter("tandem_kv_notice_refused_total", kNoticeRefusedHelp,
                                           {{"reason", "capability"}})),
      notice_refused_unreadable_(r.Counter("tandem_kv_notice_refused_total", kNoticeRefusedHelp,
                                           {{"reason", "unreadable"}})),
      notice_refused_decrypt_(
          r.Counter("tandem_kv_notice_refused_total", kNoticeRefusedHelp, {{"reason", "decrypt"}})),
      quarantined_blocks_(r.Gauge("tandem_kv_quarantined_blocks",
                                  "KV blocks of expired reservations held until their prefiller "
                                  "confirms no write is outstanding or is declared dead")),
      quarantine_released_ack_(r.Counter("tandem_kv_quarantine_released_total", kQuarantineHelp,
                                         {{"reason", "acknowledged"}})),
      quarantine_released_dead_(r.Counter("tandem_kv_quarantine_released_total", kQuarantineHelp,
                                          {{"reason", "peer_dead"}})),
      checksum_failures_(r.Counter("tandem_kv_checksum_failures_total",
                                   "Requests whose pushed KV failed its end-to-end checksum (not "
                                   "decoded; prefilled again)")),
      stream_messages_(r.Counter("tandem_decode_stream_messages_total",
                                 "Messages sent on multiplexed decode streams (one per delivery "
                                 "batch, e.g. a decode step, per proxy)")),
      stream_items_(r.Counter("tandem_decode_stream_items_total",
                              "Per-request items (registered, tokens, finish, error) in the "
                              "messages of multiplexed decode streams")),
      seats_taken_(r.Gauge("tandem_decode_seats_taken",
                           "Decode seats taken: requests reserved or decoding on this decoder "
                           "(at most scheduler.max_num_seqs)")),
      seat_waiting_(r.Gauge("tandem_decode_seat_waiting",
                            "Reserve calls waiting for a decode seat or for KV blocks")),
      seat_waits_(r.Counter("tandem_decode_seat_waits_total",
                            "Reserve calls that waited for a decode seat")),
      kv_waits_(r.Counter("tandem_decode_kv_waits_total",
                          "Reserve calls that waited for KV blocks to come free (the prompt "
                          "fits the pool, but not its free blocks)")),
      registration_waits_(r.Counter("tandem_decode_registration_waits_total",
                                    "Reserve calls that came before their request's "
                                    "registration and waited for it")),
      unreceived_replies_(r.Counter("tandem_kv_reserve_replies_unreceived_total",
                                    "Reservations released because their Reserve reply never "
                                    "reached the prefiller (the call ended first, or the reply "
                                    "could not be sent)")),
      prefill_seat_waits_(r.Counter("tandem_prefill_reserve_seat_waits_total",
                                    "This prefiller's Reserve calls that a decoder held waiting "
                                    "for a decode seat (not counted in its admission budget "
                                    "while they wait)")),
      onboard_seconds_(
          r.Histogram("tandem_kv_tier_onboard_seconds",
                      "Time to onboard one prefix hit's host/disk-tier blocks into the "
                      "device tier",
                      TransferBuckets())),
      decoder_itl_(r, "tandem_decoder_inter_token_latency_seconds",
                   "Decoder: gap between consecutive hand-offs of one request's tokens to its "
                   "decode stream (the inter-token latency the decoder emits)",
                   MetricsRegistry::InterTokenBuckets()),
      reserve_wait_(r, "tandem_decode_reserve_wait_seconds",
                    "Decoder: how long a Reserve call that got its reservation waited for a decode "
                    "seat or KV blocks (0: reserved at once); the wait is in the request's TTFT",
                    SecondsBuckets()),
      registry_(r) {
  // Issue 22: the label sets known at start-up exist at zero.
  QueueTime("0", "default");
  Deficit("default");
  for (uint32_t t = 0; t < engine::kNumKvTiers; ++t) {
    const std::string tier(engine::KvTierName(static_cast<engine::KvTier>(t)));
    tier_usage_[t] = &r.Gauge("tandem_kv_tier_usage_ratio",
                              "Fraction of the KV tier's capacity holding blocks (0 when the tier is off)",
                              {{"tier", tier}});
    tier_hits_[t] = &r.Counter("tandem_kv_tier_hits_tokens_total",
                               "Prompt tokens of prefix hits, by the tier the blocks were found in",
                               {{"tier", tier}});
    tier_evictions_[t] = &r.Counter("tandem_kv_tier_evictions_total",
                                    "Blocks evicted from the KV tier (moved down, or dropped from the lowest)",
                                    {{"tier", tier}});
  }
}

void WorkerMetrics::ObserveOnboard(double seconds) { onboard_seconds_.Observe(seconds); }

namespace {
const std::string& TenantLabel(const std::string& tenant) {
  static const std::string kDefault = "default";
  return tenant.empty() ? kDefault : tenant;
}
}  // namespace

prometheus::Histogram& WorkerMetrics::QueueTime(const std::string& priority,
                                                const std::string& tenant) {
  std::lock_guard lock(labels_mu_);
  auto key = std::make_pair(priority, tenant);
  auto it = queue_time_.find(key);
  if (it == queue_time_.end()) {
    if (queue_time_.size() >= kMaxLabelSets) key = {"other", "other"};
    it = queue_time_.find(key);
    if (it == queue_time_.end()) {
      auto* h = &registry_.Histogram(
          "tandem_queue_time_seconds",
          "Time a request waited before its first engine step (a prefiller: from its service "
          "queue on), by priority and tenant",
          SecondsBuckets(), {{"priority", key.first}, {"tenant", key.second}});
      it = queue_time_.emplace(key, h).first;
    }
  }
  return *it->second;
}

prometheus::Gauge& WorkerMetrics::Deficit(const std::string& tenant) {
  std::lock_guard lock(labels_mu_);
  std::string key = tenant;
  auto it = deficit_.find(key);
  if (it == deficit_.end()) {
    if (deficit_.size() >= kMaxLabelSets) key = "other";
    it = deficit_.find(key);
    if (it == deficit_.end()) {
      auto* g = &registry_.Gauge(
          "tandem_fair_share_deficit_tokens",
          "Tokens a tenant with waiting work is behind its fair share in this worker's queues "
          "(weighted fair queueing within a priority band)",
          {{"tenant", key}});
      it = deficit_.emplace(key, g).first;
    }
  }
  return *it->second;
}

void WorkerMetrics::ObserveQueueTime(int32_t priority, const std::string& tenant,
                                     double seconds) {
  QueueTime(std::to_string(priority), TenantLabel(tenant)).Observe(seconds);
}

void WorkerMetrics::ObservePrefill(double prefill_seconds) { prefill_seconds_.Observe(prefill_seconds); }

void WorkerMetrics::ObserveTransfer(uint64_t bytes, double transfer_seconds, double prefill_seconds) {
  transfer_bytes_.Increment(static_cast<double>(bytes));
  transfer_seconds_.Observe(transfer_seconds);
  if (prefill_seconds > 0) overhead_ratio_.Observe(transfer_seconds / prefill_seconds);
}

void WorkerMetrics::ObserveDecodeStep(double seconds) { decode_step_seconds_.Observe(seconds); }

void WorkerMetrics::Update(const MetricsSample& s) {
  std::lock_guard lock(update_mu_);
  kv_usage_.Set(s.engine.kv_usage_ratio);
  growth_ratio_.Set(s.engine.growth_ratio);
  running_.Set(s.engine.num_running);
  waiting_.Set(s.engine.num_waiting);
  for (const auto& [tenant, tokens] : s.fair_share_deficit_tokens) {
    Deficit(TenantLabel(tenant)).Set(tokens);
  }
  reservations_.Set(s.decoder.reservations);
  parked_.Set(s.engine.num_parked);
  queued_.Set(s.queued_prefills);
  Advance(prefix_queries_, s.engine.prefix_query_tokens, last_.engine.prefix_query_tokens);
  Advance(prefix_hits_, s.engine.prefix_hit_tokens, last_.engine.prefix_hit_tokens);
  Advance(preemptions_, s.engine.preemptions, last_.engine.preemptions);
  Advance(leases_expired_, s.decoder.leases_expired, last_.decoder.leases_expired);
  Advance(stale_notices_, s.decoder.stale_notices, last_.decoder.stale_notices);
  Advance(refused_, s.decoder.reservations_refused, last_.decoder.reservations_refused);
  Advance(notice_refused_capability_, s.decoder.notices_refused_capability,
          last_.decoder.notices_refused_capability);
  Advance(notice_refused_unreadable_, s.decoder.notices_refused_unreadable,
          last_.decoder.notices_refused_unreadable);
  Advance(notice_refused_decrypt_, s.decoder.notices_refused_decrypt,
          last_.decoder.notices_refused_decrypt);
  quarantined_blocks_.Set(s.decoder.quarantined_blocks);
  Advance(quarantine_released_ack_, s.decoder.quarantine_released_ack,
          last_.decoder.quarantine_released_ack);
  Advance(quarantine_released_dead_, s.decoder.quarantine_released_dead,
          last_.decoder.quarantine_released_dead);
  Advance(checksum_failures_, s.decoder.checksum_failures, last_.decoder.checksum_failures);
  Advance(stream_messages_, s.decoder.stream_messages, last_.decoder.stream_messages);
  Advance(stream_items_, s.decoder.stream_items, last_.decoder.stream_items);
  seats_taken_.Set(s.decoder.seats_taken);
  seat_waiting_.Set(s.decoder.reserves_waiting);
  Advance(seat_waits_, s.decoder.reserve_waits, last_.decoder.reserve_waits);
  Advance(kv_waits_, s.decoder.kv_waits, last_.decoder.kv_waits);
  Advance(registration_waits_, s.decoder.registration_waits, last_.decoder.registration_waits);
  Advance(unreceived_replies_, s.decoder.unreceived_replies_released,
          last_.decoder.unreceived_replies_released);
  Advance(prefill_seat_waits_, s.prefill_seat_waits, last_.prefill_seat_waits);
  for (uint32_t t = 0; t < engine::kNumKvTiers; ++t) {
    tier_usage_[t]->Set(s.engine.tier_usage_ratio[t]);
    Advance(*tier_hits_[t], s.engine.tier_hit_tokens[t], last_.engine.tier_hit_tokens[t]);
    Advance(*tier_evictions_[t], s.engine.tier_evictions[t], last_.engine.tier_evictions[t]);
  }
  last_ = s;
}

}  // namespace tandem::worker
