// One prefill rank's part of a KV push between different rank layouts
// (issue 18, docs/parallelism.md, "KV transfer between different layouts").
//
// A prefiller of tp × pp ranks pushes a request's prompt blocks into a
// decoder of (other) tp × pp ranks: every prefill rank writes, from its own
// pool (which holds only its stage's layers and its kv heads), the runs the
// slice plan (parallel/kv_slices.h) gives it into the pools of the decode
// ranks that hold them, one write per decode rank it feeds. Block ids are
// the same on every rank of a group (rank 0's block manager decides), and a
// decoder's slots name the same block in every decode rank's pool. Only
// once every prefill rank's writes completed (every byte visible at the
// decode ranks) does prefill rank 0 send the one KvNotice to decode rank 0
// (PushStream, sliced mode).
//
// SlicePushSpec is what prefill rank 0 hands to each follower rank (in the
// step plan's push-KV kind, as Encode()d bytes); RankSlicePusher is what a
// rank runs with it on its own transport.
//
// Threads: SlicePushSpec and SliceSegments are values/pure. RankSlicePusher
// may be called from any thread; Push's `done` runs on the transport's
// progress thread (or inside Push when nothing was posted).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "kvtransfer/transport.h"
#include "parallel/kv_slices.h"
#include "parallel/parallel_layout.h"

namespace tandem::kvtransfer {

struct SlicePushSpec {
  std::string request_id;  // for errors and logs
  parallel::ParallelLayout prefill, decode;
  parallel::KvDims dims;
  // [decode world] every decode rank's transport descriptor (binary).
  std::vector<std::string> decode_descriptors;
  // [prompt blocks] the prefiller's block ids (same on every prefill rank)
  // and the decoder's slots; blocks [cached_blocks, end) are pushed.
  std::vector<uint32_t> block_ids;
  std::vector<uint32_t> slots;
  uint32_t cached_blocks = 0;

  // A compact binary form (ranks of one group run the same build):
  // magic "TKSP", u32 version, then the fields. Decode refuses truncation,
  // a bad magic/version, and sizes that do not match (naming the field).
  std::string Encode() const;
  static Result<SlicePushSpec> Decode(std::string_view bytes);
  // Sizes agree, layouts can split the dims, cached_blocks <= blocks.
  Status Validate() const;
};

// The segments of one rank pair's runs for blocks [cached_blocks, end):
// local bytes at block_ids[b] * src_block_bytes + run.src, remote at
// slots[b] * dst_block_bytes + run.dst. Runs that continue across blocks
// (whole rank blocks into consecutive slots) are merged.
std::vector<Segment> SliceSegments(const parallel::KvRankPairPlan& pair,
                                   std::span<const uint32_t> block_ids,
                                   std::span<const uint32_t> slots, uint32_t cached_blocks,
                                   uint64_t src_block_bytes, uint64_t dst_block_bytes);

// Runs one rank's part of sliced pushes on its transport; imports each
// decode rank's descriptor once (a newer generation of the same agent
// replaces the old peer).
class RankSlicePusher {
 public:
  // `transport` (borrowed) holds this rank's pool of rank-local blocks.
  RankSlicePusher(Transport& transport, uint32_t rank) : transport_(transport), rank_(rank) {}
  RankSlicePusher(const RankSlicePusher&) = delete;
  RankSlicePusher& operator=(const RankSlicePusher&) = delete;

  struct Outcome {
    Status status;        // OK: every byte of this rank's writes is visible at the decode ranks
    uint64_t bytes = 0;   // payload bytes posted
    uint32_t writes = 0;  // transfers posted (one per decode rank fed)
  };
  using Done = std::function<void(Outcome)>;
  // Posts this rank's writes; `done` runs once every one is terminal, with
  // the first failure (naming the decode rank) or OK. A spec this rank
  // sends nothing for ends OK at once. Returns the posted transfers' ids
  // (for Transport::Abort; an id may already be released by then).
  std::vector<XferId> Push(const SlicePushSpec& spec, Done done);
  // Push and wait (a follower rank's loop).
  Outcome PushAndWait(const SlicePushSpec& spec);
  // Aborts every write in flight (their `done` then reports kErrCanceled).
  void AbortAll();

  uint32_t rank() const { return rank_; }

 private:
  Result<PeerId> PeerFor(const std::string& descriptor);

  Transport& transport_;
  const uint32_t rank_;
  std::mutex mu_;
  std::map<std::string, PeerId> peers_;  // guarded by mu_: descriptor -> peer
  std::map<XferId, bool> inflight_;      // guarded by mu_
};

}  // namespace tandem::kvtransfer
