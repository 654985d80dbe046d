// Continuous batching (vLLM-style, one token budget per step), with
// priorities and fair share (docs/scheduling.md):
// - work is taken in priority order (lower value first): running sequences
//   of a priority before waiting ones of the same priority, and a waiting
//   sequence of a better priority before any running one of a worse;
// - a running sequence gets its pending tokens (1 for a decode, the rest of
//   a chunked prefill) up to the budget; when it needs a block and none is
//   free it preempts the unscheduled running sequence served last (worst
//   priority, latest admitted; by recompute: its blocks are released, the
//   committed ones stay in the prefix cache and are taken back on
//   re-admission); no sequence of the same or a worse priority is admitted
//   in a step where a running one had to preempt;
// - a waiting sequence is admitted while budget, max_num_seqs and free
//   blocks allow; a waiting sequence of a better priority may preempt
//   running ones of a strictly worse priority for a slot or for blocks.
//   While others run, a new request (never admitted before) is admitted
//   only if the blocks left after its own keep the growth reserve free
//   (KeepFor; none of the running has a worse priority);
//   Among waiting sequences of one priority, the tenant with the least
//   virtual time (tokens served / weight) goes first (FairShare), then the
//   earliest arrival. A sequence admitted without KV first takes its
//   longest cached prefix (at most prompt - 1 tokens: the last token is
//   always computed for its logits).
// Every scheduled token (prefill and decode) is charged to its tenant.
//
// Thread-safety: none; the engine calls it under its lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/growth_reserve.h"
#include "engine/block_manager.h"
#include "engine/fair_share.h"
#include "engine/sequence.h"

namespace tandem::engine {

struct SchedulerLimits {
  uint32_t max_num_seqs = 64;
  uint32_t max_batched_tokens = 512;
  uint32_t max_waiting = 256;
  // scheduler.schedule_conservativeness (SGLang's --schedule-conservativeness):
  // scales the growth reserve's initial ratio, kGrowthInitRatio x it (at
  // most 1); 0 turns the reserve off. docs/engine.md "Growth reserve".
  double schedule_conservativeness = 1.0;
};

// The growth reserve (docs/engine.md "Growth reserve", after SGLang's
// new-token ratio): a decoder's reservation, and a new request's admission
// while others run, is granted only while the blocks left free cover what
// the requests holding blocks may still write past them: the tokens they
// already have (a chunked prompt's rest) whole, and `ratio` x the tokens
// they may still generate (their max_tokens, each clipped). The ratio
// starts at kGrowthInitRatio x conservativeness, falls by
// (init - init x kGrowthMinFactor) / kGrowthDecaySteps each step that
// decodes without preempting, goes to 1 (at most) on a preemption and
// back to its start when nothing runs.
inline constexpr double kGrowthInitRatio = 0.7;
inline constexpr double kGrowthMinFactor = 0.14;
inline constexpr uint32_t kGrowthDecaySteps = 600;
// The ratio's learned floor: of the requests that ended (EOS, a stop or
// max_tokens; not an abort, error or deadline), the tokens generated over
// their max_tokens (each clipped at kGrowthClipTokens), both as running
// means of weight 1 / kGrowthLearnWindow, once kGrowthLearnAfter have
// ended; x conservativeness, at most 1. The ratio never falls below the
// larger of it and SGLang's floor (init x kGrowthMinFactor).
inline constexpr uint32_t kGrowthLearnAfter = 16;
inline constexpr double kGrowthLearnWindow = 64;

// What holders may still write past their blocks: `known` tokens (a prompt
// or recomputed output not yet in KV), counted whole, and `output` tokens
// they may still generate (each holder's clipped at kGrowthClipTokens),
// counted at the growth ratio.
struct Growth {
  uint64_t known = 0;
  uint64_t output = 0;
  Growth& operator+=(const Growth& o) {
    known += o.known;
    output += o.output;
    return *this;
  }
};

struct ScheduledSeq {
  Sequence* seq = nullptr;
  uint32_t num_tokens = 0;  // tokens [num_computed, num_computed + num_tokens)
  bool samples = false;     // the chunk reaches the end: its last logits are sampled
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> seqs;
  uint32_t num_prefill_tokens = 0;  // tokens of sequences with more than one pending
  // The causal-attention (query, key) pairs of those tokens: a chunk of n
  // tokens after c computed ones attends to n*c + n(n+1)/2 (issue 22's
  // TTFT prediction: attention grows with the context; PrefillPairCost).
  uint64_t num_prefill_pairs = 0;
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
  // Waiting sequences that were preempted and hold no blocks: they wait for
  // blocks ahead of any reservation (Engine::Reserve).
  size_t num_preempted_waiting() const;
  size_t num_running() const { return running_.size(); }
  const std::deque<Sequence*>& waiting() const { return waiting_; }
  const std::vector<Sequence*>& running() const { return running_; }

  void AddWaiting(Sequence* seq);
  // Takes `seq` out of the waiting or running list (not its blocks).
  void Remove(Sequence* seq);

  // The step's plan; valid until the next call (its buffers are reused
  // from step to step: no allocation per step, issue 23).
  const SchedulerOutput& Schedule();

  // Extends seq->hashes to every full block of seq->tokens (chained from seq->root_hash).
  void UpdateHashes(Sequence& seq) const;

  uint64_t preemptions() const { return preemptions_; }
  // The growth reserve's ratio now (0 when off); see kGrowthInitRatio.
  double growth_ratio() const { return growth_ratio_; }
  // The floor it falls to: SGLang's, or the learned one when larger (see
  // kGrowthLearnAfter).
  double growth_floor() const;
  // A request ended having generated `generated` of its `max_tokens`.
  void NoteEnded(uint32_t generated, uint32_t max_tokens);
  // Whether a waiting or running sequence holds blocks; what those and the
  // holders outside (set_outside_growth) may still write past their blocks.
  bool AnyHolder() const;
  Growth HolderGrowth() const;
  // What `s` may still write past `held_blocks` blocks.
  Growth GrowthOf(const Sequence& s, size_t held_blocks) const;
  // The blocks the reserve keeps free for `g` at the ratio now (0 when off).
  uint32_t KeepFor(const Growth& g) const;
  // The growth of holders outside the scheduler (a decoder's reservations,
  // Engine::Reserve), in output tokens; called during Schedule, under the
  // caller's lock, only when a new request's admission is weighed.
  void set_outside_growth(std::function<uint64_t()> f) { outside_growth_ = std::move(f); }
  const FairShare& fair_share() const { return fair_; }
  // Per tenant seen: the tokens a tenant with waiting work is behind the
  // queue's virtual time, times its weight (0 for the others).
  std::map<std::string, double> FairShareDeficits() const;
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
  // waiting_'s priorities counted: every push and erase of waiting_ goes
  // through one of these.
  void PushWaitingBack(Sequence* seq);
  void PushWaitingFront(Sequence* seq);
  void EraseWaiting(std::deque<Sequence*>::iterator it);
  // The best (lowest) priority among the waiting; waiting_ not empty.
  int32_t BestWaitingPriority() const { return waiting_priorities_.begin()->first; }
  // `seq` gives its blocks back and will be recomputed (a preemption)
  // without leaving its place; Preempt's first half.
  void DropBlocks(Sequence* seq);
  // With nothing running and nothing admitted, the newest waiting sequence
  // that holds blocks drops them (DropBlocks); false when none holds any.
  bool DropNewestWaitingHolder();
  // HolderGrowth's waiting holders and those outside (Schedule adds the
  // running ones while it moves them).
  Growth WaitingAndOutsideGrowth() const;
  // After a step's plan: the growth ratio's fall, jump or reset.
  void UpdateGrowthRatio(const SchedulerOutput& out);
  // A request never admitted (every new request on an aggregated or
  // prefill engine, a decoder's local prefill): the growth reserve weighs
  // its admission while others run.
  static bool WeighedByReserve(const Sequence& s) { return !s.admitted_once; }
  static QueueKey KeyOf(const Sequence* s) { return {s->req.priority, s->fair_tenant, s->arrival}; }

  SchedulerLimits limits_;
  BlockManager* blocks_;  // borrowed
  std::deque<Sequence*> waiting_;
  // How many of waiting_ have each priority (no zero counts): the best one
  // without a pass over the queue (session 29).
  std::map<int32_t, uint32_t> waiting_priorities_;
  std::vector<Sequence*> running_;
  std::vector<Sequence*> done_;  // Schedule()'s scratch, kept for its capacity
  std::vector<Sequence*> rest_;  // Schedule()'s scratch: running, not (yet) scheduled
  SchedulerOutput out_;          // Schedule()'s result, kept for its capacity
  FairShare fair_;
  uint64_t next_arrival_ = 0;
  uint64_t preemptions_ = 0;
  uint64_t growth_seen_preemptions_ = 0;
  double growth_init_ = 0;
  double growth_min_ = 0;
  double growth_ratio_ = 0;
  uint64_t growth_ended_ = 0;     // requests seen by NoteEnded
  double growth_generated_ = 0;   // running mean of their generated tokens
  double growth_max_tokens_ = 0;  // and of their max_tokens
  std::function<uint64_t()> outside_growth_;
  uint64_t prefix_query_tokens_ = 0;
  uint64_t prefix_hit_tokens_ = 0;
};

}  // namespace tandem::engine
