// Engine: the step (schedule under the lock, forward without it, sample and
// deliver), the engine thread and stop conditions.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/check.h"
#include "engine/engine.h"

namespace tandem::engine {

void Engine::Start() {
  TANDEM_CHECK(!thread_.joinable(), "engine started twice");
  thread_ = std::jthread([this](std::stop_token stop) { Loop(stop); });
}

void Engine::Stop() {
  if (thread_.joinable()) {
    thread_.request_stop();
    cv_.notify_all();
    thread_.join();
  }
  Deliveries out;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, seq] : seqs_) {
      if (seq->state == SeqState::kParked) {
        blocks_->Release(seq->blocks);
      } else {
        Finish(*seq, FinishReason::kAbort, UnavailableError("engine stopped"), out);
      }
    }
    seqs_.clear();
    for (auto& [id, res] : reservations_) blocks_->Release(res.blocks);
    reservations_.clear();
  }
  Deliver(out);
}

void Engine::Loop(std::stop_token stop) {
  while (!stop.stop_requested()) {
    Deliveries& out = step_out_;  // its slots are kept from step to step
    bool worked = false;
    uint64_t seen = 0;
    {
      std::unique_lock lock(mu_);
      const auto has_work = [&] {
        return scheduler_->num_waiting() > 0 || scheduler_->num_running() > 0;
      };
      if (!has_work()) ReleaseEvents();
      cv_.wait(lock, stop, has_work);
      if (stop.stop_requested()) break;
      seen = changes_;
      worked = StepLocked(lock, out);
    }
    DeliverStep(out);
    if (!worked) {
      // Work is waiting but nothing fits (blocks held by running, parked or
      // reserved requests): sleep until something is released or queued
      // (changes_ moves; issue 23: no 5 ms polling), or until the first
      // deadline of a queued request, which DropExpired then ends.
      ReleaseEvents();
      std::unique_lock lock(mu_);
      auto until = std::chrono::steady_clock::time_point::max();
      for (const Sequence* s : scheduler_->waiting()) {
        if (s->req.deadline) until = std::min(until, *s->req.deadline);
      }
      for (const Sequence* s : scheduler_->running()) {
        if (s->req.deadline) until = std::min(until, *s->req.deadline);
      }
      const auto changed = [&] { return changes_ != seen; };
      if (until == std::chrono::steady_clock::time_point::max()) {
        cv_.wait(lock, stop, changed);
      } else {
        cv_.wait_until(lock, stop, until, changed);
      }
    }
  }
  ReleaseEvents();
}

void Engine::Poke() { ++changes_; }

void Engine::HoldEvents() {
  if (events_held_) return;
  events_held_ = true;
  events_->Hold();
}

void Engine::FlushEvents() {
  if (!events_held_) return;
  events_->Release();
  events_->Hold();
}

void Engine::ReleaseEvents() {
  if (!events_held_) return;
  events_held_ = false;
  events_->Release();
}

bool Engine::Step() {
  TANDEM_CHECK(!thread_.joinable(), "Step() on an engine whose thread is running");
  Deliveries& out = step_out_;
  bool worked;
  {
    std::unique_lock lock(mu_);
    worked = StepLocked(lock, out);
  }
  DeliverStep(out);
  ReleaseEvents();
  return worked;
}

void Engine::RunUntilIdle() {
  while (true) {
    {
      std::lock_guard lock(mu_);
      if (scheduler_->num_waiting() == 0 && scheduler_->num_running() == 0) return;
    }
    if (!Step()) return;  // blocked: nothing can run
  }
}

void Engine::DropExpired(Deliveries& out) {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Sequence*> expired;
  for (Sequence* s : scheduler_->waiting()) {
    if (s->req.deadline && *s->req.deadline <= now) expired.push_back(s);
  }
  for (Sequence* s : scheduler_->running()) {
    if (s->req.deadline && *s->req.deadline <= now) expired.push_back(s);
  }
  for (Sequence* s : expired) {
    const bool queued = s->state == SeqState::kWaiting;
    Finish(*s, FinishReason::kDeadline,
           DeadlineExceededError(queued ? "deadline passed while queued" : "deadline passed while running"),
           out);
    const std::string id = s->req.request_id;
    seqs_.erase(id);
  }
}

bool Engine::StepLocked(std::unique_lock<std::mutex>& lock, Deliveries& out) {
  const auto t0 = std::chrono::steady_clock::now();
  HoldEvents();  // this step's allocations (and the last step's commits): one wake-up
  DropExpired(out);
  const SchedulerOutput& plan = scheduler_->Schedule();  // valid until the next step
  if (plan.empty()) return false;
  for (const ScheduledSeq& s : plan.seqs) {
    if (s.seq->queue_time_reported) continue;
    s.seq->queue_time_reported = true;
    if (options_.on_queue_time) {
      options_.on_queue_time(
          s.seq->req.priority, s.seq->req.tenant,
          std::chrono::duration<double>(t0 - s.seq->queued_since).count());
    }
  }

  const uint32_t vocab = config_.vocab_size;
  chunks_.clear();
  uint32_t rows = 0;
  for (const ScheduledSeq& s : plan.seqs) {
    Sequence& seq = *s.seq;
    seq.in_flight = true;
    SeqChunk c;
    c.tokens = std::span<const uint32_t>(seq.tokens).subspan(seq.num_computed, s.num_tokens);
    c.start_pos = seq.num_computed;
    c.block_table = seq.blocks;
    c.num_logits = s.samples ? 1 : 0;
    c.onboarded_host_blocks = std::exchange(seq.onboard_host_blocks, 0);
    c.onboarded_disk_blocks = std::exchange(seq.onboard_disk_blocks, 0);
    rows += c.num_logits;
    chunks_.push_back(c);
  }
  // A one-hot backend (sim) names each row's pick itself: no logits rows to
  // fill and scan when every sampled sequence's settings make that pick
  // certain (issue 23: 16 full-vocabulary rows per step were a tenth of a
  // sim decoder's CPU). Otherwise the rows are filled and sampled as usual.
  bool hot_only = backend_->one_hot_logits();
  for (size_t i = 0; hot_only && i < plan.seqs.size(); ++i) {
    hot_only = !plan.seqs[i].samples || OneHotPickIsCertain(plan.seqs[i].seq->req.sampling);
  }
  if (!hot_only && logits_.size() < size_t{rows} * vocab) logits_.resize(size_t{rows} * vocab);
  progress_.clear();
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const Sequence& seq = *plan.seqs[i].seq;
    if (!seq.req.on_kv_progress || chunks_[i].tokens.empty()) continue;
    ProgressChunk pc;
    pc.callback = &seq.req.on_kv_progress;
    pc.progress.final_tokens = chunks_[i].start_pos;
    pc.progress.chunk_end = chunks_[i].start_pos + static_cast<uint32_t>(chunks_[i].tokens.size());
    pc.progress.num_layers = pool_->layout().num_layers;
    pc.progress.attempt = seq.num_preemptions;
    pc.progress.block_table = chunks_[i].block_table;
    progress_.push_back(pc);
  }
  if (progress_.empty()) {
    backend_->set_layer_progress({});
  } else {
    const uint32_t layers = pool_->layout().num_layers;
    const uint32_t groups = std::clamp<uint32_t>(options_.kv_progress_layer_groups, 1, layers);
    const uint32_t per_group = (layers + groups - 1) / groups;
    backend_->set_layer_progress([this, layers, per_group](uint32_t done) {
      // The last group is reported after Forward returns.
      if (done < layers && done % per_group == 0) ReportKvProgress(done);
    });
  }

  // The scheduled sequences' tokens and blocks change only on this thread;
  // other threads may queue work or flag aborts meanwhile.
  lock.unlock();
  // The events since the last boundary (the last step's commits, this
  // step's allocations, and what other threads published meanwhile: a
  // decoder's AddPrefilled, Abort) wake the drainer now, once; the hold
  // goes on through the forward, so events published during it wait for
  // the next boundary (issue 23: one Watch wake-up per step at most while
  // the engine steps, not one per request start and end).
  FlushEvents();
  if (options_.on_forward_for_tests) options_.on_forward_for_tests();
  Status status =
      backend_->Forward(chunks_, hot_only ? std::span<float>() : std::span<float>(logits_));
  const std::span<const uint32_t> hot = backend_->hot_tokens();
  if (status.ok() && hot_only && hot.size() != rows) {
    status = InternalError(fmt::format("backend gave {} hot tokens for {} rows", hot.size(), rows));
  }
  if (status.ok() && !progress_.empty()) ReportKvProgress(pool_->layout().num_layers);
  lock.lock();
  HoldEvents();  // (still held) flushed by the next step's forward, or released before waiting for work

  uint32_t row = 0;
  for (const ScheduledSeq& s : plan.seqs) {
    Sequence& seq = *s.seq;
    seq.in_flight = false;
    if (!status.ok()) {
      Finish(seq, FinishReason::kError, status, out);
      continue;
    }
    seq.num_computed += s.num_tokens;
    // A decode step computed one output token's KV (its position is past
    // the prompt): its block waits for a run of them, or the end.
    const bool decode_step = s.num_tokens == 1 && seq.num_computed > seq.prompt_len;
    // A chunk step of a prompt still being prefilled (its last chunk not
    // yet computed): the blocks only extend that request's chain.
    const bool partial_prefill = !decode_step && seq.num_computed < seq.prompt_len;
    const bool last_chunk = !decode_step && !partial_prefill;
    // A prefill-only prompt's last chunk (a prefiller's request, which
    // parks here until its push is done): its blocks leave when it is
    // released (ReleasePrefill, Abort), with the Prefill reply, which the
    // proxy can then read on the same wake-up (issue 23). Not when an abort
    // came during the step: that request ends below, without parking.
    const bool parks = last_chunk && seq.req.prefill_only && !seq.abort_requested;
    // A run of output blocks, or a prefill chunk before the prompt's last:
    // its stored event wakes nobody (kv_events.h, "quiet"); it leaves with
    // the Watch loop's next update (the prompt's last chunk, any other
    // event, or the next load report).
    CommitFullBlocks(seq, decode_step ? kDecodeCommitBlocks : 1,
                     /*quiet=*/decode_step || partial_prefill || parks);
    // The prompt's last chunk: its earlier chunks' quiet events leave now
    // (with this step's), even when this chunk filled no block.
    if (last_chunk && !parks && events_ != nullptr) events_->WakeIfQuiet();
    if (seq.abort_requested) {
      Finish(seq, FinishReason::kAbort, CancelledError("request aborted"), out);
      if (s.samples) ++row;
      continue;
    }
    if (!s.samples) continue;
    uint32_t token;
    if (hot_only) {
      token = hot[row++];
    } else {
      const std::span<const float> logits(logits_.data() + size_t{row++} * vocab, vocab);
      const uint64_t index = uint64_t{seq.req.first_sample_index} + seq.num_output();
      token = sampler_.Sample(logits, seq.req.sampling, seq.seed, index);
    }
    AppendToken(seq, token, out);
  }
  // Only a scheduled sequence can have finished in this step (a walk of
  // every sequence's map node per step otherwise).
  bool any_finished = false;
  for (const ScheduledSeq& s : plan.seqs) any_finished |= s.seq->state == SeqState::kFinished;
  for (auto it = seqs_.begin(); any_finished && it != seqs_.end();) {
    it = it->second->state == SeqState::kFinished ? seqs_.erase(it) : std::next(it);
  }

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++counters_.steps;
  counters_.prefill_step_tokens += plan.num_prefill_tokens;
  counters_.prefill_step_pairs += plan.num_prefill_pairs;
  (plan.num_prefill_tokens > 0 ? counters_.prefill_step_seconds : counters_.decode_step_seconds) +=
      seconds;
  if (options_.on_step) {  // called by DeliverStep after the outputs (no callback object per step)
    step_stats_.seconds = seconds;
    step_stats_.num_seqs = static_cast<uint32_t>(plan.seqs.size());
    step_stats_.num_prefill_tokens = plan.num_prefill_tokens;
    step_stats_.num_decode_tokens = plan.num_decode_tokens;
    step_stats_ready_ = true;
  }
  return true;
}

void Engine::ReportKvProgress(uint32_t layers_done) {
  for (ProgressChunk& pc : progress_) {
    pc.progress.layers_done = layers_done;
    (*pc.callback)(pc.progress);
  }
}

void Engine::CommitFullBlocks(Sequence& seq, uint32_t min_new, bool quiet) {
  const uint32_t full = std::min<uint32_t>(seq.num_computed / options_.block_size,
                                           static_cast<uint32_t>(seq.blocks.size()));
  if (full < seq.num_committed + std::max<uint32_t>(min_new, 1) || seq.commit_stopped) return;
  scheduler_->UpdateHashes(seq);
  // Keep every cached chain prefix-closed on the device (a committed
  // block's parent is committed too), which the router's prefix search
  // relies on (docs/router.md, "Prefix index"). If another sequence
  // committed block c first (two prefills of one prefix at once), ours
  // stays private, and a tail committed after it would hang under the
  // other one's block and could outlive it; if the cache was cleared under
  // us, our parent block lost its hash. Either way the rest of this
  // sequence stays private. (Lower tiers do not count: committing to the
  // device moves a block up, see BlockManager::Commit.)
  const uint32_t c = seq.num_committed;
  if (c > 0 && !blocks_->is_committed(seq.blocks[c - 1])) {
    seq.commit_stopped = true;
    return;
  }
  blocks_->Commit(seq.blocks, seq.hashes, seq.tokens, c, 1, seq.root_hash, quiet);
  if (!blocks_->is_committed(seq.blocks[c])) {
    seq.commit_stopped = true;
    return;
  }
  if (full > c + 1) {
    blocks_->Commit(seq.blocks, seq.hashes, seq.tokens, c + 1, full - c - 1, seq.root_hash, quiet);
  }
  seq.num_committed = full;
}

bool Engine::AppendToken(Sequence& seq, uint32_t token, Deliveries& out) {
  seq.tokens.push_back(token);
  ++counters_.generated_tokens;
  const SamplingParams& p = seq.req.sampling;
  bool stop_string = false;
  if (seq.detok) {
    std::string piece = seq.detok->Push(token);
    if (seq.stop_matcher) {
      auto chunk = seq.stop_matcher->Push(piece);
      seq.pending_text += chunk.text;
      stop_string = chunk.stopped;
      seq.stop_string_hit = chunk.stopped;
    } else {
      seq.pending_text += piece;
    }
  }
  FinishReason reason = FinishReason::kNone;
  const auto& eos = config_.eos_token_ids;
  if (seq.req.prefill_only) {
    reason = FinishReason::kPrefillDone;
  } else if (stop_string ||
             std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
                 p.stop_token_ids.end() ||
             (!p.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())) {
    reason = FinishReason::kStop;
  } else if (seq.num_output() >= p.max_tokens || seq.tokens.size() >= max_model_len_) {
    reason = FinishReason::kLength;
  }
  if (reason != FinishReason::kNone) {
    Finish(seq, reason, Status::Ok(), out);
    return true;
  }
  FillOutput(seq, out.Add(seq.on_output));
  seq.num_delivered = seq.num_output();
  seq.pending_text.clear();
  return false;
}

void Engine::FillOutput(const Sequence& seq, RequestOutput& o) const {
  o.request_id.assign(seq.req.request_id);
  o.token_ids.assign(seq.tokens.begin() + seq.prompt_len + seq.num_delivered, seq.tokens.end());
  o.text.assign(seq.pending_text);
  o.prompt_tokens = seq.prompt_len;
  o.completion_tokens = seq.num_output();
  o.cached_prompt_tokens = seq.cached_prompt_tokens;
}

void Engine::Finish(Sequence& seq, FinishReason reason, Status status, Deliveries& out) {
  scheduler_->Remove(&seq);
  if (reason == FinishReason::kStop || reason == FinishReason::kLength) {
    scheduler_->NoteEnded(seq.num_output(), seq.req.sampling.max_tokens);
  }
  if (reason == FinishReason::kPrefillDone) {
    seq.state = SeqState::kParked;  // blocks stay pinned until ReleasePrefill / Abort
  } else {
    // Output blocks still waiting for their run (kDecodeCommitBlocks):
    // their KV is final (num_computed counts only steps that succeeded).
    CommitFullBlocks(seq);
    blocks_->Release(seq.blocks);
    seq.blocks.clear();
    seq.state = SeqState::kFinished;
  }
  if (seq.detok && !seq.stop_string_hit) {
    std::string tail = seq.detok->Flush();
    if (seq.stop_matcher) {
      auto chunk = seq.stop_matcher->Push(tail);
      seq.pending_text += chunk.text;
      if (!chunk.stopped) seq.pending_text += seq.stop_matcher->Flush();
    } else {
      seq.pending_text += tail;
    }
  }
  RequestOutput& o = out.Add(seq.on_output);
  FillOutput(seq, o);
  o.finished = true;
  o.finish_reason = reason;
  o.status = std::move(status);
  if (reason == FinishReason::kPrefillDone) o.block_ids.assign(seq.blocks.begin(), seq.blocks.end());
  seq.num_delivered = seq.num_output();
  seq.pending_text.clear();
}

}  // namespace tandem::engine
