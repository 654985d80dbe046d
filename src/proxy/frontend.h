// What both public front ends (gRPC, HTTP) share: authentication (the one
// owner of API-key and tenant checks, proxy/tenants.h), validation limits,
// the lifecycle's dependencies, admission control and request ids.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

#include "proxy/lifecycle.h"
#include "proxy/request.h"
#include "proxy/tenants.h"

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
  // Validates (tokenizing a text prompt) and fills defaults; the request
  // carries `tenant`'s cache salt (null: the default tenant's).
  Result<ValidatedRequest> Validate(const ClientRequest& req, const Tenant* tenant = nullptr);
  // Admission: RESOURCE_EXHAUSTED at once when max_inflight requests run;
  // ALREADY_EXISTS when a request with the same id is in flight (workers key
  // their state by it: a duplicate would be refused by them or, worse, take
  // over the first request's stream). On success the caller must call
  // Release(request_id) when the request ends.
  Status Admit(const std::string& request_id);
  void Release(const std::string& request_id);
  // While draining, new requests get UNAVAILABLE.
  void SetDraining(bool draining) { draining_ = draining; }
  bool draining() const { return draining_; }
  uint32_t inflight() const { return inflight_; }

 private:
  const ServingLimits limits_;
  const LifecycleDeps deps_;
  const uint32_t max_inflight_;
  std::unique_ptr<Tenants> tenants_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  std::mutex ids_mu_;
  std::unordered_set<std::string> ids_;  // guarded by ids_mu_: ids in flight
};

}  // namespace tandem::proxy
