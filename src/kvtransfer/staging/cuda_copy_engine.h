// CudaCopyEngine: device memory on one CUDA device and asynchronous copies
// on a dedicated non-blocking copy stream (so KV copies overlap the compute
// stream's kernels), each batch followed by a cudaEvent; a completion
// thread waits on the events in submission order (cudaEventSynchronize with
// blocking sync, no spinning) and runs the callbacks. Built only with CUDA
// (TANDEM_HAVE_CUDA); compiled in CI, run only by tests/gpu/device_check.sh.
#pragma once

#include <memory>

#include "kvtransfer/staging/copy_engine.h"

namespace tandem::kvtransfer {

// FAILED_PRECONDITION naming the device when it is not usable.
Result<std::unique_ptr<CopyEngine>> CreateCudaCopyEngine(int device);

}  // namespace tandem::kvtransfer
