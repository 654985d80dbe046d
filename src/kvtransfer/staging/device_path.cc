#include "kvtransfer/staging/device_path.h"

#include <fmt/format.h>
#include <ucp/api/ucp.h>

namespace tandem::kvtransfer {

UcxCudaSupport DetectUcxCudaSupport() {
  UcxCudaSupport u;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  u.ucx_version = fmt::format("{}.{}.{}", major, minor, release);
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) {
    u.error = "ucp_config_read failed";
    return u;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  const ucs_status_t st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    u.error = fmt::format("ucp_init: {}", ucs_status_string(st));
    return u;
  }
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t q = ucp_context_query(context, &attr);
  if (q != UCS_OK) {
    u.error = fmt::format("ucp_context_query: {}", ucs_status_string(q));
  } else {
    u.cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  ucp_cleanup(context);
  return u;
}

Result<DeviceTransferPath> ChooseDeviceTransferPath(std::string_view setting,
                                                    std::string_view host_backend,
                                                    const UcxCudaSupport& ucx) {
  if (setting != "auto" && setting != "direct" && setting != "staged") {
    return InvalidArgumentError(fmt::format(
        "transport.device_path: '{}' is not one of auto, direct, staged", setting));
  }
  // Why direct is impossible here ("" when it is possible).
  std::string missing;
  if (host_backend != "ucx") {
    missing = fmt::format("transport.backend is {}, and only ucx can register device memory",
                          host_backend);
  } else if (!ucx.error.empty()) {
    missing = fmt::format("UCX {} could not be asked for CUDA memory support ({})",
                          ucx.ucx_version, ucx.error);
  } else if (!ucx.cuda_memory) {
    missing = fmt::format(
        "UCX {} has no CUDA memory support (ucp_context_query: no UCS_MEMORY_TYPE_CUDA among its "
        "memory types; a UCX built --with-cuda loads cuda_copy/cuda_ipc)",
        ucx.ucx_version);
  }
  DeviceTransferPath p;
  if (setting == "direct" && !missing.empty()) {
    return FailedPreconditionError(fmt::format(
        "transport.device_path is direct but {}; use transport.device_path: staged (or auto)",
        missing));
  }
  if (setting != "staged" && missing.empty()) {
    p.name = "direct";
    p.detail = fmt::format(
        "direct: device KV pool registered with UCX {} (ucp_mem_map, memory type CUDA; "
        "transport.device_path {})",
        ucx.ucx_version, setting);
    return p;
  }
  p.name = "staged";
  p.detail = setting == "staged"
                 ? fmt::format("staged through pinned host memory (transport.device_path staged; "
                               "UCX {} {} CUDA memory)",
                               ucx.ucx_version, ucx.cuda_memory ? "supports" : "has no")
                 : fmt::format("staged through pinned host memory (transport.device_path auto: {})",
                               missing);
  return p;
}

}  // namespace tandem::kvtransfer
