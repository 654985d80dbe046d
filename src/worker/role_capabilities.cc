#include "worker/role_capabilities.h"

#include <fmt/format.h>

namespace tandem::worker {

using engine::BackendFeature;
using engine::BackendFeatureName;

Status CheckRoleCapabilities(const engine::ComputeBackend& backend, std::string_view role,
                             const kvtransfer::Capabilities& transport) {
  if (role == "both") return Status::Ok();  // aggregated: KV never leaves the worker
  if (role != "prefill" && role != "decode") {
    return InvalidArgumentError(fmt::format("unknown worker role '{}'", role));
  }
  const std::string_view verb = role == "prefill" ? "push KV from" : "receive KV into";
  auto refuse = [&](std::string missing, std::string why) {
    return FailedPreconditionError(fmt::format(
        "backend {} cannot serve role {}: missing capability {} ({}); run it as an aggregated "
        "worker (role both) or use a backend and transport that have it",
        backend.name(), role, missing, why));
  };
  if (backend.Supports(BackendFeature::kHostKvPool)) {
    if (transport.device_memory) {
      return refuse(std::string(BackendFeatureName(BackendFeature::kDeviceKvPool)),
                    fmt::format("transport {} keeps its pool in device memory but the backend's "
                                "KV is in host memory",
                                transport.backend));
    }
    return Status::Ok();
  }
  if (backend.Supports(BackendFeature::kDeviceKvPool)) {
    if (transport.device_memory) return Status::Ok();
    return refuse(
        "transport device_memory",
        fmt::format("the backend's KV cache is in device memory and transport {} cannot {} it: "
                    "neither UCX with CUDA memory nor the staging path is set up for this worker",
                    transport.backend, verb));
  }
  return refuse(std::string(BackendFeatureName(BackendFeature::kHostKvPool)),
                fmt::format("the transport cannot {} this backend's KV cache", verb));
}

}  // namespace tandem::worker
