#include "proxy/frontend.h"

#include <fmt/format.h>

#include <random>

namespace tandem::proxy {

Frontend::Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight,
                   std::unique_ptr<Tenants> tenants)
    : limits_(std::move(limits)),
      deps_([this, d = std::move(deps)]() mutable {
        d.defer_launch = [this](std::function<void()> job) { work_->Submit(std::move(job)); };
        return std::move(d);
      }()),
      max_inflight_(max_inflight),
      tenants_(std::move(tenants)),
      work_(std::make_unique<WorkPool>(WorkPool::DefaultThreads())) {
  if (!tenants_) tenants_ = std::move(Tenants::Parse("", "", "")).value();
}

Frontend::Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight,
                   std::string api_key)
    : Frontend(std::move(limits), deps, max_inflight,
               std::move(Tenants::Parse(api_key, "", "")).value()) {}

RateRefusal Frontend::ChargeRequest(const Tenant* tenant) {
  if (tenant == nullptr) return {};
  RateRefusal r = tenants_->ChargeRequest(*tenant);
  if (!r.status.ok() && deps_.metrics) deps_.metrics->CountRefusal(Refusal::kRateLimit);
  return r;
}

Result<ValidatedRequest> Frontend::Validate(ClientRequest req, const Tenant* tenant,
                                            double* retry_after_seconds) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  const std::optional<int32_t> priority = req.priority;
  auto v = ValidateRequest(
      std::move(req), limits_,
      [this](std::string_view text) { return deps_.tokenizer->Encode(text, true); }, rng());
  if (!v.ok()) return v;
  if (tenant != nullptr) {
    v->tenant_salt = tenant->cache_salt;
    v->tenant = tenant->name;
    v->tenant_weight = tenant->weight;
    if (!priority) {
      v->priority = tenant->priority;
    } else if (tenant->min_priority && *priority < *tenant->min_priority) {
      return InvalidArgumentError(fmt::format(
          "priority is {}; tenant '{}' may ask for {} at the lowest (lower values are served "
          "earlier; min_priority in security.api_keys_file)",
          *priority, tenant->name, *tenant->min_priority));
    }
  }
  // Refused for its SLO before its tokens are charged to the tenant.
  if (slo_) TANDEM_RETURN_IF_ERROR(slo_->Admit(*v, retry_after_seconds));
  if (tenant == nullptr) return v;
  RateRefusal r = tenants_->ChargeTokens(
      *tenant, static_cast<uint32_t>(v->prompt_ids.size()) + v->max_tokens);
  if (!r.status.ok()) {
    if (deps_.metrics) deps_.metrics->CountRefusal(Refusal::kRateLimit);
    if (retry_after_seconds != nullptr) *retry_after_seconds = r.retry_after_seconds;
    return r.status;
  }
  return v;
}

Status Frontend::Admit() {
  uint32_t now = inflight_.load();
  do {
    if (now >= max_inflight_) {
      if (deps_.metrics) deps_.metrics->CountRefusal(Refusal::kMaxInflight);
      return ResourceExhaustedError(fmt::format(
          "the proxy is at its limit of {} requests in flight (proxy.max_inflight); retry later",
          max_inflight_));
    }
  } while (!inflight_.compare_exchange_weak(now, now + 1));
  return Status::Ok();
}

void Frontend::Release() { inflight_.fetch_sub(1); }

}  // namespace tandem::proxy
