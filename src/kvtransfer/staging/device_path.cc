#include "kvtransfer/staging/device_path.h"

#include <fmt/format.h>
#include <ucp/api/ucp.h>

namespace tandem::kvtransfer {

DeviceTransferPath DetectDeviceTransferPath() {
  DeviceTransferPath p;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  p.ucx_version = fmt::format("{}.{}.{}", major, minor, release);
  p.name = "staging";
  std::string why;
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) {
    why = "ucp_config_read failed";
  } else {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
    ucp_context_h context = nullptr;
    const ucs_status_t st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (st != UCS_OK) {
      why = fmt::format("ucp_init: {}", ucs_status_string(st));
    } else {
      ucp_context_attr_t attr{};
      attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
      p.ucx_cuda_memory = ucp_context_query(context, &attr) == UCS_OK &&
                          (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
      ucp_cleanup(context);
    }
  }
  if (!why.empty()) {
    p.detail = fmt::format("staging through pinned host memory (UCX {}: {})", p.ucx_version, why);
  } else if (p.ucx_cuda_memory) {
    // Registering the device pool with UCX directly is not built yet
    // (docs/cuda.md): staging is used, and said so.
    p.detail = fmt::format(
        "staging through pinned host memory (UCX {} supports CUDA memory, but tandem does not yet "
        "register device memory with UCX directly)",
        p.ucx_version);
  } else {
    p.detail = fmt::format("staging through pinned host memory (UCX {} has no CUDA memory support)",
                           p.ucx_version);
  }
  return p;
}

}  // namespace tandem::kvtransfer
