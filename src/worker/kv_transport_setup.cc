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
                                              uint64_t bf16_block_bytes) {
  WorkerTransport w;
  if (backend != "cuda") {
    TANDEM_ASSIGN_OR_RETURN(w.transport, kvtransfer::CreateTransport(options));
    w.path = "host";
    w.detail = fmt::format("{} over the host KV pool", options.backend);
    return w;
  }
#ifdef TANDEM_HAVE_CUDA_COPY_ENGINE
  const kvtransfer::DeviceTransferPath path = kvtransfer::DetectDeviceTransferPath();
  options.block_bytes = bf16_block_bytes;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::CopyEngine> engine,
                          kvtransfer::CreateCudaCopyEngine(0));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::StagedTransport> staged,
                          kvtransfer::CreateStagedTransport(options, std::move(engine)));
  w.device_kv_pool = staged->pool();
  w.device_kv_pool_bytes = staged->pool_bytes();
  w.transport = std::move(staged);
  w.path = path.name;
  w.detail = path.detail;
  return w;
#else
  (void)bf16_block_bytes;
  return UnimplementedError(
      "backend cuda: this build has no CUDA kernels (configure with -DTANDEM_CUDA=ON where nvcc "
      "is installed)");
#endif
}

}  // namespace tandem::worker
