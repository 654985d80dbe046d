// SLO admission (issue 22; docs/scheduling.md, "Deadlines and SLOs").
//
// Every validated request gets its latency objectives: its own
// `ttft_slo_ms` / `tpot_slo_ms`, or the fleet's `proxy.slo` defaults. Under
// `proxy.admission: slo`, a request with a TTFT SLO whose best predicted
// TTFT over the fleet's pairs (router/ttft_predictor.h: the work queued
// ahead on each prefiller over its measured prefill rate, plus its own
// uncached tokens, onboarding and KV transfer) exceeds that SLO is refused
// at once with RESOURCE_EXHAUSTED (HTTP 429) and a retry-after of the
// predicted excess, rather than queued to miss it. Under `queue` (the
// default) nothing is refused for its SLO: it waits. In both modes the
// router leaves out prefillers predicted over the SLO while another one
// meets it (Router::Route). A prediction that cannot be made (a prefiller
// whose rate is not measured yet) admits. With `proxy.slo.attainment`, the
// recent prediction error at that quantile is added to the prediction
// first (proxy/ttft_calibration.h).
//
// Thread-safety: Admit may be called from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/block_hash.h"
#include "common/status.h"
#include "proxy/fleet.h"
#include "proxy/proxy_metrics.h"
#include "proxy/request.h"
#include "proxy/ttft_calibration.h"

namespace tandem::proxy {

enum class AdmissionMode { kQueue, kSlo };
// "queue" | "slo" (proxy.admission).
Result<AdmissionMode> ParseAdmissionMode(std::string_view name);

struct AdmissionVerdict {
  bool admit = true;
  double retry_after_seconds = 0;  // when refused: at least 1
};

// The decision alone. `predicted_ttft_ms`: the best pair's prediction
// (nullopt: unknown); `margin`: what calibration adds to it, as a fraction
// of the SLO (TtftCalibration::Margin). Refused only under kSlo, with an
// SLO, and a known prediction that with its margin is above the SLO;
// retry-after is that excess (the queue ahead must drain that long),
// rounded up to whole seconds, at least 1.
AdmissionVerdict DecideAdmission(AdmissionMode mode, uint32_t ttft_slo_ms,
                                 std::optional<double> predicted_ttft_ms, double margin = 0);

struct SloAdmissionOptions {
  AdmissionMode mode = AdmissionMode::kQueue;
  uint32_t default_ttft_ms = 0;  // proxy.slo.ttft_ms (0: none)
  uint32_t default_tpot_ms = 0;  // proxy.slo.tpot_ms (0: none)
  HashContext hash_context;      // the fleet's (a request's tenant salt is added)
  uint32_t block_size = 16;
  // Borrowed, may be null (no margin). Admit reads its margin; the request
  // lifecycle feeds it each admitted request's first token.
  TtftCalibration* calibration = nullptr;
};

class SloAdmission {
 public:
  // `fleet` and `metrics` (may be null) are borrowed.
  SloAdmission(SloAdmissionOptions options, Fleet* fleet, ProxyMetrics* metrics);

  // Fills the request's SLOs from the defaults where it set none, then
  // decides. RESOURCE_EXHAUSTED names the prediction, the margin, the SLO
  // and the key; `*retry_after_seconds` is set then (when not null). An
  // admitted request keeps its prediction (`predicted_ttft_ms`) for the
  // calibration.
  Status Admit(ValidatedRequest& request, double* retry_after_seconds);

  AdmissionMode mode() const { return options_.mode; }

 private:
  const SloAdmissionOptions options_;
  const uint64_t root_hash_;
  Fleet* const fleet_;
  ProxyMetrics* const metrics_;
};

}  // namespace tandem::proxy
