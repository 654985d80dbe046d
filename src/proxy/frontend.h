// What both public front ends (gRPC, HTTP) share: authentication (the one
// owner of API-key and tenant checks, proxy/tenants.h), validation limits,
// the lifecycle's dependencies, admission control and rate limits.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>

#include "proxy/lifecycle.h"
#include "proxy/slo_admission.h"
#include "proxy/request.h"
#include "proxy/tenants.h"
#include "common/work_pool.h"

namespace tandem::proxy {

class Frontend {
 public:
  // `tenants` null: an open API (every request is the default tenant).
  Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight,
           std::unique_ptr<Tenants> tenants);
  // proxy.api_key alone ("" = open), for tests.
  Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight, std::string api_key);

  const ServingLimits& limits() const { return limits_; }
  const LifecycleDeps& deps() const { return deps_; }
  Tenants& tenants() { return *tenants_; }

  // `authorization`: the client's `authorization` metadata / header value
  // ("" when absent). UNAUTHENTICATED when a key is required and this one
  // is missing or wrong; the tenant otherwise (lives as long as this).
  Result<const Tenant*> Authenticate(std::string_view authorization) const {
    return tenants_->Authenticate(authorization);
  }
  // Before any work on a request (its bytes parsed, its prompt tokenized):
  // charges one request to `tenant`'s request bucket (null: no limit).
  RateRefusal ChargeRequest(const Tenant* tenant);
  // Validates (tokenizing a text prompt) and fills defaults; the request
  // carries `tenant`'s cache salt (null: the default tenant's) and a new
  // fleet id (common/request_id.h). Then charges prompt + max_tokens to the
  // tenant's token bucket: a refusal is RESOURCE_EXHAUSTED naming the limit,
  // with `*retry_after_seconds` set (when not null).
  Result<ValidatedRequest> Validate(ClientRequest req, const Tenant* tenant = nullptr,
                                    double* retry_after_seconds = nullptr);
  // Admission, before the request is tokenized: RESOURCE_EXHAUSTED at once
  // when max_inflight requests are admitted. Request ids play no part (the
  // client's is a label; docs/security.md "Hostile input"). On success the
  // caller must call Release() once when the request ends.
  Status Admit();
  void Release();
  // SLO admission (proxy/slo_admission.h), run by Validate after the
  // request is validated; none: the requests' own SLOs, never refused.
  void SetSloAdmission(std::unique_ptr<SloAdmission> slo) { slo_ = std::move(slo); }
  // While draining, new requests get UNAVAILABLE.
  void SetDraining(bool draining) { draining_ = draining; }
  bool draining() const { return draining_; }
  uint32_t inflight() const { return inflight_; }
  // Where admitted requests are parsed and tokenized (never on an I/O or
  // gRPC callback thread).
  WorkPool& work() { return *work_; }

 private:
  const ServingLimits limits_;
  const LifecycleDeps deps_;
  const uint32_t max_inflight_;
  std::unique_ptr<Tenants> tenants_;
  std::unique_ptr<SloAdmission> slo_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<bool> draining_{false};
  // Last: joined first, while what its jobs use still lives.
  std::unique_ptr<WorkPool> work_;
};

}  // namespace tandem::proxy
