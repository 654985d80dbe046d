#include "prefiller/prefiller.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/logging.h"

namespace tandem::prefiller {

namespace {

using SteadyClock = std::chrono::steady_clock;
using SystemClock = std::chrono::system_clock;

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

Status StatusFor(const engine::RequestOutput& out) {
  if (!out.status.ok()) return out.status;
  switch (out.finish_reason) {
    case engine::FinishReason::kAbort: return CancelledError("prefill aborted");
    case engine::FinishReason::kDeadline: return DeadlineExceededError("deadline passed");
    default:
      return InternalError(fmt::format("prefill ended with '{}' instead of a first token",
                                       engine::FinishReasonName(out.finish_reason)));
  }
}

}  // namespace

uint64_t ArrivalKey(SteadyClock::time_point now, std::chrono::microseconds waited) {
  using std::chrono::microseconds;
  using std::chrono::nanoseconds;
  const int64_t at = std::chrono::duration_cast<nanoseconds>(now.time_since_epoch()).count();
  const microseconds counted = std::clamp(waited, microseconds(0), kMaxWaited);
  const int64_t back = std::chrono::duration_cast<nanoseconds>(counted).count();
  return at - back >= 1 ? static_cast<uint64_t>(at - back) : 1;
}

Prefiller::Prefiller(engine::Engine& engine, kvtransfer::Transport& transport, DecoderLink& link,
                     PrefillerOptions options)
    : engine_(engine), transport_(transport), link_(link), options_(std::move(options)),
      sealer_(transport), slice_pusher_(transport, /*rank=*/0), targets_(transport) {}

Result<std::optional<PushPlan::Sliced>> Prefiller::SlicedPlan(const ReserveTarget& t) {
  const parallel::ParallelLayout& mine = options_.layout;
  const parallel::ParallelLayout& decode = t.decode_layout;
  if (mine.world() <= 1 && decode.world() <= 1) return std::optional<PushPlan::Sliced>{};
  const std::string pair = fmt::format("prefill {} -> decode {}", parallel::ToString(mine),
                                       parallel::ToString(decode));
  // docs/parallelism.md: a push between multi-rank workers is neither
  // sealed nor checksummed (no rank holds a whole block); the config check
  // refuses these at start-up, this is the backstop.
  if (options_.encrypt || !t.kv_key.empty()) {
    return FailedPreconditionError(fmt::format(
        "{}: transport.encrypt is not supported with tensor/pipeline-parallel workers", pair));
  }
  if (options_.checksum) {
    return FailedPreconditionError(fmt::format(
        "{}: transport.checksum is not supported with tensor/pipeline-parallel workers (set it "
        "false)", pair));
  }
  if (mine.world() > 1 && !options_.follower_push) {
    return FailedPreconditionError(
        fmt::format("{}: this prefiller has no follower ranks to push their KV slices", pair));
  }
  parallel::KvDims dims = options_.kv_dims;
  if (dims.num_layers == 0) {
    if (mine.world() > 1) {
      return FailedPreconditionError(fmt::format("{}: the model's KV dims are not known", pair));
    }
    const engine::KvLayout& l = engine_.pool().layout();
    dims = {.num_layers = l.num_layers, .num_kv_heads = l.num_kv_heads, .head_dim = l.head_dim,
            .block_size = l.block_size, .bytes_per_elem = sizeof(float)};
  }
  PushPlan::Sliced sliced;
  kvtransfer::SlicePushSpec& spec = sliced.spec;
  spec.prefill = mine;
  spec.decode = decode;
  spec.dims = dims;
  spec.decode_descriptors = t.rank_descriptors;
  if (spec.decode_descriptors.empty() && decode.world() == 1) {
    spec.decode_descriptors.push_back(t.transport_descriptor);
  }
  spec.slots = t.slots;
  spec.cached_blocks = t.cached_blocks;
  kvtransfer::SlicePushSpec check = spec;
  check.block_ids = spec.slots;  // Finish supplies the real ones
  TANDEM_RETURN_IF_ERROR(check.Validate().WithContext(pair));
  TANDEM_ASSIGN_OR_RETURN(parallel::KvSlicePlan plan, parallel::PlanKvSlices(mine, decode, dims));
  for (uint32_t r = 0; r < mine.world(); ++r) sliced.senders += plan.FromRank(r).empty() ? 0 : 1;
  sliced.pusher = &slice_pusher_;
  sliced.followers = options_.follower_push;
  return std::optional<PushPlan::Sliced>(std::move(sliced));
}

Prefiller::~Prefiller() { Stop(); }

void EngineProgress::Scheduled() {
  std::lock_guard lock(mu_);
  if (listener_ != nullptr) listener_->EngineMoved(Prefiller::EngineWait::kScheduled);
}

void EngineProgress::StepEnded() {
  std::lock_guard lock(mu_);
  // With other requests on the engine, any step may have changed what the
  // dispatcher waits for.
  if (listener_ != nullptr) {
    listener_->EngineMoved(shared_ ? Prefiller::EngineWait::kNone : Prefiller::EngineWait::kEnded);
  }
}

void Prefiller::Start() {
  if (options_.engine_progress) {
    std::lock_guard lock(options_.engine_progress->mu_);
    options_.engine_progress->listener_ = this;
  }
  link_.SetLateTargetHandler(lifeline_.Guard(
      [this](const std::string& request_id, ReserveTarget target) {
        OnLateTarget(request_id, target);
      }));
  link_.SetSeatWaitHandler(
      lifeline_.Guard([this](const std::string& request_id) { OnSeatWait(request_id); }));
  dispatcher_ = std::jthread([this](std::stop_token stop) { DispatchLoop(stop); });
}

void Prefiller::Stop() {
  if (options_.engine_progress) {
    std::lock_guard lock(options_.engine_progress->mu_);
    if (options_.engine_progress->listener_ == this) options_.engine_progress->listener_ = nullptr;
  }
  if (dispatcher_.joinable()) {
    dispatcher_.request_stop();
    cv_.notify_all();
    dispatcher_.join();
  }
  std::deque<JobPtr> queued;
  std::vector<std::string> live;
  {
    std::lock_guard lock(mu_);
    queued.swap(queue_);
    stopping_ = true;
    for (const auto& [id, job] : jobs_) {
      if (job->stage != Stage::kQueued) live.push_back(id);
    }
  }
  for (auto& job : queued) Complete(job, UnavailableError("this prefiller is shutting down"));
  // In flight (a drain that ran out of time): aborted like a cancel, then a
  // bounded wait for their ends, which tell the decoders (error notices).
  for (const auto& id : live) CancelJob(id, UnavailableError("this prefiller is shutting down"));
  std::vector<JobPtr> late;
  {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(options_.stop_wait_seconds),
                 [&] { return jobs_.empty(); });
    for (const auto& [id, job] : jobs_) late.push_back(job);
  }
  lifeline_.End();
  // Their ends did not come in time (a write still on the wire, a Reserve
  // unanswered): the decoder keeps the reservation until its lease (it
  // cannot know whether bytes still land), and what arrives for them now
  // runs nothing here.
  for (const auto& job : late) {
    engine_.ReleasePrefill(job->spec.request_id).IgnoreError();
    Complete(job, UnavailableError(fmt::format(
                      "this prefiller is shutting down: request '{}' did not end within {} s of "
                      "being aborted",
                      job->spec.request_id, options_.stop_wait_seconds)));
  }
}

void Prefiller::SetDraining() {
  std::lock_guard lock(mu_);
  draining_ = true;
}

PrefillerCounts Prefiller::counts() const {
  std::lock_guard lock(mu_);
  PrefillerCounts c = totals_;
  c.queued = static_cast<uint32_t>(queue_.size());
  c.inflight = static_cast<uint32_t>(jobs_.size() - queue_.size());
  c.queued_prompt_tokens = 0;
  for (const auto& j : queue_) c.queued_prompt_tokens += static_cast<uint32_t>(j->spec.prompt_ids.size());
  for (const auto& [tenant, tokens] : fair_.served()) c.fair_share_deficit_tokens[tenant] = 0;
  for (const auto& j : queue_) {
    const double behind = fair_.SystemTime() - j->fair_tenant->virtual_time;
    c.fair_share_deficit_tokens[j->spec.tenant] = std::max(0.0, behind * j->spec.tenant_weight);
  }
  return c;
}

Status Prefiller::Submit(PrefillJob spec, PrefillDone done) {
  if (spec.request_id.empty()) return InvalidArgumentError("request_id is empty");
  if (spec.decoder_address.empty()) return InvalidArgumentError("decoder_address is empty");
  // Bad input fails here, before a decoder reserves anything for it.
  // Refused before anything is reserved on the decoder.
  TANDEM_RETURN_IF_ERROR(
      engine_.CheckPrompt(spec.prompt_ids, spec.sampling, /*prefill_only=*/true));
  auto job = std::make_shared<Job>();
  if (spec.deadline) {
    if (*spec.deadline <= SystemClock::now()) {
      return DeadlineExceededError(fmt::format("request '{}': deadline already passed", spec.request_id));
    }
    job->deadline = SteadyClock::now() + (*spec.deadline - SystemClock::now());
  }
  job->spec = std::move(spec);
  job->done = std::move(done);
  {
    std::lock_guard lock(mu_);
    if (draining_) return UnavailableError("this prefiller is shutting down");
    if (jobs_.count(job->spec.request_id) != 0) {
      return AlreadyExistsError(fmt::format("request '{}' is already here", job->spec.request_id));
    }
    if (queue_.size() >= options_.max_queue) {
      return ResourceExhaustedError(fmt::format("prefill queue is full ({} requests)", options_.max_queue));
    }
    jobs_.emplace(job->spec.request_id, job);
    job->queued_at = SteadyClock::now();
    job->arrival = ArrivalKey(job->queued_at, job->spec.waited);
    job->fair_tenant = fair_.Enqueue(job->spec.tenant, job->spec.tenant_weight);
    queue_.push_back(job);
    LogRequest(spdlog::level::debug, job->spec.request_id,
               "queued ({} prompt tokens, {} ahead) for decoder '{}'",
               job->spec.prompt_ids.size(), queue_.size() - 1, job->spec.decoder_name);
    // The dispatcher acts on it now only if the queue was empty; otherwise
    // it already waits for what the head needs, or for an earlier deadline.
    if (queue_.size() == 1 || (job->deadline && *job->deadline < asleep_until_)) {
      WakeDispatcherLocked();
    }
  }
  return Status::Ok();
}

void Prefiller::WakeDispatcherLocked() {
  wake_ = true;
  if (dispatcher_asleep_) cv_.notify_all();
}

void Prefiller::EngineMoved(EngineWait what) {
  std::lock_guard lock(mu_);
  engine_moved_ = true;
  // kNone: whatever it waits for.
  if (waiting_for_engine_ != EngineWait::kNone &&
      (what == EngineWait::kNone || what == waiting_for_engine_)) {
    WakeDispatcherLocked();
  }
}

void Prefiller::DispatchLoop(std::stop_token stop) {
  std::unique_lock lock(mu_);
  while (!stop.stop_requested()) {
    // Queued requests whose deadline passed end here; the earliest other
    // deadline bounds the sleep.
    std::vector<JobPtr> expired;
    auto until = SteadyClock::time_point::max();
    const auto now = SteadyClock::now();
    for (auto it = queue_.begin(); it != queue_.end();) {
      if ((*it)->deadline && *(*it)->deadline <= now) {
        expired.push_back(*it);
        it = queue_.erase(it);
        ++totals_.expired_in_queue;
      } else {
        if ((*it)->deadline) until = std::min(until, *(*it)->deadline);
        ++it;
      }
    }
    if (!expired.empty()) {
      lock.unlock();
      for (auto& job : expired) {
        Complete(job, DeadlineExceededError(fmt::format(
                          "request '{}': deadline passed while queued for prefill", job->spec.request_id)));
      }
      lock.lock();
      continue;
    }
    wake_ = false;
    // The next request in service order, if the ones reserving leave it room
    // in the engine's next step; otherwise a reservation's answer wakes us.
    // A request for a decoder that holds one of our calls waiting for a seat
    // waits here, in its place, until that call is answered.
    auto pick = [&]() -> std::optional<std::deque<JobPtr>::iterator> {
      if (queue_.empty()) return std::nullopt;
      auto key = [](const JobPtr& j) {
        return engine::QueueKey{j->spec.priority, j->fair_tenant, j->arrival};
      };
      auto next = engine::FairShare::PickNextIf(
          queue_.begin(), queue_.end(), key,
          [this](const JobPtr& j) { return !seat_waiting_.contains(j->spec.decoder_address); });
      if (next == queue_.end()) return std::nullopt;
      if (admitting_ != 0 && (admitting_ >= options_.max_num_seqs ||
                              admitting_tokens_ + (*next)->spec.prompt_ids.size() >
                                  options_.max_batched_tokens)) {
        return std::nullopt;
      }
      return next;
    };
    if (pick()) {
      // Admit only when the engine would schedule it right away: nothing
      // waiting, and room for every request reserving besides this one.
      engine_moved_ = false;
      lock.unlock();
      const engine::EngineStats st = engine_.stats();
      lock.lock();
      if (st.num_waiting == 0 && st.num_running + admitting_ < options_.max_num_seqs) {
        auto next = pick();  // the queue may have changed meanwhile
        if (!next) continue;
        JobPtr job = **next;
        queue_.erase(*next);
        fair_.Picked(*job->fair_tenant);
        engine::FairShare::Charge(*job->fair_tenant, job->spec.prompt_ids.size());
        job->stage = Stage::kReserving;
        job->reserve_sent = SteadyClock::now();
        job->admission_held = true;
        ++admitting_;
        admitting_tokens_ += job->spec.prompt_ids.size();
        lock.unlock();
        link_.Reserve(job->spec, options_.name, lifeline_.Guard([this, job](Result<ReserveTarget> t) {
                        OnReserved(job, std::move(t));
                      }));
        lock.lock();
        continue;
      }
      if (engine_moved_) continue;  // it changed while we looked
      // A waiting request leaves the queue at a step's start (on_queue_time);
      // a running one ends in a step (on_step) or, if it is ours, in Complete.
      waiting_for_engine_ = st.num_waiting > 0 ? EngineWait::kScheduled : EngineWait::kEnded;
      if (!options_.engine_progress) {
        until = std::min(until, SteadyClock::now() + SteadyClock::duration(kEnginePoll));
      } else if (options_.engine_progress->shared_) {
        until = std::min(until, SteadyClock::now() + SteadyClock::duration(kEngineBackstop));
      }
    }
    // Asleep until a request is queued (to an empty queue, or with an
    // earlier deadline), a reservation is answered, the engine moves (while
    // it had no room), a queued deadline passes, or Stop.
    if (wake_) continue;
    dispatcher_asleep_ = true;
    asleep_until_ = until;
    if (until == SteadyClock::time_point::max()) {
      cv_.wait(lock, stop, [&] { return wake_; });
    } else {
      cv_.wait_until(lock, stop, until, [&] { return wake_; });
    }
    dispatcher_asleep_ = false;
    waiting_for_engine_ = EngineWait::kNone;
    asleep_until_ = SteadyClock::time_point::max();
  }
}

void Prefiller::EndAdmissionLocked(Job& job) {
  if (job.admission_held) {
    job.admission_held = false;
    --admitting_;
    admitting_tokens_ -= job.spec.prompt_ids.size();
  }
  if (job.seat_waiting) {
    job.seat_waiting = false;
    auto it = seat_waiting_.find(job.spec.decoder_address);
    if (it != seat_waiting_.end() && --it->second == 0) seat_waiting_.erase(it);
  }
}

void Prefiller::OnSeatWait(const std::string& request_id) {
  std::lock_guard lock(mu_);
  auto it = jobs_.find(request_id);
  if (it == jobs_.end()) return;
  Job& job = *it->second;
  if (job.stage != Stage::kReserving || !job.admission_held) return;
  ++totals_.reserve_seat_waits;
  EndAdmissionLocked(job);
  job.seat_waiting = true;
  ++seat_waiting_[job.spec.decoder_address];
  if (!queue_.empty()) WakeDispatcherLocked();
}

void Prefiller::OnReserved(const JobPtr& job, Result<ReserveTarget> target) {
  auto admitted = [this, &job] {
    std::lock_guard lock(mu_);
    EndAdmissionLocked(*job);
    if (!queue_.empty()) WakeDispatcherLocked();
  };
  const std::string& id = job->spec.request_id;
  if (!target.ok()) {
    admitted();
    Status s = target.status();
    if (s.code() == StatusCode::kResourceExhausted) {
      std::lock_guard lock(mu_);
      ++totals_.reservations_refused;
    }
    Complete(job, s.WithContext(fmt::format("reserving KV on decoder '{}' ({})",
                                            job->spec.decoder_name, job->spec.decoder_address)));
    return;
  }
  {
    // The lease as we must assume it: it started no earlier than our
    // request, and ends no later than the decoder says (clocks may differ
    // across hosts, so the local bound matters).
    const auto now = SteadyClock::now();
    auto deadline = job->reserve_sent + std::chrono::duration_cast<SteadyClock::duration>(
                                            std::chrono::duration<double>(options_.lease_seconds));
    if (target->lease_expiry != SystemClock::time_point{}) {
      deadline = std::min(deadline, now + std::chrono::duration_cast<SteadyClock::duration>(
                                              target->lease_expiry - SystemClock::now()));
    }
    std::lock_guard lock(mu_);
    job->target = *target;
    job->have_target = true;
    job->lease_deadline = deadline;
  }
  auto peer = targets_.PeerFor(target->transport_descriptor);
  if (!peer.ok()) {
    {
      std::lock_guard lock(mu_);
      ++totals_.dropped_target_lost;
    }
    admitted();  // the decoder frees the reservation when its lease expires
    Complete(job, UnavailableError(fmt::format("cannot reach the KV transport of decoder '{}': {}",
                                               job->spec.decoder_name, peer.status().message())));
    return;
  }
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    job->peer = *peer;
    job->have_peer = true;
    cancelled = job->cancelled;
    if (!cancelled) {
      job->stage = Stage::kPrefilling;
      job->submitted = SteadyClock::now();
    }
  }
  if (cancelled) {
    admitted();
    SendErrorNotice(job, CancelledError("prefill cancelled"));
    Complete(job, job->cancel_status);  // written before `cancelled`, never after
    return;
  }
  auto sliced = SlicedPlan(*target);
  if (!sliced.ok()) {
    admitted();
    Status s = sliced.status().WithContext(fmt::format("request '{}'", id));
    SendErrorNotice(job, s);
    Complete(job, s);
    return;
  }
  if (*sliced) (*sliced)->spec.request_id = id;
  {
    PushPlan plan;
    plan.peer = *peer;
    plan.sliced = std::move(*sliced);
    if (plan.sliced) job->ranks_pushed = plan.sliced->senders;
    plan.slots = target->slots;
    plan.cached_blocks = target->cached_blocks;
    plan.prompt_tokens = static_cast<uint32_t>(job->spec.prompt_ids.size());
    plan.block_size = engine_.block_size();
    plan.block_bytes = transport_.block_bytes();
    plan.num_layers = engine_.pool().layout().num_layers;
    // Layer runs need whole layers per block; otherwise whole blocks only.
    if (plan.num_layers == 0 || plan.block_bytes % plan.num_layers != 0) plan.num_layers = 1;
    plan.checksum = options_.checksum;
    std::lock_guard lock(mu_);
    job->push = PushStream::Create(transport_, std::move(plan), options_.push_mode);
  }
  if (Status sealing = EnableSealing(job); !sealing.ok()) {
    admitted();
    SendErrorNotice(job, sealing);
    Complete(job, sealing);
    return;
  }
  engine::GenerateRequest req;
  req.request_id = id;
  req.prompt_ids = job->spec.prompt_ids;
  req.sampling = job->spec.sampling;
  req.deadline = job->deadline;
  req.prefill_only = true;
  req.first_sample_index = job->spec.first_sample_index;
  req.cache_salt = job->spec.cache_salt;
  req.priority = job->spec.priority;
  req.tenant = job->spec.tenant;
  req.tenant_weight = job->spec.tenant_weight;
  req.queued_since = job->queued_at;  // queue time counts the service queue too
  req.on_output =
      lifeline_.Guard([this, job](const engine::RequestOutput& out) { OnOutput(job, out); });
  if (options_.push_mode == PushMode::kStreaming) {
    // job->push and lease_deadline are written before Submit and never after.
    req.on_kv_progress = lifeline_.Guard([this, job](const engine::KvProgress& p) {
      job->push->OnProgress(p, LeaseAllowsPost(*job));
    });
  }
  Status s = engine_.Submit(std::move(req));
  admitted();
  if (!s.ok()) {
    SendErrorNotice(job, s);
    Complete(job, s);
  }
}

bool Prefiller::LeaseAllowsPost(const Job& job) const {
  // Leave a margin for the push itself: a write that lands after the
  // lease could corrupt whatever the decoder put in those slots since.
  const auto margin = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(std::min(1.0, 0.25 * options_.lease_seconds)));
  return SteadyClock::now() + margin < job.lease_deadline;
}

void Prefiller::GiveUp(const JobPtr& job, Status why, bool release_prefill) {
  auto finish = lifeline_.Guard([this, job, why, release_prefill] {
    if (release_prefill) engine_.ReleasePrefill(job->spec.request_id).IgnoreError();
    SendErrorNotice(job, why);
    Complete(job, why);
  });
  std::shared_ptr<PushStream> push;
  {
    std::lock_guard lock(mu_);
    push = job->push;
  }
  if (push) {
    // Bytes already streamed may still be landing: tell the decoder to free
    // the slots only once none can.
    push->Abort(std::move(finish));
  } else {
    finish();
  }
}

void Prefiller::OnOutput(const JobPtr& job, const engine::RequestOutput& out) {
  if (!out.finished) return;
  const std::string& id = job->spec.request_id;
  if (out.finish_reason != engine::FinishReason::kPrefillDone) {
    bool cancelled;
    {
      std::lock_guard lock(mu_);
      cancelled = job->cancelled;
    }
    Status s = cancelled ? job->cancel_status : StatusFor(out);
    GiveUp(job, s, /*release_prefill=*/false);
    return;
  }
  const uint32_t bs = engine_.block_size();
  const uint32_t num_prompt_blocks =
      static_cast<uint32_t>((job->spec.prompt_ids.size() + bs - 1) / bs);
  Status bad;
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    job->parked = true;
    cancelled = job->cancelled;
    const ReserveTarget& t = job->target;
    if (!cancelled && !LeaseAllowsPost(*job)) {
      ++totals_.dropped_lease_expired;
      bad = UnavailableError(fmt::format(
          "request '{}': the KV was ready too late for the decoder's lease on its slots "
          "({} s); dropped without writing (was this prefiller paused?)",
          id, options_.lease_seconds));
    } else if (out.token_ids.empty() || out.block_ids.size() < num_prompt_blocks ||
        t.slots.size() != num_prompt_blocks || t.cached_blocks > num_prompt_blocks) {
      bad = InternalError(fmt::format(
          "request '{}': {} prompt blocks, the engine pinned {}, the decoder gave {} slots "
          "({} cached)", id, num_prompt_blocks, out.block_ids.size(), t.slots.size(), t.cached_blocks));
    } else if (!cancelled) {
      PrefillResult& r = job->result;
      r.first_token_id = out.token_ids.back();
      r.cached_prompt_tokens = out.cached_prompt_tokens;
      r.decoder_cached_blocks = t.cached_blocks;
      r.transferred_blocks = num_prompt_blocks - t.cached_blocks;
      r.prefill_seconds = SecondsSince(job->submitted);
      job->stage = Stage::kTransferring;
      job->transfer_started = SteadyClock::now();
    }
  }
  if (cancelled || !bad.ok()) {
    GiveUp(job, cancelled ? job->cancel_status : bad,
           /*release_prefill=*/true);
    return;
  }
  NoticeSpec n;
  n.request_id = id;
  n.reservation_id = job->target.reservation_id;
  n.generation = job->target.generation;
  n.capability = job->target.capability;
  n.first_token_id = job->result.first_token_id;
  n.cached_prompt_tokens = job->result.cached_prompt_tokens;
  n.ranks_pushed = job->ranks_pushed;
  std::vector<uint32_t> blocks(out.block_ids.begin(), out.block_ids.begin() + num_prompt_blocks);
  if (Status sealed = SealPush(job, blocks, n); !sealed.ok()) {
    GiveUp(job, sealed, /*release_prefill=*/true);  // streamed bytes may still be landing
    return;
  }
  // The notice goes after every byte of the reservation (push_stream.h);
  // a cancel from here on aborts the push (Cancel, stage kTransferring).
  job->push->Finish(std::move(blocks),
                    lifeline_.Guard([this, n](std::vector<uint64_t> sums) mutable {
                      n.block_checksums = std::move(sums);
                      return link_.EncodeNotice(n);
                    }),
                    lifeline_.Guard([this, job](kvtransfer::XferStatus st, const Status& detail) {
                      OnTransferDone(job, st, detail);
                    }));
}

void Prefiller::OnTransferDone(const JobPtr& job, kvtransfer::XferStatus status,
                               const Status& detail) {
  const std::string& id = job->spec.request_id;
  if (status == kvtransfer::XferStatus::kSuccess) {
    PrefillResult r;
    bool live;
    {
      std::lock_guard lock(mu_);
      job->result.transfer_seconds = SecondsSince(job->transfer_started);
      job->result.transferred_bytes = job->push->bytes_posted();
      job->result.transfers = job->push->transfers_posted();
      r = job->result;
      live = job->stage != Stage::kDone;
    }
    // The prefill's numbers before its parked blocks leave the engine: a
    // scrape that finds this worker idle (no parked prefill) counts it.
    if (live && options_.on_complete) options_.on_complete(r);
    engine_.ReleasePrefill(id).IgnoreError();
    LogRequest(spdlog::level::debug, id,
               "pushed {} KV blocks ({} bytes, {} cached on the decoder) in {} transfers, {:.4f} s "
               "of it after the prefill; prefill {:.4f} s, {} prompt tokens cached here",
               r.transferred_blocks, r.transferred_bytes, r.decoder_cached_blocks, r.transfers,
               r.transfer_seconds, r.prefill_seconds, r.cached_prompt_tokens);
    Complete(job, r);
    return;
  }
  engine_.ReleasePrefill(id).IgnoreError();
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    cancelled = job->cancelled;
  }
  // ERR_INVALID_ARGUMENT: this prefiller built a push its transport
  // refuses (a notice over the transport's limit, a slot outside the
  // decoder's pool, an unsealed block): the same push would be refused
  // again on any retry, so the request fails INTERNAL, which the proxy does
  // not retry, instead of UNAVAILABLE, which it would re-route (each retry
  // a full prefill). Every other failure is the way to the decoder.
  const bool refused_here = status == kvtransfer::XferStatus::kErrInvalidArgument;
  Status s = cancelled ? job->cancel_status
             : refused_here
                 ? InternalError(fmt::format(
                       "KV push to decoder '{}' could not be prepared ({}): {}; not retried: the "
                       "same push would be refused again",
                       job->spec.decoder_name, kvtransfer::XferStatusName(status),
                       detail.message()))
                 : UnavailableError(fmt::format(
                       "KV push to decoder '{}' failed ({}): {}", job->spec.decoder_name,
                       kvtransfer::XferStatusName(status), detail.message()));
  if (!cancelled && refused_here) {
    LogRequest(spdlog::level::err, id, "blocks freed, request failed: {}", s.message());
  } else if (!cancelled) {
    std::lock_guard lock(mu_);
    ++totals_.dropped_target_lost;
    LogRequest(spdlog::level::warn, id, "push target lost; dropped, blocks freed: {}", s.message());
  }
  if (status == kvtransfer::XferStatus::kErrRemoteDisconnect) {
    // The transport declared the endpoint lost; the decoder may well be
    // alive (a keep-alive failure, a partition that healed, a pause) and
    // holds the reservation until it hears from us: SendErrorNotice tells
    // it over a fresh endpoint once this one is released.
    std::string descriptor;
    kvtransfer::PeerId peer = 0;
    bool have_peer = false;
    {
      std::lock_guard lock(mu_);
      descriptor = job->target.transport_descriptor;
      peer = job->peer;
      have_peer = job->have_peer;
    }
    if (have_peer) targets_.Lost(descriptor, peer);
  }
  // No byte of the aborted push lands after this: the decoder may reuse the
  // slots. A decoder that restarted (stale descriptor) holds none of ours.
  if (status != kvtransfer::XferStatus::kErrStaleDescriptor) SendErrorNotice(job, s);
  Complete(job, s);
}

Status Prefiller::EnableSealing(const JobPtr& job) {
  const ReserveTarget& t = job->target;  // written before the push was created, never after
  if (t.kv_key.empty()) {
    if (!options_.encrypt) return Status::Ok();
    return FailedPreconditionError(fmt::format(
        "decoder '{}' sent no KV key, but transport.encrypt is on here: refusing to push "
        "plaintext (the fleet file's transport.encrypt must agree)", job->spec.decoder_name));
  }
  if (transport_.staging_blocks() == 0) {
    return FailedPreconditionError(fmt::format(
        "decoder '{}' wants its KV encrypted but transport.encrypt is off on this prefiller, so "
        "it has no staging blocks to seal into (the fleet file's transport.encrypt must agree)",
        job->spec.decoder_name));
  }
  Status s = job->push->EnableSealing(sealer_, t.kv_key, t.reservation_id);
  return s.ok() ? s : s.WithContext("the decoder's KV key (transport.encrypt)");
}

Status Prefiller::SealPush(const JobPtr& job, std::span<const uint32_t> blocks, NoticeSpec& n) {
  if (!job->push->sealing()) return Status::Ok();
  auto tags = job->push->SealRest(blocks);
  if (!tags.ok()) return tags.status().WithContext("sealing the KV push (transport.encrypt)");
  n.kv_tags = std::move(*tags);
  return Status::Ok();
}

void Prefiller::Complete(const JobPtr& job, Result<PrefillResult> result) {
  PrefillDone done;
  std::shared_ptr<PushStream> push;
  {
    std::lock_guard lock(mu_);
    if (job->stage == Stage::kDone) return;
    job->stage = Stage::kDone;
    auto it = jobs_.find(job->spec.request_id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
    if (stopping_ && jobs_.empty()) cv_.notify_all();
    done = std::move(job->done);
    push = job->push;
    if (job->spec.trace.sampled) TraceLocked(*job, result);
  }
  // No write reads the push's staging blocks any more: every path here
  // comes after the push's end (its done, or an Abort's then) or before it began.
  if (push) push->ReleaseStaging();
  // Its engine request has ended (an abort ends one without a step), be it
  // waiting or running.
  EngineMoved(EngineWait::kNone);
  if (done) done(std::move(result));
}

void Prefiller::Cancel(const std::string& request_id) {
  CancelJob(request_id, CancelledError(fmt::format("request '{}' was cancelled", request_id)));
}

void Prefiller::CancelJob(const std::string& request_id, Status why) {
  JobPtr job;
  Stage stage;
  std::shared_ptr<PushStream> push;
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(request_id);
    if (it == jobs_.end()) return;
    job = it->second;
    if (job->cancelled) return;  // the first reason stands
    job->cancel_status = std::move(why);
    job->cancelled = true;
    stage = job->stage;
    push = job->push;
    if (stage == Stage::kQueued) {
      for (auto q = queue_.begin(); q != queue_.end(); ++q) {
        if (*q == job) {
          queue_.erase(q);
          break;
        }
      }
    }
  }
  switch (stage) {
    case Stage::kQueued:
      Complete(job, CancelledError(fmt::format("request '{}' was cancelled while queued", request_id)));
      break;
    case Stage::kPrefilling:
      engine_.Abort(request_id).IgnoreError();
      break;
    case Stage::kTransferring:
      if (push) push->Abort({});  // the push's done (OnTransferDone) ends the job
      break;
    case Stage::kReserving:  // OnReserved sees the flag
    case Stage::kDone:
      break;
  }
}

}  // namespace tandem::prefiller
