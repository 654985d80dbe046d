#include "engine/scheduler.h"

#include <algorithm>

#include "common/block_hash.h"
#include "common/check.h"

namespace tandem::engine {

Scheduler::Scheduler(const SchedulerLimits& limits, BlockManager* blocks)
    : limits_(limits), blocks_(blocks) {}

void Scheduler::AddWaiting(Sequence* seq) {
  seq->state = SeqState::kWaiting;
  waiting_.push_back(seq);
}

void Scheduler::Remove(Sequence* seq) {
  if (auto it = std::find(waiting_.begin(), waiting_.end(), seq); it != waiting_.end()) {
    waiting_.erase(it);
  }
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) {
    running_.erase(it);
  }
}

void Scheduler::UpdateHashes(Sequence& seq) const {
  const uint32_t bs = blocks_->block_size();
  const size_t full = seq.tokens.size() / bs;
  for (size_t i = seq.hashes.size(); i < full; ++i) {
    const uint64_t parent = i == 0 ? seq.root_hash : seq.hashes[i - 1];
    seq.hashes.push_back(
        HashBlock(parent, std::span<const uint32_t>(seq.tokens).subspan(i * bs, bs)));
  }
}

void Scheduler::Preempt(Sequence* seq) {
  blocks_->Release(seq->blocks);
  seq->blocks.clear();
  seq->num_computed = 0;
  seq->num_committed = 0;
  seq->commit_stopped = false;
  seq->state = SeqState::kWaiting;
  ++seq->num_preemptions;
  waiting_.push_front(seq);
  ++preemptions_;
}

SchedulerOutput Scheduler::Schedule() {
  SchedulerOutput out;
  uint32_t budget = limits_.max_batched_tokens;
  auto add = [&](Sequence* s, uint32_t n) {
    const bool samples = s->num_computed + n == s->tokens.size();
    out.seqs.push_back({s, n, samples});
    (s->num_pending() > 1 ? out.num_prefill_tokens : out.num_decode_tokens) += n;
    budget -= n;
  };

  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* s = running_[i];
    const uint32_t n = std::min(s->num_pending(), budget);
    TANDEM_CHECK(n > 0, "running sequence {} has nothing to compute", s->req.request_id);
    const uint32_t have = static_cast<uint32_t>(s->blocks.size());
    const uint32_t want = BlocksFor(s->num_computed + n);
    const uint32_t need = want > have ? want - have : 0;
    bool self_preempted = false;
    while (!blocks_->CanAllocate(need)) {
      Sequence* victim = running_.back();
      running_.pop_back();
      Preempt(victim);
      ++out.num_preempted;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    auto fresh = blocks_->Allocate(need);
    TANDEM_CHECK(fresh.ok(), "allocation after CanAllocate failed");
    s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
    add(s, n);
    ++i;
  }
  if (out.num_preempted > 0) return out;

  const uint32_t bs = blocks_->block_size();
  while (!waiting_.empty() && budget > 0 && running_.size() < limits_.max_num_seqs) {
    Sequence* s = waiting_.front();
    bool took_prefix = false;
    PrefixHit hit;
    if (s->blocks.empty() && s->num_computed == 0) {
      UpdateHashes(*s);
      const uint32_t max_blocks = (static_cast<uint32_t>(s->tokens.size()) - 1) / bs;
      s->blocks = blocks_->AcquireCachedPrefix(s->hashes, s->tokens, max_blocks, &hit);
      s->onboard_host_blocks += hit.blocks[static_cast<size_t>(KvTier::kHost)];
      s->onboard_disk_blocks += hit.blocks[static_cast<size_t>(KvTier::kDisk)];
      s->num_computed = static_cast<uint32_t>(s->blocks.size()) * bs;
      s->num_committed = static_cast<uint32_t>(s->blocks.size());
      took_prefix = true;
    }
    const uint32_t n = std::min(s->num_pending(), budget);
    const uint32_t want = BlocksFor(s->num_computed + n);
    const uint32_t need = want - std::min<uint32_t>(want, static_cast<uint32_t>(s->blocks.size()));
    if (!blocks_->CanAllocate(need)) {
      if (took_prefix) {  // give the prefix back; it is looked up again next time
        blocks_->Release(s->blocks);
        s->blocks.clear();
        s->num_computed = 0;
        s->num_committed = 0;
      }
      break;
    }
    if (took_prefix && !s->admitted_once) {
      s->cached_prompt_tokens = std::min(s->num_computed, s->prompt_len);
      prefix_query_tokens_ += s->prompt_len;
      prefix_hit_tokens_ += s->cached_prompt_tokens;
      blocks_->CountHit(hit);
    }
    s->admitted_once = true;
    auto fresh = blocks_->Allocate(need);
    TANDEM_CHECK(fresh.ok(), "allocation after CanAllocate failed");
    s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
    waiting_.pop_front();
    s->state = SeqState::kRunning;
    running_.push_back(s);
    add(s, n);
  }
  return out;
}

}  // namespace tandem::engine
