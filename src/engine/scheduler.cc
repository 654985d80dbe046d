#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "common/block_hash.h"
#include "common/check.h"

namespace tandem::engine {

Scheduler::Scheduler(const SchedulerLimits& limits, BlockManager* blocks)
    : limits_(limits), blocks_(blocks) {
  growth_init_ = std::min(1.0, kGrowthInitRatio * std::max(0.0, limits.schedule_conservativeness));
  growth_min_ = growth_init_ * kGrowthMinFactor;
  growth_ratio_ = growth_init_;
}

namespace {
// Where a sequence's KV ends: its prompt and every output token but the
// last (which is never fed back); a prefill-only one stops at its prompt.
uint64_t KvEndOf(const Sequence& s) {
  const uint64_t max_tokens = std::max<uint32_t>(s.req.sampling.max_tokens, 1);
  const uint64_t end = s.req.prefill_only ? s.prompt_len : s.prompt_len + max_tokens - 1;
  return std::max<uint64_t>(end, s.tokens.size() - 1);
}
}  // namespace

bool Scheduler::AnyHolder() const {
  if (!running_.empty()) return true;
  for (const Sequence* s : waiting_) {
    if (!s->blocks.empty()) return true;
  }
  return false;
}

Growth Scheduler::GrowthOf(const Sequence& s, size_t held_blocks) const {
  const uint64_t capacity = uint64_t{held_blocks} * blocks_->block_size();
  const uint64_t kv_end = KvEndOf(s);
  const uint64_t known_end = std::min<uint64_t>(s.tokens.size(), kv_end);
  Growth g;
  g.known = known_end > capacity ? known_end - capacity : 0;
  const uint64_t from = std::max(known_end, capacity);
  g.output = kv_end > from ? std::min<uint64_t>(kv_end - from, kGrowthClipTokens) : 0;
  return g;
}

Growth Scheduler::WaitingAndOutsideGrowth() const {
  Growth g;
  if (outside_growth_) g.output = outside_growth_();
  for (const Sequence* s : waiting_) {
    if (!s->blocks.empty()) g += GrowthOf(*s, s->blocks.size());
  }
  return g;
}

Growth Scheduler::HolderGrowth() const {
  Growth g = WaitingAndOutsideGrowth();
  for (const Sequence* s : running_) g += GrowthOf(*s, s->blocks.size());
  return g;
}

uint32_t Scheduler::KeepFor(const Growth& g) const {
  if (growth_ratio_ <= 0) return 0;
  const double tokens =
      static_cast<double>(g.known) + growth_ratio_ * static_cast<double>(g.output);
  return static_cast<uint32_t>(std::ceil(tokens / blocks_->block_size()));
}

double Scheduler::growth_floor() const {
  if (growth_ended_ < kGrowthLearnAfter || growth_max_tokens_ <= 0) return growth_min_;
  const double learned = growth_generated_ / growth_max_tokens_ * limits_.schedule_conservativeness;
  return std::max(growth_min_, std::min(1.0, learned));
}

void Scheduler::NoteEnded(uint32_t generated, uint32_t max_tokens) {
  const double g = std::min(generated, kGrowthClipTokens);
  const double m = std::min(std::max<uint32_t>(max_tokens, 1), kGrowthClipTokens);
  // The first ones set the means (a mean over what has ended), the later
  // ones move them by 1 / kGrowthLearnWindow.
  const double w = 1.0 / std::min<double>(static_cast<double>(++growth_ended_), kGrowthLearnWindow);
  growth_generated_ += w * (g - growth_generated_);
  growth_max_tokens_ += w * (m - growth_max_tokens_);
}

void Scheduler::UpdateGrowthRatio(const SchedulerOutput& out) {
  if (growth_init_ <= 0) return;
  const double floor = growth_floor();
  if (preemptions_ != growth_seen_preemptions_) {
    growth_seen_preemptions_ = preemptions_;
    growth_ratio_ = 1.0;  // as SGLang's estimate after a retraction, at its most
  } else if (out.num_decode_tokens > 0) {
    const double step = (growth_init_ - growth_min_) / kGrowthDecaySteps;
    growth_ratio_ = std::max(floor, growth_ratio_ - step);
  } else if (running_.empty()) {
    growth_ratio_ = std::max(floor, growth_init_);
  }
}

void Scheduler::AddWaiting(Sequence* seq) {
  seq->state = SeqState::kWaiting;
  if (seq->arrival == 0) {
    seq->arrival = ++next_arrival_;
    seq->queued_since = seq->req.queued_since.value_or(std::chrono::steady_clock::now());
  }
  seq->fair_tenant = fair_.Enqueue(seq->req.tenant, seq->req.tenant_weight);
  PushWaitingBack(seq);
}

void Scheduler::PushWaitingBack(Sequence* seq) {
  ++waiting_priorities_[seq->req.priority];
  waiting_.push_back(seq);
}

void Scheduler::PushWaitingFront(Sequence* seq) {
  ++waiting_priorities_[seq->req.priority];
  waiting_.push_front(seq);
}

void Scheduler::EraseWaiting(std::deque<Sequence*>::iterator it) {
  const auto count = waiting_priorities_.find((*it)->req.priority);
  TANDEM_CHECK(count != waiting_priorities_.end() && count->second > 0,
               "waiting sequence {} of an uncounted priority", (*it)->req.request_id);
  if (--count->second == 0) waiting_priorities_.erase(count);
  waiting_.erase(it);
}

void Scheduler::Remove(Sequence* seq) {
  if (auto it = std::find(waiting_.begin(), waiting_.end(), seq); it != waiting_.end()) {
    EraseWaiting(it);
  }
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) {
    running_.erase(it);
  }
}

std::map<std::string, double> Scheduler::FairShareDeficits() const {
  std::map<std::string, double> out;
  for (const auto& [tenant, tokens] : fair_.served()) out[tenant] = 0;
  for (const Sequence* s : waiting_) {
    const double behind = fair_.SystemTime() - s->fair_tenant->virtual_time;
    const double w = s->req.tenant_weight > 0 ? s->req.tenant_weight : 1.0;
    out[s->req.tenant] = std::max(0.0, behind * w);
  }
  return out;
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

void Scheduler::DropBlocks(Sequence* seq) {
  blocks_->Release(seq->blocks);
  seq->blocks.clear();
  seq->num_computed = 0;
  seq->num_committed = 0;
  seq->commit_stopped = false;
  ++seq->num_preemptions;
  ++preemptions_;
}

void Scheduler::Preempt(Sequence* seq) {
  DropBlocks(seq);
  seq->state = SeqState::kWaiting;
  PushWaitingFront(seq);
}

size_t Scheduler::num_preempted_waiting() const {
  size_t n = 0;
  for (const Sequence* s : waiting_) n += s->num_preemptions > 0 && s->blocks.empty();
  return n;
}

bool Scheduler::DropNewestWaitingHolder() {
  for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {
    if ((*it)->blocks.empty()) continue;
    DropBlocks(*it);
    return true;
  }
  return false;
}

const SchedulerOutput& Scheduler::Schedule() {
  SchedulerOutput& out = out_;
  out.seqs.clear();
  out.num_prefill_tokens = 0;
  out.num_prefill_pairs = 0;
  out.num_decode_tokens = 0;
  out.num_preempted = 0;
  uint32_t budget = limits_.max_batched_tokens;
  // Tokens served are charged to a tenant in runs (of sequences of one
  // tenant and chunk size); the run is charged before anything reads a
  // virtual time (a waiting pick).
  FairTenant* charge_tenant = nullptr;
  uint32_t charge_tokens = 0;
  uint64_t charge_times = 0;
  auto flush_charge = [&] {
    if (charge_times > 0) FairShare::Charge(*charge_tenant, charge_tokens, charge_times);
    charge_tenant = nullptr;
    charge_times = 0;
  };
  auto add = [&](Sequence* s, uint32_t n) {
    const bool samples = s->num_computed + n == s->tokens.size();
    out.seqs.push_back({s, n, samples});
    if (s->num_pending() > 1) {
      out.num_prefill_tokens += n;
      out.num_prefill_pairs += uint64_t{n} * s->num_computed + uint64_t{n} * (n + 1) / 2;
    } else {
      out.num_decode_tokens += n;
    }
    budget -= n;
    if (charge_times > 0 && (charge_tokens != n || charge_tenant != s->fair_tenant)) flush_charge();
    charge_tenant = s->fair_tenant;
    charge_tokens = n;
    ++charge_times;
  };
  // Running sequences in priority order; within one, in admission order.
  // (Usually already so: no sort, and no buffer for it, per step.)
  const auto by_priority = [](const Sequence* a, const Sequence* b) {
    return a->req.priority < b->req.priority;
  };
  if (!std::is_sorted(running_.begin(), running_.end(), by_priority)) {
    std::stable_sort(running_.begin(), running_.end(), by_priority);
  }
  std::vector<Sequence*>& done = done_;  // running, scheduled in this step
  done.clear();
  done.reserve(running_.size());
  out.seqs.reserve(running_.size() + 1);
  // Running, not (yet) scheduled: rest_[rest_lo, rest_hi), taken from the
  // front (scheduled) and the back (preempted).
  rest_.assign(running_.begin(), running_.end());
  size_t rest_lo = 0;
  size_t rest_hi = rest_.size();
  const auto rest_empty = [&] { return rest_lo == rest_hi; };
  running_.clear();
  auto preempt_back = [&] {
    Sequence* victim = rest_[--rest_hi];
    Preempt(victim);
    ++out.num_preempted;
  };

  const uint32_t bs = blocks_->block_size();
  // What the holders may still write past their blocks, mid-plan: the
  // scheduled and unscheduled running, the waiting holding blocks, and
  // those outside (a decoder's reservations).
  auto holder_growth = [&] {  // HolderGrowth, with running_ split into done and rest_
    Growth g = WaitingAndOutsideGrowth();
    for (const Sequence* d : done) g += GrowthOf(*d, d->blocks.size());
    for (size_t i = rest_lo; i < rest_hi; ++i) g += GrowthOf(*rest_[i], rest_[i]->blocks.size());
    return g;
  };
  // Admits `s` (taken out of waiting_): kAdmitted, or (the caller puts `s`
  // back) kNoRoom, or kHeldByReserve when it would fit but for the reserve.
  enum class Admit { kAdmitted, kNoRoom, kHeldByReserve };
  auto admit_one = [&](Sequence* s) {
    auto worse_running = [&] {
      return !rest_empty() && rest_[rest_hi - 1]->req.priority > s->req.priority;
    };
    if (done.size() + (rest_hi - rest_lo) >= limits_.max_num_seqs) {
      if (!worse_running()) return Admit::kNoRoom;
      preempt_back();
    }
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
    // The growth reserve, for a new request while others run (none of them
    // of a worse priority: a better one preempts those as before).
    uint32_t keep = 0;
    if (growth_ratio_ > 0 && took_prefix && WeighedByReserve(*s) && !worse_running() &&
        done.size() + (rest_hi - rest_lo) > 0) {
      Growth g = holder_growth();
      g += GrowthOf(*s, s->blocks.size() + need);
      keep = KeepFor(g);
    }
    while (!blocks_->CanAllocate(need + keep)) {
      if (worse_running()) {
        preempt_back();
        continue;
      }
      const bool held = keep > 0 && blocks_->CanAllocate(need);
      if (took_prefix) {  // give the prefix back; it is looked up again next time
        blocks_->Release(s->blocks);
        s->blocks.clear();
        s->num_computed = 0;
        s->num_committed = 0;
      }
      return held ? Admit::kHeldByReserve : Admit::kNoRoom;
    }
    if (took_prefix && !s->admitted_once) {
      s->cached_prompt_tokens = std::min(s->num_computed, s->prompt_len);
      prefix_query_tokens_ += s->prompt_len;
      prefix_hit_tokens_ += s->cached_prompt_tokens;
      blocks_->CountHit(hit);
    }
    s->admitted_once = true;
    // A prompt's chunk (admission computes the prompt, or a preempted
    // sequence's recompute, from where its cache ends): the evictions that
    // make its room are quiet and leave with the prompt's blocks when its
    // last chunk is computed (kv_events.h).
    auto fresh = blocks_->Allocate(need, /*quiet_evictions=*/s->num_computed < s->prompt_len);
    TANDEM_CHECK(fresh.ok(), "allocation after CanAllocate failed");
    s->blocks.insert(s->blocks.end(), fresh->begin(), fresh->end());
    s->state = SeqState::kRunning;
    fair_.Picked(*s->fair_tenant);
    done.push_back(s);
    add(s, n);
    return Admit::kAdmitted;
  };

  bool admitting = true;
  // After a new request is held by the reserve, the new ones behind it
  // wait too (first come, first served), but not those the reserve does
  // not weigh: a decoder's prefilled requests, whose blocks are already
  // held (and counted in the reserve), and preempted ones coming back.
  bool past_reserve_only = false;
  const auto past_reserve = [](const Sequence* s) { return !WeighedByReserve(*s); };
  std::optional<int32_t> admit_below;  // after a preemption: only better priorities
  // A pick is a pass over the waiting queue that reads the tenants' virtual
  // times; the best priority among the waiting (counted, no pass) bounds
  // any pick's, so the step picks only when one could be admitted:
  // - while that priority is no better than the next running sequence's,
  //   that one is scheduled without a pick (before session 28 a step under
  //   a backlog made one pick per running sequence);
  // - with the batch full and no running sequence of a worse priority to
  //   preempt for it, none can be admitted in this step (a seat frees only
  //   by preempting for a running sequence, which then bounds admission to
  //   priorities better than its own, no better than the waiting's best),
  //   so admission stops without the pick (session 29; bench_sim_step's
  //   backlog rows: the pick a step under a backlog made at its end).
  const auto no_seat_for_best = [&] {
    return done.size() + (rest_hi - rest_lo) >= limits_.max_num_seqs &&
           (rest_empty() || rest_[rest_hi - 1]->req.priority <= BestWaitingPriority());
  };
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  while (budget > 0) {
    Sequence* r = rest_empty() ? nullptr : rest_[rest_lo];
    // A pick is admitted only if better than r and than admit_below.
    const int32_t below =
        std::min(r != nullptr ? r->req.priority : kNone, admit_below.value_or(kNone));
    auto wit = waiting_.end();
    if (admitting && !waiting_.empty() &&
        ((r == nullptr && !admit_below) || BestWaitingPriority() < below)) {
      if (no_seat_for_best()) {
        admitting = false;
        continue;
      }
      flush_charge();  // the pick reads virtual times
      wit = past_reserve_only
                ? FairShare::PickNextIf(waiting_.begin(), waiting_.end(), KeyOf, past_reserve)
                : FairShare::PickNext(waiting_.begin(), waiting_.end(), KeyOf);
      if (past_reserve_only && wit == waiting_.end()) admitting = false;  // none left: stop looking
    }
    Sequence* w = wit != waiting_.end() ? *wit : nullptr;
    if (w != nullptr && admit_below && w->req.priority >= *admit_below) w = nullptr;
    if (w != nullptr && (r == nullptr || w->req.priority < r->req.priority)) {
      EraseWaiting(wit);
      const Admit a = admit_one(w);
      if (a != Admit::kAdmitted) {
        PushWaitingFront(w);
        if (a == Admit::kHeldByReserve) {
          past_reserve_only = true;
        } else {
          admitting = false;
        }
      }
      continue;
    }
    if (r == nullptr) break;
    ++rest_lo;
    const uint32_t n = std::min(r->num_pending(), budget);
    TANDEM_CHECK(n > 0, "running sequence {} has nothing to compute", r->req.request_id);
    const uint32_t have = static_cast<uint32_t>(r->blocks.size());
    const uint32_t want = BlocksFor(r->num_computed + n);
    const uint32_t need = want > have ? want - have : 0;
    bool self_preempted = false;
    while (!blocks_->CanAllocate(need)) {
      if (!admit_below || r->req.priority < *admit_below) admit_below = r->req.priority;
      if (rest_empty()) {
        Preempt(r);
        ++out.num_preempted;
        self_preempted = true;
        break;
      }
      preempt_back();
    }
    if (self_preempted) break;
    // A later chunk of a prompt: quiet evictions, as at admission; a decode
    // step's (or an output recompute's) wake the Watch loop at once.
    auto fresh = blocks_->Allocate(need, /*quiet_evictions=*/r->num_computed < r->prompt_len);
    TANDEM_CHECK(fresh.ok(), "allocation after CanAllocate failed");
    r->blocks.insert(r->blocks.end(), fresh->begin(), fresh->end());
    done.push_back(r);
    add(r, n);
  }
  flush_charge();
  done.insert(done.end(), rest_.begin() + static_cast<std::ptrdiff_t>(rest_lo),
              rest_.begin() + static_cast<std::ptrdiff_t>(rest_hi));
  running_.swap(done);  // the old running_ is next step's `done` buffer
  UpdateGrowthRatio(out);
  // Nothing runs and nothing was admitted, yet waiting sequences hold
  // blocks — a decoder's prefilled requests that each need one more block
  // for their next token, say, in a pool they fill: no step would ever
  // free a block. The newest such holder gives its blocks back (it is
  // recomputed later, counted as a preemption, as vLLM recomputes a
  // preempted request) and the line is tried again. Each round drops one
  // holder's blocks, so this ends; a sequence the whole pool holds (the
  // decoder's Register checks prompt and max_tokens) is then admitted.
  if (out.seqs.empty() && running_.empty() && DropNewestWaitingHolder()) return Schedule();
  return out;
}

}  // namespace tandem::engine
