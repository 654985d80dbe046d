// The proxy's metrics (DESIGN.md section 7): latency histograms measured at
// the client side of the proxy, request outcomes and in-flight count. Every
// series exists from start-up. Definitions: docs/metrics.md.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "router/route_decision.h"

namespace tandem::proxy {

// Why a request was refused or dropped before its first token
// (tandem_requests_refused_total{reason}; docs/metrics.md):
//   ttft_slo      its predicted TTFT exceeded its SLO (proxy.admission: slo)
//   max_inflight  proxy.max_inflight requests were in flight
//   rate_limit    its tenant's request or token rate
//   deadline      its deadline passed while it waited (dropped before any compute)
enum class Refusal { kTtftSlo, kMaxInflight, kRateLimit, kDeadline };
inline constexpr size_t kNumRefusals = 4;

struct ProxyMetrics {
  explicit ProxyMetrics(MetricsRegistry& registry);
  ~ProxyMetrics();
  ProxyMetrics(const ProxyMetrics&) = delete;
  ProxyMetrics& operator=(const ProxyMetrics&) = delete;

  prometheus::Histogram& ttft;  // first token at the client side minus arrival
  prometheus::Histogram& itl;   // every gap between consecutive tokens
  prometheus::Histogram& tpot;  // (e2e - ttft) / (output tokens - 1)
  prometheus::Histogram& e2e;
  prometheus::Gauge& inflight;
  prometheus::Counter& ok;
  prometheus::Counter& invalid;     // rejected input
  prometheus::Counter& rejected;    // queues full, no worker
  prometheus::Counter& failed;      // failed after admission
  prometheus::Counter& cancelled;   // by the client or its deadline
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generation_tokens;
  prometheus::Counter& retries;     // re-routed after a worker refused or failed
  prometheus::Counter& migrations;  // moved to a new pair after the decoder was lost mid-stream
  // Median of the KV transfer overhead ratio (transfer / prefill compute)
  // over the last kOverheadWindow disaggregated requests.
  prometheus::Gauge& overhead_ratio_p50;

  // Counts one finished request under its outcome.
  void CountOutcome(const std::string& outcome);

  // The token path's metrics: one inter-token gap, and completion tokens
  // sent. Inside a TokenMetricsBatch on this thread they are summed there
  // and, when it ends, added to per-bucket atomics (one add per bucket the
  // batch touched, no lock); every collection of the registry (scrape,
  // Render, the planner's RunCollectHooks) first folds those into `itl` and
  // `generation_tokens` (FoldTokenMetrics), so what it shows is exactly
  // one Observe / Increment per token. Outside a batch: at once.
  void ObserveItl(double seconds);
  void CountGenerationTokens(size_t n);
  // Moves what the batches added since the last fold into `itl` and
  // `generation_tokens`. Any thread (the registry's collect hook).
  void FoldTokenMetrics();
  std::array<prometheus::Counter*, kNumRefusals> refused{};
  void CountRefusal(Refusal reason) { refused[static_cast<size_t>(reason)]->Increment(); }

  // The prefiller's timings of one request (PrefillResponse): feeds the
  // recent median of the overhead ratio and logs a warning, at most once a
  // minute, while that median is above kOverheadWarnRatio (past it, adding
  // nodes stops paying: DESIGN.md section 1). Any thread.
  void ObservePrefillTimes(const std::string& request_id, double prefill_seconds,
                           double transfer_seconds);

  static constexpr double kOverheadWarnRatio = 0.3;
  static constexpr size_t kOverheadWindow = 64;
  static constexpr size_t kOverheadMinSamples = 8;

 private:
  friend class TokenMetricsBatch;
  friend struct TokenBatchState;
  MetricsRegistry& registry_;
  size_t collect_hook_ = 0;
  // What ended batches added, not folded yet: `itl`'s samples (the same
  // series, folded by its own collect hook as well) and tokens.
  HeldHistogram itl_held_;
  std::atomic<uint64_t> held_tokens_{0};
  RecentMedianCheck overhead_check_;
};

// A delivery batch of the token path (the decode stream's step, as read):
// the ITL samples and token counts of ProxyMetrics made on this thread
// while it is open are applied at its end, before the next batch is read.
// Nests (the outermost applies). Thread: the one that opened it.
class TokenMetricsBatch {
 public:
  TokenMetricsBatch();
  ~TokenMetricsBatch();
  TokenMetricsBatch(const TokenMetricsBatch&) = delete;
  TokenMetricsBatch& operator=(const TokenMetricsBatch&) = delete;
};

// The router's decisions (docs/router.md, "Observability"). Label names
// avoid the registry's constant `role` and `worker` (the proxy's own):
//   tandem_router_decisions_total{policy, side=prefill|decode|local, chosen_worker}
//   tandem_router_routes_total{policy}, tandem_router_route_errors_total{policy}
//   tandem_router_hot_prefix_guards_total, tandem_router_conditional_local_prefills_total,
//   tandem_router_room_by_report_total, tandem_router_room_by_wait_total,
//   tandem_router_seat_deferred_total
//   tandem_router_predicted_prefix_hit_tokens / _ratio (histograms): the
//     cached prefix the index predicts where the prefill runs.
// Per-policy series exist from start-up; a worker's series from its
// registration. Any thread.
class RouterMetrics {
 public:
  RouterMetrics(MetricsRegistry& registry, uint32_t block_size_tokens);

  // Creates the worker's decision series under `policy` (at zero).
  void AddWorker(const std::string& name, router::WorkerRole role, router::Policy policy);
  // `prefill_name` is ignored for a local prefill.
  void CountDecision(const router::RouteDecision& d, const std::string& prefill_name,
                     const std::string& decode_name);
  void CountError(router::Policy policy);

 private:
  struct Series {
    prometheus::Counter* prefill = nullptr;
    prometheus::Counter* decode = nullptr;
    prometheus::Counter* local = nullptr;
  };
  prometheus::Counter& Decision(router::Policy policy, const char* side, const std::string& worker);

  MetricsRegistry& registry_;
  std::array<prometheus::Counter*, router::kNumPolicies> routes_{};
  std::array<prometheus::Counter*, router::kNumPolicies> errors_{};
  prometheus::Counter& hot_prefix_guards_;
  prometheus::Counter& conditional_local_;
  prometheus::Counter& room_by_report_;
  prometheus::Counter& room_by_wait_;
  prometheus::Counter& seat_deferred_;
  prometheus::Histogram& hit_tokens_;
  prometheus::Histogram& hit_ratio_;
  const uint32_t block_size_tokens_;
  std::mutex mu_;
  std::map<std::pair<std::string, router::Policy>, Series> workers_;  // guarded by mu_
};

}  // namespace tandem::proxy
