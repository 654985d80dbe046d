// The KV transport of a worker, chosen at start-up from its backend
// (docs/cuda.md):
//   - cpu, sim: the configured host transport (ucx | loopback); its pool is
//     the engine's KV pool (f32 blocks);
//   - cuda: the KV cache is bf16 in device memory, on device 0
//     (CUDA_VISIBLE_DEVICES picks it), and the transport's pool is that
//     device memory; block_bytes are the bf16 block's. transport.device_path
//     (kvtransfer/staging/device_path.h) picks how it travels:
//       direct: a ucx transport registering the device pool with UCX
//               (ucp_mem_map, memory type CUDA);
//       staged: a StagedTransport over the configured host transport with a
//               CUDA copy engine.
//     The choice is made before any CUDA call, so a `direct` this UCX cannot
//     serve is refused first, naming the key and the missing capability.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "kvtransfer/transport.h"

namespace tandem::worker {

struct WorkerTransport {
  std::unique_ptr<kvtransfer::Transport> transport;
  // Non-null for cuda: the device KV pool (the transport's pool) for the
  // engine's backend; the engine's host pool then is not the transport's.
  void* device_kv_pool = nullptr;
  size_t device_kv_pool_bytes = 0;
  std::string path;  // "host" | "direct" | "staged"
  std::string detail;
};

// `options.block_bytes` is the engine's host block (f32); `bf16_block_bytes`
// the device block of the cuda backend; `device_path` transport.device_path;
// `receives`: the worker decodes (false for prefill-only: a staged
// transport then keeps no host mirror of the device pool).
Result<WorkerTransport> CreateWorkerTransport(const std::string& backend,
                                              kvtransfer::TransportOptions options,
                                              uint64_t bf16_block_bytes,
                                              const std::string& device_path = "auto",
                                              bool receives = true);

}  // namespace tandem::worker
