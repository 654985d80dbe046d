#include "decoder/decoder.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/delivery_scope.h"
#include "common/kv_checksum.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "kvtransfer/kv_cipher.h"
#include "kvtransfer/kv_secret.h"

namespace tandem::decoder {

namespace {

using SteadyClock = std::chrono::steady_clock;
using SystemClock = std::chrono::system_clock;

std::optional<SteadyClock::time_point> ToSteady(
    const std::optional<SystemClock::time_point>& deadline) {
  if (!deadline) return std::nullopt;
  return SteadyClock::now() + (*deadline - SystemClock::now());
}

Status StatusFor(const engine::RequestOutput& out) {
  if (!out.status.ok()) return out.status;
  switch (out.finish_reason) {
    case engine::FinishReason::kAbort: return CancelledError("request aborted");
    case engine::FinishReason::kDeadline: return DeadlineExceededError("deadline passed");
    default: return InternalError(fmt::format("request ended with '{}'",
                                              engine::FinishReasonName(out.finish_reason)));
  }
}

}  // namespace

class Decoder::Emitter {
 public:
  Emitter(std::shared_ptr<DecodeSink> sink, HeldHistogram* itl)
      : sink_(std::move(sink)), itl_(itl) {}

  void Tokens(uint32_t first_index, std::span<const uint32_t> tokens) {
    std::lock_guard lock(mu_);
    if (done_) return;
    if (first_index == next_index_ && pending_.empty()) {
      // In order, nothing held back (every step of a running request):
      // straight to the sink, no copy, no map node per step (issue 23).
      const uint32_t n = static_cast<uint32_t>(tokens.size());
      if (n == 0) return;
      ObserveHandOffLocked(n);
      sink_->OnTokens(next_index_, tokens);
      next_index_ += n;
      if (final_ && next_index_ >= final_->completion_tokens) {
        done_ = true;
        sink_->OnFinished(*final_);
      }
      return;
    }
    pending_.emplace(first_index, std::vector<uint32_t>(tokens.begin(), tokens.end()));
    FlushLocked();
  }
  void Finished(const DecodeResult& r) {
    std::lock_guard lock(mu_);
    if (done_) return;
    final_ = r;
    FlushLocked();
  }
  // Errors end the stream at once (tokens still in order before them).
  void Error(const Status& status) {
    std::lock_guard lock(mu_);
    if (done_) return;
    done_ = true;
    sink_->OnError(status);
  }
  void Drop() {
    std::lock_guard lock(mu_);
    done_ = true;
  }
  // A running request's step (first token seen, not finished): touches
  // nothing but this emitter, so it needs no guard (after Decoder::Stop
  // the emitter is done and drops it).
  void Step(const engine::RequestOutput& out) {
    if (out.token_ids.empty()) return;
    const uint32_t n = static_cast<uint32_t>(out.token_ids.size());
    Tokens(out.completion_tokens - n, out.token_ids);
  }
  bool Uses(const DecodeSink* sink) const { return sink_.get() == sink; }
  // Whether the request's Entry needs no update for an output that does
  // not finish it (its first token was seen): the engine's callback then
  // calls Step alone, no lookup by id (issue 23: one map lookup under the
  // decoder's lock per request per step) and no guard.
  void MarkFirstSeen() { first_seen_.store(true, std::memory_order_release); }
  bool first_seen() const { return first_seen_.load(std::memory_order_acquire); }

 private:
  // The sink is called under mu_ so that its calls stay in order; sinks
  // only queue (see DecodeSink).
  void FlushLocked() {
    while (!pending_.empty() && pending_.begin()->first <= next_index_) {
      auto node = pending_.extract(pending_.begin());
      const uint32_t first = node.key();
      std::vector<uint32_t>& tokens = node.mapped();
      if (first + tokens.size() <= next_index_) continue;  // duplicate
      tokens.erase(tokens.begin(), tokens.begin() + (next_index_ - first));
      const uint32_t n = static_cast<uint32_t>(tokens.size());
      ObserveHandOffLocked(n);
      sink_->OnTokens(next_index_, tokens);
      next_index_ += n;
    }
    if (final_ && next_index_ >= final_->completion_tokens) {
      done_ = true;
      sink_->OnFinished(*final_);
    }
  }

  // The gaps of `n` tokens handed off now: from the previous hand-off to
  // the first (none before the request's first hand-off here), 0 for the
  // others. The time is the delivery batch's (one reading per engine step).
  void ObserveHandOffLocked(uint32_t n) {
    if (itl_ == nullptr) return;
    const SteadyClock::time_point now = DeliveryScope::Now();
    if (last_hand_off_ != SteadyClock::time_point{}) {
      itl_->Observe(std::max(0.0, std::chrono::duration<double>(now - last_hand_off_).count()));
    }
    for (uint32_t k = 1; k < n; ++k) itl_->Observe(0.0);
    last_hand_off_ = now;
  }

  std::mutex mu_;
  std::shared_ptr<DecodeSink> sink_;
  HeldHistogram* const itl_;
  SteadyClock::time_point last_hand_off_{};               // guarded by mu_
  uint32_t next_index_ = 0;                               // guarded by mu_
  std::map<uint32_t, std::vector<uint32_t>> pending_;     // guarded by mu_
  std::optional<DecodeResult> final_;                     // guarded by mu_
  bool done_ = false;                                     // guarded by mu_
  std::atomic<bool> first_seen_{false};
};

Decoder::Decoder(engine::Engine& engine, kvtransfer::Transport& transport, DecoderOptions options)
    : engine_(engine), transport_(transport), options_(std::move(options)),
      descriptor_(transport.LocalDescriptor()) {
  transport_.SetPeerFailureCallback(lifeline_.Guard(
      [this](const std::string& agent, uint64_t generation, const Status&) {
        OnPrefillerEndpointFailed(agent, generation);
      }));
}

Decoder::~Decoder() { Stop(); }

void Decoder::Start() {
  lease_thread_ = std::jthread([this](std::stop_token stop) { LeaseLoop(stop); });
}

void Decoder::Stop() {
  transport_.SetPeerFailureCallback({});
  {
    std::lock_guard lock(mu_);
    draining_ = true;
  }
  if (lease_thread_.joinable()) {
    lease_thread_.request_stop();
    lease_cv_.notify_all();
    lease_thread_.join();
  }
  // Waits for a Register, Reserve or notice under way (one may be adding
  // a request to the engine) and for the engine's callbacks running; none
  // runs after. What is left changes only through Cancel now.
  lifeline_.End();
  std::vector<std::shared_ptr<Emitter>> open;
  std::vector<std::string> running;
  std::vector<uint64_t> release;
  std::vector<std::unique_ptr<Waiter>> waiters;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, e] : requests_) {
      open.push_back(e.emitter);
      if (e.stage == Stage::kRunning) running.push_back(id);
    }
    requests_.clear();
    seats_taken_ = 0;
    for (const auto& [id, held] : reservations_) release.push_back(id);
    reservations_.clear();
    for (auto& w : waiting_) waiters.push_back(std::move(w));
    waiting_.clear();
    for (auto& w : unregistered_) waiters.push_back(std::move(w));
    unregistered_.clear();
  }
  // Nothing parks after the Lifeline ended (ReserveOrWait runs through it).
  Answer(waiters, UnavailableError("this decoder is shutting down"));
  if (!open.empty() || !release.empty()) {
    spdlog::warn("decoder stopping: {} open requests ended ({} decoding), {} reservations released",
                 open.size(), running.size(), release.size());
  }
  // The streams end first: the engine's abort output runs nothing now. A
  // prefiller still writing into a released reservation writes into blocks
  // nothing here decodes again (the engine stops next).
  const Status shutting_down = UnavailableError("this decoder is shutting down");
  for (const auto& emitter : open) emitter->Error(shutting_down);
  for (const auto& id : running) engine_.Abort(id).IgnoreError();  // NOT_FOUND if it just finished
  for (uint64_t id : release) engine_.ReleaseReservation(id).IgnoreError();
}

void Decoder::SetDraining() {
  std::lock_guard lock(mu_);
  draining_ = true;
}

DecoderCounts Decoder::counts() const {
  std::lock_guard lock(mu_);
  DecoderCounts c = counts_;
  c.stream_messages = stream_tally_->messages();
  c.stream_items = stream_tally_->items();
  c.registered = static_cast<uint32_t>(requests_.size());
  c.reservations = static_cast<uint32_t>(reservations_.size());
  c.seats_taken = seats_taken_;
  c.seat_seconds =
      seat_seconds_ +
      seats_taken_ * std::chrono::duration<double>(std::chrono::steady_clock::now() - seats_changed_).count();
  c.reserves_waiting = static_cast<uint32_t>(waiting_.size()) + waiters_trying_;
  c.reserves_awaiting_registration = static_cast<uint32_t>(unregistered_.size());
  for (const auto& [id, h] : reservations_) {
    if (!h.quarantined) continue;
    ++c.quarantined_reservations;
    c.quarantined_blocks += static_cast<uint32_t>(h.slots.size() - h.cached_blocks);
  }
  return c;
}

engine::GenerateRequest Decoder::MakeEngineRequest(const DecodeSpec& spec,
                                                   std::shared_ptr<Emitter> emitter) {
  engine::GenerateRequest r;
  r.request_id = spec.request_id;
  r.prompt_ids = spec.prompt_ids;
  r.sampling = spec.sampling;
  r.first_sample_index = spec.first_sample_index;
  r.cache_salt = spec.cache_salt;
  r.priority = spec.priority;
  r.tenant = spec.tenant;
  r.tenant_weight = spec.tenant_weight;
  r.deadline = ToSteady(spec.deadline);
  // A running request's plain step goes to its emitter alone (one call
  // per request per step, issue 23's token path: no guard); the first
  // token and the end run the decoder's code, through the Lifeline.
  r.on_output = [emitter = std::move(emitter),
                 rest = lifeline_.Guard([this, id = spec.request_id](
                                            Emitter& e, const engine::RequestOutput& out) {
                   OnOutput(id, e, out);
                 })](const engine::RequestOutput& out) mutable {
    if (!out.finished && emitter->first_seen()) {
      emitter->Step(out);
      return;
    }
    rest(*emitter, out);
  };
  return r;
}

Status Decoder::Register(DecodeSpec spec, std::shared_ptr<DecodeSink> sink) {
  std::string id = spec.request_id;
  Status s = RegisterIn(std::move(spec), std::move(sink));
  if (!s.ok() && !id.empty()) RefuseUnregistered(id, s);
  return s;
}

Status Decoder::RegisterIn(DecodeSpec spec, std::shared_ptr<DecodeSink> sink) {
  const auto pass = lifeline_.Enter();
  if (!pass) return UnavailableError("this decoder is shutting down");
  if (spec.request_id.empty()) return InvalidArgumentError("request_id is empty");
  // Fail before any prefiller works for it.
  TANDEM_RETURN_IF_ERROR(CheckRegisteredPrompt(spec));
  const std::string id = spec.request_id;
  const bool local = spec.prefill_locally;
  engine::GenerateRequest req;
  std::shared_ptr<Emitter> superseded;
  {
    std::lock_guard lock(mu_);
    if (draining_) return UnavailableError("this decoder is shutting down");
    if (auto old = requests_.find(id); old != requests_.end()) {
      if (old->second.stage == Stage::kRunning) {
        return AlreadyExistsError(fmt::format("request '{}' is already decoding here", id));
      }
      if (old->second.stage == Stage::kReserved) {
        OrphanLocked(old->second.reservation_id);
      }
      superseded = old->second.emitter;
      EraseLocked(old);
    }
    Entry e;
    e.emitter = std::make_shared<Emitter>(std::move(sink), options_.inter_token_latency);
    if (local) req = MakeEngineRequest(spec, e.emitter);
    e.spec = std::move(spec);
    e.submitted = SteadyClock::now();
    if (!local && e.spec.deadline) WakeLeaseLoopLocked(*ToSteady(e.spec.deadline));
    // A local prefill decodes here at once: it takes a seat without
    // waiting for one (the engine queues it like any request).
    Entry& added = requests_.emplace(id, std::move(e)).first->second;
    if (local) SetStageLocked(added, Stage::kRunning);
    // Reserve calls that came first (the Prefill went out with the start)
    // are served now, in line.
    AdmitUnregisteredLocked(id);
  }
  if (superseded) {
    superseded->Error(AbortedError(fmt::format("request '{}': superseded by a new Decode stream", id)));
  }
  LogRequest(spdlog::level::debug, id, "registered; waiting for {}",
             local ? "its local prefill" : "a reservation and its KV");
  if (!local) return Status::Ok();
  Status s = engine_.Submit(std::move(req));
  if (!s.ok()) {
    std::lock_guard lock(mu_);
    if (auto it = requests_.find(id); it != requests_.end()) EraseLocked(it);
  }
  return s;
}

Result<KvTargetInfo> Decoder::Reserve(const std::string& request_id, const std::string& prefiller,
                                      std::span<const uint32_t> prompt_ids,
                                      std::string_view prefiller_descriptor,
                                      parallel::ParallelLayout prefill_layout) {
  const auto pass = lifeline_.Enter();
  if (!pass) return UnavailableError("this decoder is shutting down");
  Result<KvTargetInfo> t =
      *ReserveIn({request_id, prefiller, prompt_ids, prefiller_descriptor, prefill_layout},
                 /*park=*/nullptr, /*seated=*/false);
  if (t.ok()) ObserveReserveWait(0);
  return t;
}

std::optional<Result<KvTargetInfo>> Decoder::ReserveIn(const ReserveArgs& a, const Park* park,
                                                       bool seated, bool* kv_short) {
  const std::string& request_id = a.request_id;
  const std::string& prefiller = a.prefiller;
  const std::span<const uint32_t> prompt_ids = a.prompt_ids;
  const parallel::ParallelLayout prefill_layout = a.prefill_layout;
  // A seat claimed for this call (seats_claimed_) until it is taken by the
  // reservation or given back on the way out.
  bool claimed = seated;
  auto give_back = [&] {  // mu_ held
    if (!claimed) return;
    --seats_claimed_;
    claimed = false;
    SeatFreedLocked();
  };
  auto unclaim = [&] {
    if (!claimed) return;
    std::lock_guard lock(mu_);
    give_back();
  };
  if (prefill_layout.world() > 1 || options_.layout.world() > 1) {
    // docs/parallelism.md: no rank holds a whole block, so a sliced push is
    // neither sealed nor checksummed.
    const char* key = options_.encrypt ? "transport.encrypt"
                      : options_.verify_checksums ? "transport.checksum"
                                                  : nullptr;
    if (key != nullptr) {
      unclaim();
      return FailedPreconditionError(fmt::format(
          "request '{}': {} is not supported between tensor/pipeline-parallel workers (prefill "
          "{}, decode {})",
          request_id, key, parallel::ToString(prefill_layout), parallel::ToString(options_.layout)));
    }
    if (options_.layout.world() > 1 && options_.rank_descriptors.size() != options_.layout.world()) {
      unclaim();
      return FailedPreconditionError(fmt::format(
          "request '{}': this decoder ({}) knows {} of its ranks' KV transports", request_id,
          parallel::ToString(options_.layout), options_.rank_descriptors.size()));
    }
  }
  std::string writer_agent;
  uint64_t writer_generation = 0;
  if (!a.prefiller_descriptor.empty()) {
    WatchPrefiller(a.prefiller_descriptor, &writer_agent, &writer_generation);
  }
  std::string tag;
  std::string cache_salt;
  uint32_t max_tokens = 1;
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) {
      give_back();
      // The proxy sends the Prefill with the decode start (docs/decode-stream.md
      // "Prefill with the start"): this call may have overtaken the
      // registration. It waits for it, unless the request ended here.
      if (park != nullptr && !draining_ && !EndedRecentlyLocked(request_id)) {
        ParkUnregisteredLocked(a, *park);
        return std::nullopt;
      }
      return NotFoundError(fmt::format(
          "request '{}' is not registered on this decoder (never opened, cancelled or finished)",
          request_id));
    }
    if (it->second.stage == Stage::kRunning) {
      give_back();
      return FailedPreconditionError(
          fmt::format("request '{}' already has its KV and is decoding", request_id));
    }
    if (Status same = SamePrompt(it->second.spec, prompt_ids); !same.ok()) {
      give_back();
      return same;
    }
    if (Seated(it->second.stage)) {
      give_back();  // a second prefiller takes over: the request keeps its seat
    } else if (!claimed) {
      // Arrival order: a call waits while earlier ones do, even if a seat
      // or blocks just came free (the lease thread serves them first).
      const bool seats_full =
          options_.max_seats > 0 && seats_taken_ + seats_claimed_ >= options_.max_seats;
      if (seats_full || !waiting_.empty()) {
        if (park == nullptr) {
          ++counts_.reservations_refused;
          if (seats_full) {
            return ResourceExhaustedError(fmt::format(
                "request '{}': every decode seat is taken ({} requests reserved or decoding, "
                "scheduler.max_num_seqs {})",
                request_id, seats_taken_ + seats_claimed_, options_.max_seats));
          }
          return ResourceExhaustedError(fmt::format(
              "request '{}': {} earlier reserve calls wait here for a decode seat or KV blocks",
              request_id, waiting_.size()));
        }
        if (seats_full) ++counts_.reserve_waits;  // else in line behind calls that wait
        ParkLocked(a, *park, /*kv_why=*/{});
        return std::nullopt;
      }
      ++seats_claimed_;
      claimed = true;
    }
    tag = fmt::format("{}@r{}", request_id, next_tag_++);
    cache_salt = it->second.spec.cache_salt;  // the registered request's, not the prefiller's word
    max_tokens = it->second.spec.sampling.max_tokens;
  }
  auto capability = kvtransfer::NewCapability();
  if (!capability.ok()) {
    unclaim();
    return capability.status().WithContext("reserving KV blocks");
  }
  std::string kv_key;
  if (options_.encrypt) {
    auto key = kvtransfer::NewKvKey();
    if (!key.ok()) {
      unclaim();
      return key.status().WithContext("reserving KV blocks");
    }
    kv_key = std::move(*key);
  }
  auto res = engine_.Reserve(tag, prompt_ids, cache_salt, max_tokens);
  if (!res.ok()) {
    // Too few blocks free now: they free as requests end, so the call may
    // wait for them like for a seat. (A prompt the whole pool cannot hold
    // never gets here: Register refuses it, prompt and max_tokens.)
    const bool short_of_blocks = res.status().code() == StatusCode::kResourceExhausted;
    std::lock_guard lock(mu_);
    give_back();
    if (short_of_blocks && park != nullptr) {
      ParkLocked(a, *park, std::string(res.status().message()));
      return std::nullopt;
    }
    if (short_of_blocks && kv_short != nullptr) {
      *kv_short = true;
    } else {
      ++counts_.reservations_refused;
    }
    return res.status();
  }
  const auto lease = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(options_.lease_seconds));
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it != requests_.end() && it->second.stage != Stage::kRunning) {
      Entry& e = it->second;
      if (e.stage == Stage::kReserved) {
        // A second prefiller took over (retry): the first may still write
        // into its slots, so they wait for its notice or lease.
        OrphanLocked(e.reservation_id);
      }
      SetStageLocked(e, Stage::kReserved);
      e.reservation_id = res->reservation_id;
      Held held{request_id, prefiller, SteadyClock::now() + lease, false, *capability};
      held.kv_key = kv_key;  // encrypt; else empty
      held.slots = res->block_ids;
      held.cached_blocks = res->num_cached_blocks;
      held.writer_agent = std::move(writer_agent);
      held.writer_generation = writer_generation;
      WakeLeaseLoopLocked(held.lease_expiry);
      reservations_.emplace(res->reservation_id, std::move(held));
    } else {
      it = requests_.end();
    }
    give_back();  // the reservation took the seat, or the request was cancelled meanwhile
    if (it == requests_.end()) {
      // Cancelled while reserving; no prefiller knows these slots yet.
      engine_.ReleaseReservation(res->reservation_id).IgnoreError();
      BlocksFreedLocked();
      return CancelledError(fmt::format("request '{}' was cancelled", request_id));
    }
  }
  KvTargetInfo t;
  t.request_id = request_id;
  t.reservation_id = res->reservation_id;
  t.generation = transport_.generation();
  t.transport_descriptor = descriptor_;
  t.layout = options_.layout;
  if (options_.layout.world() > 1) t.rank_descriptors = options_.rank_descriptors;
  t.slots = res->block_ids;
  t.cached_blocks = res->num_cached_blocks;
  t.lease_expiry = SystemClock::now() + lease;
  t.capability = std::move(*capability);
  t.kv_key = std::move(kv_key);
  LogRequest(spdlog::level::debug, request_id,
             "reserved {} KV blocks for prefiller '{}' ({} already cached), reservation {}",
             t.slots.size(), prefiller, t.cached_blocks, t.reservation_id);
  return t;
}

void Decoder::OnKvNotice(const KvNoticeInfo& n) {
  const auto pass = lifeline_.Enter();
  if (!pass) {  // Stop released every reservation: nothing to act on
    spdlog::debug("ignoring KV notice for '{}' reservation {}: this decoder is stopped", n.request_id,
                  n.reservation_id);
    return;
  }
  std::shared_ptr<Emitter> emitter;
  engine::GenerateRequest req;
  bool release = false;
  bool add = false;
  Held held;  // the reservation this notice ends
  {
    std::lock_guard lock(mu_);
    auto h = reservations_.find(n.reservation_id);
    if (h == reservations_.end() || n.generation != transport_.generation() ||
        h->second.request_id != n.request_id) {
      ++counts_.stale_notices;
      spdlog::debug("ignoring KV notice for '{}' reservation {} generation {} (stale or unknown)",
                    n.request_id, n.reservation_id, n.generation);
      return;
    }
    if (!kvtransfer::SecretEquals(n.capability, h->second.capability)) {
      // Forged or misdirected: not acted on in any way (not even an error
      // notice may free the reservation), only counted.
      ++counts_.notices_refused_capability;
      LogRequest(spdlog::level::warn, n.request_id,
                 "refused a KV notice for reservation {}: wrong capability ({} bytes)",
                 n.reservation_id, n.capability.size());
      return;
    }
    if (n.unreceived_reply) ++counts_.unreceived_replies_released;
    const bool orphaned = h->second.orphaned;
    if (h->second.quarantined) {
      ++counts_.quarantine_released_ack;
      LogRequest(spdlog::level::info, n.request_id,
                 "quarantined reservation {} released: prefiller '{}' confirmed no write is "
                 "outstanding ({})",
                 n.reservation_id, h->second.prefiller, n.error.ok() ? "push completed" : "push ended");
    }
    held = std::move(h->second);
    reservations_.erase(h);
    auto it = requests_.find(n.request_id);
    const bool active = !orphaned && it != requests_.end() &&
                        it->second.stage == Stage::kReserved &&
                        it->second.reservation_id == n.reservation_id;
    if (!active) {
      release = true;
    } else if (!n.error.ok()) {
      // The prefiller gave up; the proxy may retry with another one.
      release = true;
      SetStageLocked(it->second, Stage::kRegistered);
      it->second.reservation_id = 0;
      if (n.unreceived_reply) {
        LogRequest(spdlog::level::info, n.request_id,
                   "reservation {} released, the request waits for a retry: {}", n.reservation_id,
                   n.error.message());
      } else {
        LogRequest(spdlog::level::info, n.request_id, "prefiller gave up: {}", n.error.message());
      }
    } else {
      SetStageLocked(it->second, Stage::kRunning);
      it->second.first_token_seen = true;
      it->second.prefill_cached_prompt_tokens = n.prefill_cached_prompt_tokens;
      emitter = it->second.emitter;
      emitter->MarkFirstSeen();
      req = MakeEngineRequest(it->second.spec, emitter);
      add = true;
    }
  }
  if (release) {
    ReleaseInEngine(n.reservation_id);
    return;
  }
  if (!add) return;
  // Fail closed: nothing pushed is decoded before every block's tag
  // (transport.encrypt; the block is decrypted in place) and then its
  // checksum over the plaintext (transport.checksum) checked out. Both run
  // outside the lock; only this notice could free the reservation.
  Status s = held.kv_key.empty() ? Status::Ok()
                                 : OpenPushedBlocks(n.reservation_id, held, n.kv_tags);
  if (s.ok() && options_.verify_checksums) s = CheckPushedBlocks(n, held);
  if (s.ok()) s = engine_.AddPrefilled(n.reservation_id, std::move(req), n.first_token_id);
  LogRequest(spdlog::level::debug, n.request_id, "KV notice for reservation {}: decoding ({})",
             n.reservation_id, s.ok() ? "ok" : s.ToString());
  if (s.ok()) {
    // A cancel that came between the notice and AddPrefilled found nothing
    // to abort in the engine yet: abort now so the blocks come back.
    bool cancelled;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(n.request_id);
      cancelled = it == requests_.end() || it->second.emitter != emitter;
    }
    if (cancelled) AbortInEngine(n.request_id);  // NOT_FOUND if it finished
    return;
  }
  ReleaseInEngine(n.reservation_id);  // NOT_FOUND if consumed
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(n.request_id);
    if (it != requests_.end() && it->second.emitter == emitter) EraseLocked(it);
  }
  Fail(emitter, s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDataLoss
                    ? s
                    : s.WithContext("adding the prefilled request"));
}

Status Decoder::CheckPushedBlocks(const KvNoticeInfo& n, const Held& held) {
  Status bad = VerifyChecksums(held, n.block_checksums);
  if (bad.ok()) return bad;
  {
    std::lock_guard lock(mu_);
    ++counts_.checksum_failures;
  }
  LogRequest(spdlog::level::err, n.request_id,
             "KV from prefiller '{}' failed verification: {}; the request is prefilled again",
             held.prefiller, bad.message());
  // UNAVAILABLE: the proxy prefills it again (a retry, or a migration when
  // the first token already went out).
  return UnavailableError(fmt::format(
      "request '{}': the KV pushed by prefiller '{}' failed its checksum ({}); not decoded",
      n.request_id, held.prefiller, bad.message()));
}

Status Decoder::OpenPushedBlocks(uint64_t reservation_id, const Held& held,
                                 const std::string& tags) {
  const size_t pushed = held.slots.size() - std::min<size_t>(held.cached_blocks, held.slots.size());
  Status s;
  if (tags.size() != pushed * kvtransfer::kKvTagBytes) {
    s = DataLossError(fmt::format("the notice carries {} bytes of tags for {} pushed blocks ({} each)",
                                  tags.size(), pushed, kvtransfer::kKvTagBytes));
  } else {
    auto cipher = kvtransfer::KvCipher::Create(held.kv_key, reservation_id);
    s = cipher.status();
    for (size_t i = 0; s.ok() && i < pushed; ++i) {
      const uint32_t position = held.cached_blocks + static_cast<uint32_t>(i);
      s = cipher->Open(position, transport_.block(held.slots[position]), transport_.block_bytes(),
                       reinterpret_cast<const std::byte*>(tags.data()) + i * kvtransfer::kKvTagBytes);
    }
  }
  if (s.ok()) return s;
  {
    std::lock_guard lock(mu_);
    ++counts_.notices_refused_decrypt;
  }
  LogRequest(spdlog::level::warn, held.request_id,
             "refused the KV pushed by '{}' for reservation {}: {}", held.prefiller, reservation_id,
             s.message());
  return DataLossError(fmt::format(
      "request '{}': the KV pushed by prefiller '{}' failed authentication (transport.encrypt), "
      "so it was not used: {}", held.request_id, held.prefiller, s.message()));
}

void Decoder::OnUnreadableNotice(const std::string& sender, size_t bytes) {
  {
    std::lock_guard lock(mu_);
    ++counts_.notices_refused_unreadable;
  }
  spdlog::warn("refused an unreadable KV notice from '{}' ({} bytes)", sender, bytes);
}

void Decoder::OnOutput(const std::string& request_id, Emitter& emitter,
                       const engine::RequestOutput& out) {
  double local_prefill_s = -1;
  uint32_t prefill_cached = 0;
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it != requests_.end() && it->second.emitter.get() == &emitter) {
      prefill_cached = it->second.prefill_cached_prompt_tokens;
      if (!it->second.first_token_seen && out.completion_tokens > 0) {
        it->second.first_token_seen = true;
        emitter.MarkFirstSeen();
        local_prefill_s =
            std::chrono::duration<double>(SteadyClock::now() - it->second.submitted).count();
      }
      if (out.finished) EraseLocked(it);  // gives its seat back: blocks freed
    } else if (out.finished) {
      // Its blocks are free now (the engine released them before this
      // output). A cancelled request was erased at its cancel, possibly
      // while its step was in flight: Engine::Abort then releases the
      // blocks only after that step, so the waiting Reserves tried at the
      // cancel found them still held and wait for this moment (before
      // session 28 nothing woke them: a waiting Reserve sat until its wait
      // ran out and was refused, DecodeStream's KV-short tests once in
      // about ten loaded runs).
      BlocksFreedLocked();
    }
  }
  if (local_prefill_s >= 0 && options_.on_local_prefill_seconds) {
    options_.on_local_prefill_seconds(local_prefill_s);
  }
  if (!out.token_ids.empty()) {
    const uint32_t n = static_cast<uint32_t>(out.token_ids.size());
    emitter.Tokens(out.completion_tokens - n, out.token_ids);
  }
  if (!out.finished) return;
  if (out.finish_reason == engine::FinishReason::kStop ||
      out.finish_reason == engine::FinishReason::kLength) {
    DecodeResult r;
    r.finish_reason = out.finish_reason;
    r.completion_tokens = out.completion_tokens;
    r.cached_prompt_tokens = out.cached_prompt_tokens;
    r.prefill_cached_prompt_tokens = prefill_cached;
    emitter.Finished(r);
  } else {
    emitter.Error(StatusFor(out));
  }
}

void Decoder::Cancel(const std::string& request_id, const DecodeSink* sink) {
  bool abort = false;
  std::vector<std::unique_ptr<Waiter>> unseated;
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) return;
    if (sink != nullptr && !it->second.emitter->Uses(sink)) return;  // superseded
    if (it->second.stage == Stage::kReserved) {
      // The prefiller may be writing: the slots wait for its notice or lease.
      OrphanLocked(it->second.reservation_id);
    }
    abort = it->second.stage == Stage::kRunning;
    it->second.emitter->Drop();
    EraseLocked(it);
    // Its Reserve calls waiting for a seat have nothing to reserve for.
    for (auto w = waiting_.begin(); w != waiting_.end();) {
      if ((*w)->request_id != request_id) {
        ++w;
        continue;
      }
      unseated.push_back(std::move(*w));
      w = waiting_.erase(w);
    }
  }
  Answer(unseated, CancelledError(fmt::format("request '{}' was cancelled", request_id)));
  if (abort) AbortInEngine(request_id);  // NOT_FOUND if it just finished
}

void Decoder::Fail(const std::shared_ptr<Emitter>& emitter, const Status& status) {
  if (emitter) emitter->Error(status);
}

Status Decoder::VerifyChecksums(const Held& h, const std::vector<uint64_t>& checksums) const {
  const size_t pushed = h.slots.size() - h.cached_blocks;
  if (checksums.size() != pushed) {
    return DataLossError(fmt::format(
        "the notice carries {} block checksums for {} pushed blocks (transport.checksum must be "
        "the same on every worker)",
        checksums.size(), pushed));
  }
  for (size_t i = 0; i < pushed; ++i) {
    const uint32_t slot = h.slots[h.cached_blocks + i];
    const uint64_t got = KvChecksum(transport_.block(slot), transport_.block_bytes());
    if (got != checksums[i]) {
      return DataLossError(fmt::format("block {} of the prompt (slot {}): XXH3 {:016x}, expected {:016x}",
                                       h.cached_blocks + i, slot, got, checksums[i]));
    }
  }
  return Status::Ok();
}

}  // namespace tandem::decoder
