#include "proxy/proxy_metrics.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace tandem::proxy {
namespace {

std::vector<double> TtftBuckets() {
  // Sub-millisecond (a cached prompt on an idle fleet) to ten minutes.
  return {0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15,
          0.2,     0.3,    0.5,   0.75,   1.0,   1.5,  2.0,   3.0,  5.0,   7.5,  10.0,
          20.0,    40.0,   80.0,  160.0,  320.0, 640.0};
}
// The decoders' emitted ITL has the same (tandem_decoder_inter_token_latency_seconds).
std::vector<double> ItlBuckets() { return MetricsRegistry::InterTokenBuckets(); }
std::vector<double> E2eBuckets() {
  return {0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0};
}

constexpr const char* kItlHelp =
    "Gap between consecutive tokens (every gap, also within one message)";
constexpr const char* kRequests = "tandem_requests_total";
constexpr const char* kRequestsHelp = "Requests finished, by outcome";

}  // namespace

// The open batch of this thread: sums per bucket as Histogram::Observe
// would count them (prometheus-cpp's bucket of v: the first boundary >= v,
// the last bucket +Inf).
struct TokenBatchState {
  int depth = 0;
  ProxyMetrics* metrics = nullptr;  // whose samples are held (one at a time)
  std::vector<uint64_t> itl_buckets;
  double itl_sum = 0;
  size_t itl_count = 0;
  size_t tokens = 0;

  // Adds the batch to its ProxyMetrics' held atomics: one add per bucket
  // touched (a step's gaps fall in one or two), not one per bucket with
  // the histogram's lock (ObserveMultiple: 41 buckets and the sum).
  void Apply() {
    if (metrics == nullptr) return;
    if (itl_count > 0) {
      for (size_t i = 0; i < itl_buckets.size(); ++i) {
        if (itl_buckets[i] == 0) continue;
        metrics->itl_held_.Add(i, itl_buckets[i]);
        itl_buckets[i] = 0;
      }
      metrics->itl_held_.AddSum(itl_sum);
    }
    if (tokens > 0) metrics->held_tokens_.fetch_add(tokens, std::memory_order_relaxed);
    itl_sum = 0;
    itl_count = 0;
    tokens = 0;
    metrics = nullptr;
  }
  // Holds samples of `m` from now (applies another's first).
  void Hold(ProxyMetrics* m, size_t num_buckets) {
    if (metrics == m) return;
    Apply();
    metrics = m;
    itl_buckets.assign(num_buckets, 0);
  }
};

TokenBatchState& BatchState() {
  thread_local TokenBatchState state;
  return state;
}

ProxyMetrics::ProxyMetrics(MetricsRegistry& r)
    : ttft(r.Histogram("tandem_time_to_first_token_seconds",
                       "First token at the client side of the proxy minus request arrival",
                       TtftBuckets())),
      itl(r.Histogram("tandem_inter_token_latency_seconds", kItlHelp, ItlBuckets())),
      tpot(r.Histogram("tandem_time_per_output_token_seconds",
                       "(e2e - TTFT) / (output tokens - 1)", ItlBuckets())),
      e2e(r.Histogram("tandem_e2e_request_latency_seconds", "Request arrival to last token",
                      E2eBuckets())),
      inflight(r.Gauge("tandem_requests_inflight", "Requests admitted and not finished")),
      ok(r.Counter(kRequests, kRequestsHelp, {{"outcome", "ok"}})),
      invalid(r.Counter(kRequests, kRequestsHelp, {{"outcome", "invalid"}})),
      rejected(r.Counter(kRequests, kRequestsHelp, {{"outcome", "rejected"}})),
      failed(r.Counter(kRequests, kRequestsHelp, {{"outcome", "failed"}})),
      cancelled(r.Counter(kRequests, kRequestsHelp, {{"outcome", "cancelled"}})),
      prompt_tokens(r.Counter("tandem_prompt_tokens_total", "Prompt tokens of admitted requests")),
      generation_tokens(
          r.Counter("tandem_generation_tokens_total", "Completion tokens sent to clients")),
      retries(r.Counter("tandem_request_retries_total",
                        "Requests re-routed after a worker refused or failed")),
      migrations(r.Counter("tandem_request_migrations_total",
                           "Requests moved to a new prefiller/decoder pair after their decoder "
                           "was lost mid-stream (prompt + tokens already sent re-prefilled)")),
      overhead_ratio_p50(r.Gauge("tandem_kv_transfer_overhead_ratio_recent_p50",
                                 "Median KV transfer time over prefill compute time of the "
                                 "last 64 disaggregated requests")),
      registry_(r),
      itl_held_(r, "tandem_inter_token_latency_seconds", kItlHelp, ItlBuckets()),
      overhead_check_({kOverheadWindow, kOverheadMinSamples, kOverheadWarnRatio,
                       std::chrono::seconds(60)}) {
  const char* kReasons[kNumRefusals] = {"ttft_slo", "max_inflight", "rate_limit", "deadline"};
  for (size_t i = 0; i < kNumRefusals; ++i) {
    refused[i] = &r.Counter("tandem_requests_refused_total",
                            "Requests refused, or dropped before their first token, by reason",
                            {{"reason", kReasons[i]}});
  }
  collect_hook_ = r.AddCollectHook([this] { FoldTokenMetrics(); });
}

ProxyMetrics::~ProxyMetrics() { registry_.RemoveCollectHook(collect_hook_); }

void ProxyMetrics::FoldTokenMetrics() {
  // Each atomic is taken whole; a batch adding meanwhile lands in this
  // fold or the next, never in neither.
  itl_held_.Fold();
  const uint64_t tokens = held_tokens_.exchange(0, std::memory_order_relaxed);
  if (tokens > 0) generation_tokens.Increment(static_cast<double>(tokens));
}

void ProxyMetrics::ObservePrefillTimes(const std::string& request_id, double prefill_seconds,
                                       double transfer_seconds) {
  if (!(prefill_seconds > 0) || transfer_seconds < 0) return;
  const auto warn = overhead_check_.Observe(transfer_seconds / prefill_seconds);
  overhead_ratio_p50.Set(overhead_check_.Median());
  if (warn) {
    spdlog::warn(
        "KV transfer overhead: median transfer/prefill time of the last {} requests is {:.2f} "
        "(above {:.1f}: the transfer eats the gain of disaggregation; check the transport, "
        "e.g. UCX falling back to TCP). Last request {}: prefill {:.4f} s, transfer {:.4f} s",
        overhead_check_.size(), *warn, kOverheadWarnRatio, request_id, prefill_seconds,
        transfer_seconds);
  }
}

void ProxyMetrics::ObserveItl(double seconds) {
  TokenBatchState& b = BatchState();
  if (b.depth == 0) {
    itl.Observe(seconds);
    return;
  }
  b.Hold(this, itl_held_.num_buckets());
  b.itl_buckets[itl_held_.BucketOf(seconds)] += 1;
  b.itl_sum += seconds;
  ++b.itl_count;
}

void ProxyMetrics::CountGenerationTokens(size_t n) {
  TokenBatchState& b = BatchState();
  if (b.depth == 0) {
    generation_tokens.Increment(static_cast<double>(n));
    return;
  }
  b.Hold(this, itl_held_.num_buckets());
  b.tokens += n;
}

TokenMetricsBatch::TokenMetricsBatch() { ++BatchState().depth; }

TokenMetricsBatch::~TokenMetricsBatch() {
  TokenBatchState& b = BatchState();
  if (--b.depth == 0) b.Apply();
}

void ProxyMetrics::CountOutcome(const std::string& outcome) {
  if (outcome == "ok") ok.Increment();
  else if (outcome == "invalid") invalid.Increment();
  else if (outcome == "rejected") rejected.Increment();
  else if (outcome == "cancelled") cancelled.Increment();
  else failed.Increment();
}

namespace {

constexpr const char* kDecisions = "tandem_router_decisions_total";
constexpr const char* kDecisionsHelp =
    "Router decisions by policy, side (prefill, decode, local: prefilled and decoded by one "
    "worker) and chosen worker";

std::string PolicyLabel(router::Policy p) { return std::string(router::PolicyName(p)); }

}  // namespace

RouterMetrics::RouterMetrics(MetricsRegistry& r, uint32_t block_size_tokens)
    : registry_(r),
      hot_prefix_guards_(r.Counter("tandem_router_hot_prefix_guards_total",
                                   "Decisions where the hot-prefix guard let load win over cache")),
      conditional_local_(r.Counter("tandem_router_conditional_local_prefills_total",
                                   "Decisions where the decoder prefills a short uncached part "
                                   "itself (conditional disaggregation)")),
      room_by_report_(r.Counter("tandem_router_room_by_report_total",
                                "Decisions whose decoder had room only by its last load report "
                                "(the routes since made it look full); its Reserve decides")),
      room_by_wait_(r.Counter("tandem_router_room_by_wait_total",
                              "Decisions whose decoder had no free room even by its last load "
                              "report: its pool holds the blocks and its Reserve waits for them")),
      seat_deferred_(r.Counter("tandem_router_seat_deferred_total",
                               "Decode candidates with KV room passed over because more of their "
                               "decode seats were taken (a higher seat round) than another's")),
      hit_tokens_(r.Histogram("tandem_router_predicted_prefix_hit_tokens",
                              "Prompt tokens the router predicts cached where the prefill runs",
                              {0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                               32768, 65536, 131072})),
      hit_ratio_(r.Histogram("tandem_router_predicted_prefix_hit_ratio",
                             "Predicted cached tokens over prompt tokens where the prefill runs",
                             {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0})),
      block_size_tokens_(block_size_tokens) {
  for (uint32_t i = 0; i < router::kNumPolicies; ++i) {
    const std::string policy = PolicyLabel(static_cast<router::Policy>(i));
    routes_[i] = &r.Counter("tandem_router_routes_total", "Requests routed, by policy",
                            {{"policy", policy}});
    errors_[i] = &r.Counter("tandem_router_route_errors_total",
                            "Route calls that found no worker (none of a role, no room), by policy",
                            {{"policy", policy}});
  }
}

prometheus::Counter& RouterMetrics::Decision(router::Policy policy, const char* side,
                                             const std::string& worker) {
  return registry_.Counter(kDecisions, kDecisionsHelp,
                           {{"policy", PolicyLabel(policy)}, {"side", side}, {"chosen_worker", worker}});
}

void RouterMetrics::AddWorker(const std::string& name, router::WorkerRole role,
                              router::Policy policy) {
  std::lock_guard lock(mu_);
  Series& s = workers_[{name, policy}];
  if (router::CanPrefill(role) && !s.prefill) s.prefill = &Decision(policy, "prefill", name);
  if (router::CanDecode(role) && !s.decode) s.decode = &Decision(policy, "decode", name);
  if (router::CanDecode(role) && !s.local) s.local = &Decision(policy, "local", name);
}

void RouterMetrics::CountDecision(const router::RouteDecision& d, const std::string& prefill_name,
                                  const std::string& decode_name) {
  const auto pi = static_cast<size_t>(d.policy);
  routes_[pi]->Increment();
  if (d.hot_prefix_prefill || d.hot_prefix_decode) hot_prefix_guards_.Increment();
  if (d.conditional_local) conditional_local_.Increment();
  if (d.room_by_report) room_by_report_.Increment();
  if (d.room_by_wait) room_by_wait_.Increment();
  if (d.seat_deferred > 0) seat_deferred_.Increment(d.seat_deferred);
  const double hit = static_cast<double>(d.prefill_overlap_blocks) * block_size_tokens_;
  hit_tokens_.Observe(hit);
  if (d.prompt_tokens > 0) hit_ratio_.Observe(hit / d.prompt_tokens);

  std::lock_guard lock(mu_);
  auto series = [&](const std::string& name) -> Series& { return workers_[{name, d.policy}]; };
  if (d.local_prefill) {
    Series& s = series(decode_name);
    if (!s.local) s.local = &Decision(d.policy, "local", decode_name);
    s.local->Increment();
    return;
  }
  Series& p = series(prefill_name);
  if (!p.prefill) p.prefill = &Decision(d.policy, "prefill", prefill_name);
  p.prefill->Increment();
  Series& s = series(decode_name);
  if (!s.decode) s.decode = &Decision(d.policy, "decode", decode_name);
  s.decode->Increment();
}

void RouterMetrics::CountError(router::Policy policy) {
  errors_[static_cast<size_t>(policy)]->Increment();
}

}  // namespace tandem::proxy
