#include "proxy/frontend.h"

#include <fmt/format.h>

#include <random>

namespace tandem::proxy {

Frontend::Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight,
                   std::unique_ptr<Tenants> tenants)
    : limits_(std::move(limits)), deps_(deps), max_inflight_(max_inflight),
      tenants_(std::move(tenants)) {
  if (!tenants_) tenants_ = std::move(Tenants::Parse("", "", "")).value();
}

Frontend::Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight,
                   std::string api_key)
    : Frontend(std::move(limits), deps, max_inflight,
               std::move(Tenants::Parse(api_key, "", "")).value()) {}

Result<ValidatedRequest> Frontend::Validate(const ClientRequest& req, const Tenant* tenant) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  const std::string id = fmt::format("req-{}", next_id_.fetch_add(1));
  auto v = ValidateRequest(
      req, limits_,
      [this](std::string_view text) { return deps_.tokenizer->Encode(text, true); }, rng(), id);
  if (v.ok() && tenant != nullptr) v->tenant_salt = tenant->cache_salt;
  return v;
}

Status Frontend::Admit(const std::string& request_id) {
  std::lock_guard lock(ids_mu_);
  if (ids_.contains(request_id)) {
    return AlreadyExistsError(fmt::format(
        "request_id '{}' is already in flight at this proxy; request ids must be unique", request_id));
  }
  if (inflight_.load() >= max_inflight_) {
    return ResourceExhaustedError(fmt::format(
        "the proxy is at its limit of {} requests in flight (proxy.max_inflight); retry later",
        max_inflight_));
  }
  ids_.insert(request_id);
  inflight_.fetch_add(1);
  return Status::Ok();
}

void Frontend::Release(const std::string& request_id) {
  std::lock_guard lock(ids_mu_);
  if (ids_.erase(request_id) != 0) inflight_.fetch_sub(1);
}

}  // namespace tandem::proxy
