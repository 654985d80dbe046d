// The proxy's metrics (DESIGN.md section 7): latency histograms measured at
// the client side of the proxy, request outcomes and in-flight count. Every
// series exists from start-up. Definitions: docs/metrics.md.
#pragma once

#include <string>

#include "common/metrics.h"

namespace tandem::proxy {

struct ProxyMetrics {
  explicit ProxyMetrics(MetricsRegistry& registry);

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
  // Median of the KV transfer overhead ratio (transfer / prefill compute)
  // over the last kOverheadWindow disaggregated requests.
  prometheus::Gauge& overhead_ratio_p50;

  // Counts one finished request under its outcome.
  void CountOutcome(const std::string& outcome);

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
  RecentMedianCheck overhead_check_;
};

}  // namespace tandem::proxy
