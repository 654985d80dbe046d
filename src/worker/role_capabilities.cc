#include "worker/role_capabilities.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

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

namespace {

// Blocks of a prompt as long as the context.
uint64_t ContextBlocks(uint32_t max_model_len, uint32_t block_size) {
  return (uint64_t{max_model_len} + block_size - 1) / std::max(block_size, 1u);
}

}  // namespace

uint64_t MaxKvNoticeBytes(uint32_t max_model_len, uint32_t block_size, bool checksums,
                          bool encrypt) {
  const uint64_t per_block = (checksums ? 8 : 0) + (encrypt ? 16 : 0);
  return kKvNoticeFixedBytes + ContextBlocks(max_model_len, block_size) * per_block;
}

Status CheckKvNoticeFits(std::string_view role, uint32_t max_model_len, uint32_t block_size,
                         bool checksums, bool encrypt, const kvtransfer::Capabilities& transport) {
  if (role == "both") return Status::Ok();
  const uint64_t need = MaxKvNoticeBytes(max_model_len, block_size, checksums, encrypt);
  if (need <= transport.max_notification_bytes) return Status::Ok();
  std::string fields;
  if (checksums) fields = "transport.checksum: 8 bytes";
  if (encrypt) fields += std::string(fields.empty() ? "" : ", ") + "transport.encrypt: 16 bytes";
  return FailedPreconditionError(fmt::format(
      "a prompt of model.max_model_len {} tokens is {} blocks of cache.block_size {}; its KV "
      "notice carries per block {} and would need {} bytes, over the {} bytes transport {} "
      "sends in one notice: lower model.max_model_len, raise cache.block_size or turn the "
      "per-block fields off",
      max_model_len, ContextBlocks(max_model_len, block_size), block_size, fields, need,
      transport.max_notification_bytes, transport.backend));
}

}  // namespace tandem::worker
