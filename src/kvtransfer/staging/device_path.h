// Which path KV in device memory takes between workers (docs/cuda.md),
// decided at start-up from `transport.device_path` and from what this
// machine's UCX can do:
//   - "direct": the device KV pool is registered with UCX itself
//     (ucp_mem_map with memory type CUDA; UCX then moves it with cuda_copy /
//     cuda_ipc / GPUDirect RDMA). Needs transport.backend ucx and a UCX whose
//     context reports UCS_MEMORY_TYPE_CUDA among its memory types
//     (ucp_context_query, UCP_ATTR_FIELD_MEMORY_TYPES);
//   - "staged": staging through pinned host memory (StagedTransport).
// `auto` picks direct when it is possible, staged otherwise; `direct` where
// it is not possible is refused (FAILED_PRECONDITION naming the key and
// the missing capability), never downgraded. Reported by `tandem version`
// and logged by every cuda worker at start-up.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::kvtransfer {

// What this machine's UCX says about CUDA memory.
struct UcxCudaSupport {
  bool cuda_memory = false;  // UCS_MEMORY_TYPE_CUDA in the context's memory_types
  std::string ucx_version;   // "1.13.1"
  std::string error;         // non-empty: UCX itself failed to answer (named here)
};

// Asks UCX (ucp_init + ucp_context_query of UCP_ATTR_FIELD_MEMORY_TYPES).
// Never fails: an error of UCX itself is kept in `error`.
UcxCudaSupport DetectUcxCudaSupport();

struct DeviceTransferPath {
  std::string name;    // "direct" | "staged"
  std::string detail;  // a line for logs and `tandem version`
};

// `setting`: transport.device_path (auto | direct | staged); `host_backend`:
// transport.backend (ucx | loopback). INVALID_ARGUMENT for an unknown
// setting; FAILED_PRECONDITION for `direct` where it cannot be served.
Result<DeviceTransferPath> ChooseDeviceTransferPath(std::string_view setting,
                                                    std::string_view host_backend,
                                                    const UcxCudaSupport& ucx);

}  // namespace tandem::kvtransfer
