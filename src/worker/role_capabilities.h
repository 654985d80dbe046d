// Start-up check that a worker's compute backend and KV transport can serve
// its role (issue 16: no silent fallback). A prefiller pushes KV from the
// pool its backend writes, a decoder receives KV into the pool its backend
// reads; both therefore need the transport's pool to be where the backend
// keeps its KV:
//   backend host_kv_pool   -> a transport whose pool is host memory;
//   backend device_kv_pool -> a transport with device_memory (UCX with CUDA
//                             memory, or the staging path of docs/cuda.md).
// An aggregated worker (role both) moves no KV and needs neither.
#pragma once

#include <string_view>

#include "common/status.h"
#include "engine/backend.h"
#include "kvtransfer/transport.h"

namespace tandem::worker {

// FAILED_PRECONDITION naming the backend, the role and the missing
// capability when `backend` with `transport` cannot serve `role`
// (prefill | decode | both).
Status CheckRoleCapabilities(const engine::ComputeBackend& backend, std::string_view role,
                             const kvtransfer::Capabilities& transport);

}  // namespace tandem::worker
