// The KV-transfer side of a worker's ranks (issue 18, docs/parallelism.md
// "KV transfer between different layouts"): what a prefill or decode
// worker of tp × pp rank processes sets up so that KV moves between
// different layouts.
//
//   - Every follower rank (FollowerRankKv) registers its own pool — its
//     stage's layers and its kv heads, the same num_blocks as rank 0 — with
//     its own transport; the rank's KvPool takes that memory (allocator()).
//     Once the group joined it hands rank 0 its descriptor (OnJoined); a
//     prefill follower runs its part of each push_kv plan (OnPushKv).
//   - Rank 0 collects the descriptors (kvtransfer::ExchangeRankDescriptors,
//     the same collective) into DecoderOptions::rank_descriptors, and its
//     PrefillerOptions::follower_push is kvtransfer::PushThroughFollowers.
//   - CheckTransportForLayout: transport.checksum and transport.encrypt
//     cannot be honoured when a worker has more than one rank (no rank
//     holds a whole block); refused at start-up naming the key.
//
// Thread-safety: OnJoined and OnPushKv on the follower's loop thread (the
// communicator's); the rest at start-up.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "engine/kv_pool.h"
#include "kvtransfer/slice_push.h"
#include "kvtransfer/transport.h"
#include "model/model_config.h"
#include "parallel/communicator.h"
#include "parallel/kv_slices.h"
#include "parallel/parallel_layout.h"

namespace tandem::worker {

// The model's KV geometry for the slice plan (f32 pool).
parallel::KvDims KvDimsOf(const model::ModelConfig& config, uint32_t block_size);

// FAILED_PRECONDITION naming the key when `layout` has more than one rank
// and transport.checksum or transport.encrypt is on (`role`: the section,
// for the message).
Status CheckTransportForLayout(const std::string& role, const parallel::ParallelLayout& layout,
                               const TransportConfig& transport);

class FollowerRankKv {
 public:
  // `base`: the worker's transport options (backend, peer timeout, ...);
  // agent_name gets "-rank<R>" appended, block_bytes is rank `rank`'s block
  // of `layout` (num_blocks as given: rank 0's).
  static Result<std::unique_ptr<FollowerRankKv>> Create(kvtransfer::TransportOptions base,
                                                        const parallel::ParallelLayout& layout,
                                                        const parallel::KvDims& dims,
                                                        uint32_t rank);
  ~FollowerRankKv();
  FollowerRankKv(const FollowerRankKv&) = delete;
  FollowerRankKv& operator=(const FollowerRankKv&) = delete;

  // Hands the rank's KvPool the transport's memory (the exact pool size).
  engine::KvPoolAllocator& allocator() { return *allocator_; }
  kvtransfer::Transport& transport() { return *transport_; }
  uint32_t rank() const { return rank_; }

  // Once every communicator joined: rank 0 receives this rank's descriptor
  // (the follower half of ExchangeRankDescriptors).
  Status OnJoined(parallel::Communicator& world);
  // A push_kv plan: `spec` is its kPushKvSpecTag extension. Runs this
  // rank's part and reports to rank 0; non-OK only when the report could
  // not be sent (the group is gone).
  Status OnPushKv(std::span<const std::byte> spec, parallel::Communicator& world);

 private:
  FollowerRankKv() = default;
  uint32_t rank_ = 0;
  std::unique_ptr<kvtransfer::Transport> transport_;
  std::unique_ptr<engine::KvPoolAllocator> allocator_;
  std::unique_ptr<kvtransfer::RankSlicePusher> pusher_;
};

}  // namespace tandem::worker
