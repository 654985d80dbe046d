// Continuous batching (vLLM-style, one token budget per step):
// 1. running sequences first, in admission order: each gets its pending
//    tokens (1 for a decode, the rest of a chunked prefill) up to the
//    budget; a sequence that needs a block when none is free preempts the
//    most recently admitted running sequence (by recompute: its blocks are
//    released and it goes back to the head of the waiting queue);
// 2. then waiting sequences in order, while budget, max_num_seqs and free
//    blocks allow (none are admitted in a step that preempted). A sequence
//    admitted without KV first takes its longest cached prefix (at most
//    prompt - 1 tokens: the last token is always computed for its logits).
//
// Thread-safety: none; the engine calls it under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "engine/block_manager.h"
#include "engine/sequence.h"

namespace tandem::engine {

struct SchedulerLimits {
  uint32_t max_num_seqs = 64;
  uint32_t max_batched_tokens = 512;
  uint32_t max_waiting = 256;
};

struct ScheduledSeq {
  Sequence* seq = nullptr;
  uint32_t num_tokens = 0;  // tokens [num_computed, num_computed + num_tokens)
  bool samples = false;     // the chunk reaches the end: its last logits are sampled
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> seqs;
  uint32_t num_prefill_tokens = 0;  // tokens of sequences with more than one pending
  uint32_t num_decode_tokens = 0;
  uint32_t num_preempted = 0;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerLimits& limits, BlockManager* blocks);

  const SchedulerLimits& limits() const { return limits_; }
  bool waiting_full() const { return waiting_.size() >= limits_.max_waiting; }
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  const std::deque<Sequence*>& waiting() const { return waiting_; }
  const std::vector<Sequence*>& running() const { return running_; }

  void AddWaiting(Sequence* seq);
  // Takes `seq` out of the waiting or running list (not its blocks).
  void Remove(Sequence* seq);

  SchedulerOutput Schedule();

  // Extends seq->hashes to every full block of seq->tokens (chained from seq->root_hash).
  void UpdateHashes(Sequence& seq) const;

  uint64_t preemptions() const { return preemptions_; }
  uint64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  uint64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  // For callers that allocate outside Schedule (reservations).
  void CountPrefixQuery(uint64_t query_tokens, uint64_t hit_tokens) {
    prefix_query_tokens_ += query_tokens;
    prefix_hit_tokens_ += hit_tokens;
  }

 private:
  uint32_t BlocksFor(uint32_t tokens) const {
    return (tokens + blocks_->block_size() - 1) / blocks_->block_size();
  }
  void Preempt(Sequence* seq);

  SchedulerLimits limits_;
  BlockManager* blocks_;  // borrowed
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  uint64_t preemptions_ = 0;
  uint64_t prefix_query_tokens_ = 0;
  uint64_t prefix_hit_tokens_ = 0;
};

}  // namespace tandem::engine
