// Backend "ucx": UCP one-sided puts into a peer's pool.
//
// - The pool is allocated by ucp_mem_map(UCP_MEM_MAP_ALLOCATE); its packed
//   rkey and the worker address form the descriptor.
// - A write is a series of ucp_put_nbx (contiguous blocks coalesced, large
//   runs split into TransportOptions::max_put_bytes for abort granularity),
//   then ucp_ep_flush_nbx (remote completion), then the notice as an eager
//   active message, so the receiver handles the notice only after the data.
// - Endpoints use UCP_ERR_HANDLING_MODE_PEER: a dead peer fails its
//   transfers with kErrRemoteDisconnect (keepalive bounds the delay).
// - One progress thread owns the worker (UCS_THREAD_MODE_SINGLE). It spins
//   while transfers are in flight and sleeps on the worker's event fd
//   (ucp_worker_arm + epoll, with a timeout) when idle.
// See docs/kvtransfer.md for the UCX environment variables.
#pragma once

#include <memory>

#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {

Result<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options);

}  // namespace tandem::kvtransfer
