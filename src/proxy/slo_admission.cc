#include "proxy/slo_admission.h"

#include <fmt/format.h>

#include <cmath>

namespace tandem::proxy {

Result<AdmissionMode> ParseAdmissionMode(std::string_view name) {
  if (name == "queue") return AdmissionMode::kQueue;
  if (name == "slo") return AdmissionMode::kSlo;
  return InvalidArgumentError(fmt::format("proxy.admission must be queue or slo, got '{}'", name));
}

AdmissionVerdict DecideAdmission(AdmissionMode mode, uint32_t ttft_slo_ms,
                                 std::optional<double> predicted_ttft_ms, double margin) {
  AdmissionVerdict v;
  if (mode != AdmissionMode::kSlo || ttft_slo_ms == 0 || !predicted_ttft_ms) return v;
  const double late = *predicted_ttft_ms + margin * ttft_slo_ms;
  if (late <= ttft_slo_ms) return v;
  v.admit = false;
  v.retry_after_seconds = std::max(1.0, std::ceil((late - ttft_slo_ms) / 1e3));
  return v;
}

SloAdmission::SloAdmission(SloAdmissionOptions options, Fleet* fleet, ProxyMetrics* metrics)
    : options_(std::move(options)),
      root_hash_(RootHash(options_.hash_context)),
      fleet_(fleet),
      metrics_(metrics) {}

Status SloAdmission::Admit(ValidatedRequest& r, double* retry_after_seconds) {
  if (r.ttft_slo_ms == 0) r.ttft_slo_ms = options_.default_ttft_ms;
  if (r.tpot_slo_ms == 0) r.tpot_slo_ms = options_.default_tpot_ms;
  if (options_.mode != AdmissionMode::kSlo || r.ttft_slo_ms == 0) return Status::Ok();
  uint64_t root = root_hash_;
  if (!r.tenant_salt.empty()) {
    HashContext ctx = options_.hash_context;
    ctx.tenant_salt = r.tenant_salt;
    root = RootHash(ctx);
  }
  // Kept with the request: routing uses them (the prompt is hashed once).
  r.block_hashes = HashBlocks(root, r.prompt_ids, options_.block_size);
  r.block_hashes_root = root;
  r.block_hashes_block_size = options_.block_size;
  const std::optional<double> predicted = fleet_->router().PredictTtftMs(
      router::RouteRequest{r.block_hashes, static_cast<uint32_t>(r.prompt_ids.size()),
                           static_cast<double>(r.ttft_slo_ms), nullptr, r.max_tokens});
  TtftCalibration* const cal = options_.calibration;
  const double margin = cal != nullptr ? cal->Margin(TtftCalibration::Clock::now()) : 0;
  const AdmissionVerdict v = DecideAdmission(options_.mode, r.ttft_slo_ms, predicted, margin);
  if (v.admit) {
    if (predicted) r.predicted_ttft_ms = *predicted;
    return Status::Ok();
  }
  if (metrics_) metrics_->CountRefusal(Refusal::kTtftSlo);
  if (retry_after_seconds != nullptr) *retry_after_seconds = v.retry_after_seconds;
  std::string with_margin;
  if (margin != 0) {
    with_margin = fmt::format(
        " ({:.0f} ms with the recent prediction error at the {:g}th percentile, "
        "proxy.slo.attainment)",
        *predicted + margin * r.ttft_slo_ms, 100 * cal->attainment());
  }
  return ResourceExhaustedError(fmt::format(
      "the predicted time to first token is {:.0f} ms on the best worker pair{}, over the "
      "request's TTFT SLO of {} ms (proxy.admission: slo); retry after {:.0f} s",
      *predicted, with_margin, r.ttft_slo_ms, v.retry_after_seconds));
}

}  // namespace tandem::proxy
