// The public gRPC API (tandem.v1.Generation) over the request lifecycle.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "proxy/lifecycle.h"
#include "proxy/request.h"
#include "tandem/v1/generation.grpc.pb.h"
#include "tandem/v1/wire/generation_wire.pb.h"

namespace tandem::proxy {

// What both front ends share: validation limits, the lifecycle's
// dependencies, admission control and request ids.
class Frontend {
 public:
  Frontend(ServingLimits limits, LifecycleDeps deps, uint32_t max_inflight, std::string api_key);

  const ServingLimits& limits() const { return limits_; }
  const LifecycleDeps& deps() const { return deps_; }
  const std::string& api_key() const { return api_key_; }

  // Validates (tokenizing a text prompt) and fills defaults.
  Result<ValidatedRequest> Validate(const ClientRequest& req);
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
  const std::string api_key_;
  std::atomic<uint32_t> inflight_{0};
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  std::mutex ids_mu_;
  std::unordered_set<std::string> ids_;  // guarded by ids_mu_: ids in flight
};

// Serves /tandem.v1.Generation/Generate with the wire-identical
// GenerateRequestBytes (see generation_wire.proto), so that invalid UTF-8
// reaches validation instead of failing inside protobuf.
class GenerationService final : public tandem::v1::Generation::CallbackService {
 public:
  explicit GenerationService(Frontend* frontend);

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* GenerateBytes(
      grpc::CallbackServerContext* ctx, const tandem::v1::wire::GenerateRequestBytes* request);
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const tandem::v1::ListModelsRequest* request,
                                       tandem::v1::ListModelsResponse* response) override;

 private:
  Frontend* frontend_;
};

}  // namespace tandem::proxy
