#include "worker/kv_transport_setup.h"

#include <fmt/format.h>

#include "kvtransfer/staging/device_path.h"
#include "kvtransfer/staging/staged_transport.h"
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
#include "kvtransfer/staging/cuda_copy_engine.h"
#endif

namespace tandem::worker {

Result<WorkerTransport> CreateWorkerTransport(const std::string& backend,
                                              kvtransfer::TransportOptions options,
                                              uint64_t bf16_block_bytes,
                                              const std::string& device_path,
                                              bool receives) {
  WorkerTransport w;
  if (backend != "cuda") {
    TANDEM_ASSIGN_OR_RETURN(w.transport, kvtransfer::CreateTransport(options));
    w.path = "host";
    w.detail = fmt::format("{} over the host KV pool", options.backend);
    return w;
  }
  // Decided before any CUDA call: an impossible `direct` is refused first.
  TANDEM_ASSIGN_OR_RETURN(
      const kvtransfer::DeviceTransferPath path,
      kvtransfer::ChooseDeviceTransferPath(device_path, options.backend,
                                           kvtransfer::DetectUcxCudaSupport()));
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
  options.block_bytes = bf16_block_bytes;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::CopyEngine> engine,
                          kvtransfer::CreateCudaCopyEngine(0));
  if (path.name == "direct") {
    const uint64_t bytes = options.block_bytes * options.num_blocks;
    TANDEM_ASSIGN_OR_RETURN(std::byte* pool, engine->AllocateDevice(bytes));
    // The owner frees the device pool once the transport has unmapped it.
    std::shared_ptr<kvtransfer::CopyEngine> shared_engine(std::move(engine));
    options.external_pool = pool;
    options.pool_memory = kvtransfer::TransportOptions::PoolMemory::kCuda;
    options.external_pool_owner =
        std::shared_ptr<void>(pool, [shared_engine](void* p) {
          shared_engine->FreeDevice(static_cast<std::byte*>(p));
        });
    options.staging_blocks = 0;
    TANDEM_ASSIGN_OR_RETURN(w.transport, kvtransfer::CreateTransport(options));
    w.device_kv_pool = w.transport->pool();
    w.device_kv_pool_bytes = w.transport->pool_bytes();
  } else {
    kvtransfer::StagedTransportOptions so;
    so.receive = receives;  // prefill-only: no host mirror (docs/cuda.md, "Cost")
    TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::StagedTransport> staged,
                            kvtransfer::CreateStagedTransport(options, std::move(engine), so));
    w.device_kv_pool = staged->pool();
    w.device_kv_pool_bytes = staged->pool_bytes();
    w.transport = std::move(staged);
  }
  w.path = path.name;
  w.detail = path.detail;
  return w;
#else
  (void)bf16_block_bytes;
  (void)path;
  (void)receives;
  return UnimplementedError(
      "backend cuda: this build has no CUDA kernels (configure with -DTANDEM_CUDA=ON where nvcc "
      "is installed)");
#endif
}

}  // namespace tandem::worker
