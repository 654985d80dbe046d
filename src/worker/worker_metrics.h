// The worker metrics of DESIGN.md section 7, all registered (at zero) at
// start-up with the labels model, role and worker:
//   tandem_kv_cache_usage_ratio (gauge), tandem_num_requests_running,
//   tandem_num_requests_waiting (gauges),
//   tandem_prefix_cache_queries_tokens_total, tandem_prefix_cache_hits_tokens_total,
//   tandem_kv_transfer_bytes_total, tandem_preemptions_total (counters),
//   tandem_kv_transfer_seconds, tandem_kv_transfer_overhead_ratio,
//   tandem_prefill_seconds, tandem_decode_step_seconds (histograms),
// plus what shows that a worker is back to idle:
//   tandem_kv_reservations (gauge), tandem_kv_parked_prefills (gauge),
//   tandem_prefill_queue_requests (gauge),
//   tandem_kv_lease_expired_total, tandem_kv_stale_notices_total,
//   tandem_kv_reservations_refused_total (counters),
// and, for the KV plane's security (docs/security.md):
//   tandem_kv_notice_refused_total{reason} (counter; reason capability |
//   unreadable | decrypt): KV notices a decoder refused without acting on
//   them (decrypt: transport.encrypt and a pushed block failed its tag),
//   unreadable): KV notices a decoder refused without acting on them,
// and for the KV plane's reliability (docs/failure-handling.md):
//   tandem_kv_quarantined_blocks (gauge): blocks of expired reservations
//   held until their prefiller confirms no write is outstanding or is dead,
//   tandem_kv_quarantine_released_total{reason} (counter; reason
//   acknowledged | peer_dead), tandem_kv_checksum_failures_total (counter):
//   requests whose pushed KV failed its checksum (never decoded),
// and per KV tier (label tier = device | host | disk; docs/engine.md):
//   tandem_kv_tier_usage_ratio (gauge), tandem_kv_tier_hits_tokens_total,
//   tandem_kv_tier_evictions_total (counters), plus
//   tandem_kv_tier_onboard_seconds (histogram, no tier label),
// and for the multiplexed decode stream (issue 23, docs/decode-stream.md):
//   tandem_decode_stream_messages_total, tandem_decode_stream_items_total
// and for decode seats (docs/serving-workers.md "Decode seats"):
//   tandem_decode_seats_taken, tandem_decode_seat_waiting (gauges),
//   tandem_kv_growth_reserve_ratio (gauge: the engine's growth ratio, docs/engine.md
//   "Growth reserve"),
//   tandem_decode_seat_waits_total, tandem_decode_kv_waits_total
//   (counters: calls that waited for a seat, for KV blocks),
//   tandem_decode_registration_waits_total (counter: calls that came before
//   their request's registration and waited for it), and on a prefiller
//   tandem_prefill_reserve_seat_waits_total (counter): its Reserve calls a
//   decoder held waiting for a seat (framed transport),
// and tandem_decoder_inter_token_latency_seconds (histogram): the gaps
//   between a request's token hand-offs on a decoder (the ITL it emits),
// and tandem_kv_reserve_replies_unreceived_total (counter): reservations
// released because their Reserve reply never reached the prefiller
//   (counters): messages a decoder sent on its DecodeStreams (one per
//   delivery batch, e.g. a decode step) and the per-request items in them.
//
// Threads: Observe* and Update from any thread (Update: the worker's
// monitor tick and every scrape, docs/metrics.md).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/metrics.h"
#include "decoder/decoder.h"
#include "engine/engine.h"

namespace tandem::worker {

// Totals and levels sampled once per monitor tick.
struct MetricsSample {
  engine::EngineStats engine;
  decoder::DecoderCounts decoder;  // zero on a worker without a decoder
  uint32_t queued_prefills = 0;
  uint64_t prefill_seat_waits = 0;  // the prefiller's calls that waited
  // Per tenant: the engine's and the prefiller queue's fair-share deficits, summed.
  std::map<std::string, double> fair_share_deficit_tokens;
};

class WorkerMetrics {
 public:
  explicit WorkerMetrics(MetricsRegistry& registry);

  void ObservePrefill(double prefill_seconds);
  void ObserveTransfer(uint64_t bytes, double transfer_seconds, double prefill_seconds);
  void ObserveDecodeStep(double seconds);
  // Wall time of one onboarding from the host / disk tier (any thread).
  void ObserveOnboard(double seconds);
  // Issue 22 (docs/scheduling.md): tandem_queue_time_seconds{priority,tenant}.
  void ObserveQueueTime(int32_t priority, const std::string& tenant, double seconds);
  void Update(const MetricsSample& s);
  // Decoder: tandem_decoder_inter_token_latency_seconds, observed by the
  // Decoder on the engine's thread (DecoderOptions::inter_token_latency).
  HeldHistogram& decoder_itl() { return decoder_itl_; }
  // Decoder: tandem_decode_reserve_wait_seconds (DecoderOptions::reserve_wait).
  HeldHistogram& reserve_wait() { return reserve_wait_; }

 private:
  prometheus::Gauge& kv_usage_;
  prometheus::Gauge& growth_ratio_;
  prometheus::Gauge& running_;
  prometheus::Gauge& waiting_;
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_hits_;
  prometheus::Counter& transfer_bytes_;
  prometheus::Counter& preemptions_;
  prometheus::Histogram& transfer_seconds_;
  prometheus::Histogram& overhead_ratio_;
  prometheus::Histogram& prefill_seconds_;
  prometheus::Histogram& decode_step_seconds_;
  prometheus::Gauge& reservations_;
  prometheus::Gauge& parked_;
  prometheus::Gauge& queued_;
  prometheus::Counter& leases_expired_;
  prometheus::Counter& stale_notices_;
  prometheus::Counter& refused_;
  prometheus::Counter& notice_refused_capability_;
  prometheus::Counter& notice_refused_unreadable_;
  prometheus::Counter& notice_refused_decrypt_;
  prometheus::Gauge& quarantined_blocks_;
  prometheus::Counter& quarantine_released_ack_;
  prometheus::Counter& quarantine_released_dead_;
  prometheus::Counter& checksum_failures_;
  prometheus::Counter& stream_messages_;
  prometheus::Counter& stream_items_;
  prometheus::Gauge& seats_taken_;
  prometheus::Gauge& seat_waiting_;
  prometheus::Counter& seat_waits_;
  prometheus::Counter& kv_waits_;
  prometheus::Counter& registration_waits_;
  prometheus::Counter& unreceived_replies_;
  prometheus::Counter& prefill_seat_waits_;
  std::array<prometheus::Gauge*, engine::kNumKvTiers> tier_usage_{};
  std::array<prometheus::Counter*, engine::kNumKvTiers> tier_hits_{};
  std::array<prometheus::Counter*, engine::kNumKvTiers> tier_evictions_{};
  prometheus::Histogram& onboard_seconds_;
  HeldHistogram decoder_itl_;
  HeldHistogram reserve_wait_;
  // Label sets made on first use (the default tenant at priority 0 from
  // the start); past kMaxLabelSets, new ones count as "other".
  static constexpr size_t kMaxLabelSets = 64;
  MetricsRegistry& registry_;
  std::mutex labels_mu_;
  std::map<std::pair<std::string, std::string>, prometheus::Histogram*> queue_time_;  // guarded by labels_mu_
  std::map<std::string, prometheus::Gauge*> deficit_;  // guarded by labels_mu_
  prometheus::Histogram& QueueTime(const std::string& priority, const std::string& tenant);
  prometheus::Gauge& Deficit(const std::string& tenant);
  std::mutex update_mu_;
  MetricsSample last_;  // guarded by update_mu_: counters advance by the difference
};

}  // namespace tandem::worker
