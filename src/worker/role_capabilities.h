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

// What a KV notice holds besides its per-block fields, at most: the fleet
// request id, the reservation's capability, the counters, protobuf's tags.
inline constexpr uint64_t kKvNoticeFixedBytes = 4096;

// The largest KvNotice a prefiller sends for a prompt of `max_model_len`
// tokens: one XXH3-64 checksum per block with `checksums`, one 16-byte GCM
// tag per block with `encrypt`, plus kKvNoticeFixedBytes.
uint64_t MaxKvNoticeBytes(uint32_t max_model_len, uint32_t block_size, bool checksums,
                          bool encrypt);

// FAILED_PRECONDITION naming model.max_model_len, cache.block_size, the
// per-block fields and the transport's limit when the notice of a prompt as
// long as the context would not fit `transport` (its push would fail for
// every such request); OK for role both (KV never leaves the worker).
Status CheckKvNoticeFits(std::string_view role, uint32_t max_model_len, uint32_t block_size,
                         bool checksums, bool encrypt, const kvtransfer::Capabilities& transport);

}  // namespace tandem::worker
