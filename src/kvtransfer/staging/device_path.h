// Which path KV in device memory takes between workers (docs/cuda.md),
// decided at start-up from what this machine's UCX can do:
//   - UCX with CUDA memory (cuda_copy / cuda_ipc / GPUDirect RDMA): UCX
//     reports UCS_MEMORY_TYPE_CUDA among its context's memory types;
//   - otherwise staging through pinned host memory (StagedTransport).
// Reported by `tandem version` and logged by every cuda worker at start-up.
#pragma once

#include <string>

namespace tandem::kvtransfer {

struct DeviceTransferPath {
  bool ucx_cuda_memory = false;  // this UCX build can register CUDA memory
  std::string ucx_version;       // "1.13.1"
  std::string name;              // the path tandem uses: "staging"
  std::string detail;            // a line for logs and `tandem version`
};

// Asks UCX (ucp_init + ucp_context_query of UCP_ATTR_FIELD_MEMORY_TYPES).
// Never fails: an error of UCX itself is named in `detail`.
DeviceTransferPath DetectDeviceTransferPath();

}  // namespace tandem::kvtransfer
