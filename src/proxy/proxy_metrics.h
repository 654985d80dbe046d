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

  // Counts one finished request under its outcome.
  void CountOutcome(const std::string& outcome);
};

}  // namespace tandem::proxy
