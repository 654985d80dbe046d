// Decode seats (DecoderOptions::max_seats; docs/serving-workers.md "Decode
// seats"): a request holds a seat from its reservation until it ends, so no
// more requests are reserved or decoding here than the engine's running
// batch takes. A Reserve that finds every seat taken waits for one here,
// in arrival order, before its prefill starts: the wait counts in the
// request's time to first token instead of coming between its first token
// (the prefiller's) and its second.
//
// KV blocks the same way: a Reserve whose prompt the pool could hold but
// whose blocks are not free now (the engine refused it) waits in the same
// queue until blocks come free — a request ends, a reservation is released
// — rather than being refused at once (vLLM's scheduler likewise keeps a
// request waiting until its blocks can be allocated). Arrival order holds:
// while the first waiting call is short of blocks, later ones wait behind
// it. (A prompt larger than the whole pool is refused at Register.)
//
// Seats free on many threads (the engine's, the transport's, gRPC's); the
// waiting calls are seated and answered on the lease thread, which a freed
// seat (or freed blocks) wakes. That keeps Reserve's work (the engine's
// reservation, the prefiller's watch) and the callers' replies off the
// engine thread, and never runs a reply under the decoder's lock.
#include <fmt/format.h>

#include "common/metrics.h"
#include "decoder/decoder.h"

namespace tandem::decoder {

using SteadyClock = std::chrono::steady_clock;

uint64_t Decoder::ReserveOrWait(const std::string& request_id, const std::string& prefiller,
                                std::span<const uint32_t> prompt_ids,
                                std::string_view prefiller_descriptor,
                                parallel::ParallelLayout prefill_layout,
                                SteadyClock::time_point wait_until, ReserveDone done,
                                bool* for_registration) {
  std::optional<Result<KvTargetInfo>> answer;
  uint64_t ticket = 0;
  {
    const auto pass = lifeline_.Enter();
    if (!pass) {
      answer = UnavailableError("this decoder is shutting down");
    } else {
      const Park park{wait_until, &done, &ticket, for_registration};
      answer = ReserveIn({request_id, prefiller, prompt_ids, prefiller_descriptor, prefill_layout},
                         &park, /*seated=*/false);
    }
  }
  if (!answer) return ticket;  // waits; `done` moved into the queue
  if (answer->ok()) ObserveReserveWait(0);
  done(*answer);
  return 0;
}

std::unique_ptr<Decoder::Waiter> Decoder::NewWaiterLocked(const ReserveArgs& a, const Park& park) {
  auto w = std::make_unique<Waiter>();
  w->ticket = next_ticket_++;
  w->request_id = a.request_id;
  w->prefiller = a.prefiller;
  w->prompt_ids.assign(a.prompt_ids.begin(), a.prompt_ids.end());
  w->prefiller_descriptor = a.prefiller_descriptor;
  w->prefill_layout = a.prefill_layout;
  w->wait_until = park.wait_until;
  w->arrived = SteadyClock::now();
  w->done = std::move(*park.done);
  *park.ticket = w->ticket;
  return w;
}

void Decoder::ParkLocked(const ReserveArgs& a, const Park& park, std::string kv_why) {
  std::unique_ptr<Waiter> w = NewWaiterLocked(a, park);
  if (!kv_why.empty()) {
    ++counts_.kv_waits;
    w->kv_epoch = blocks_freed_;
    w->kv_why = std::move(kv_why);
  }
  WakeLeaseLoopLocked(w->wait_until);
  waiting_.push_back(std::move(w));
}

// Before its registration (docs/decode-stream.md "Prefill with the start"):
// the proxy writes the decode start before the Prefill, but the start
// reaches the decoder on another connection and thread than the
// prefiller's Reserve, which may come first. Such a call waits apart from
// the seat queue (it is not in line until its request is registered) and
// joins the line, by its arrival, when the registration comes.
void Decoder::ParkUnregisteredLocked(const ReserveArgs& a, const Park& park) {
  std::unique_ptr<Waiter> w = NewWaiterLocked(a, park);
  w->wait_until = std::min(w->wait_until, w->arrived + kRegistrationWait);
  if (park.for_registration != nullptr) *park.for_registration = true;
  ++counts_.registration_waits;
  WakeLeaseLoopLocked(w->wait_until);
  unregistered_.push_back(std::move(w));
}

void Decoder::AdmitUnregisteredLocked(const std::string& id) {
  ended_.erase(id);
  bool admitted = false;
  for (auto w = unregistered_.begin(); w != unregistered_.end();) {
    if ((*w)->request_id != id) {
      ++w;
      continue;
    }
    // In line by arrival: behind the calls that came before it.
    auto at = waiting_.begin();
    while (at != waiting_.end() && (*at)->arrived <= (*w)->arrived) ++at;
    waiting_.insert(at, std::move(*w));
    w = unregistered_.erase(w);
    admitted = true;
  }
  if (admitted) SeatFreedLocked();  // the lease thread serves the line
}

void Decoder::RefuseUnregistered(const std::string& id, const Status& why) {
  std::vector<std::unique_ptr<Waiter>> refused;
  {
    std::lock_guard lock(mu_);
    for (auto w = unregistered_.begin(); w != unregistered_.end();) {
      if ((*w)->request_id != id) {
        ++w;
        continue;
      }
      refused.push_back(std::move(*w));
      w = unregistered_.erase(w);
    }
  }
  Answer(refused, Status(why.code(), fmt::format("request '{}': its registration on this "
                                                 "decoder was refused: {}",
                                                 id, why.message())));
}

void Decoder::NoteEndedLocked(const std::string& id) {
  const auto now = SteadyClock::now();
  while (!ended_order_.empty() &&
         (now - ended_order_.front().first > kEndedMemory || ended_order_.size() >= kEndedKept)) {
    auto& [when, old] = ended_order_.front();
    if (auto it = ended_.find(old); it != ended_.end() && it->second == when) ended_.erase(it);
    ended_order_.pop_front();
  }
  ended_[id] = now;
  ended_order_.emplace_back(now, id);
}

bool Decoder::EndedRecentlyLocked(const std::string& id) const {
  auto it = ended_.find(id);
  return it != ended_.end() && SteadyClock::now() - it->second <= kEndedMemory;
}

void Decoder::AbandonReserve(uint64_t ticket) {
  if (ticket == 0) return;
  std::vector<std::unique_ptr<Waiter>> gone;
  {
    std::lock_guard lock(mu_);
    for (auto w = waiting_.begin(); w != waiting_.end(); ++w) {
      if ((*w)->ticket != ticket) continue;
      gone.push_back(std::move(*w));
      waiting_.erase(w);
      break;
    }
    for (auto w = unregistered_.begin(); gone.empty() && w != unregistered_.end(); ++w) {
      if ((*w)->ticket != ticket) continue;
      gone.push_back(std::move(*w));
      unregistered_.erase(w);
      break;
    }
  }
  Answer(gone, CancelledError("the reserve call went away while it waited (for a decode seat, KV "
                              "blocks or its request's registration)"));
}

void Decoder::SetStageLocked(Entry& e, Stage stage) {
  const bool had = Seated(e.stage);
  e.stage = stage;
  if (had == Seated(stage)) return;
  if (had) {
    GiveSeatBackLocked();
  } else {
    TakeSeatLocked();
  }
}

void Decoder::TakeSeatLocked() {
  const auto now = std::chrono::steady_clock::now();
  seat_seconds_ += seats_taken_ * std::chrono::duration<double>(now - seats_changed_).count();
  seats_changed_ = now;
  ++seats_taken_;
}

void Decoder::GiveSeatBackLocked() {
  const auto now = std::chrono::steady_clock::now();
  seat_seconds_ += seats_taken_ * std::chrono::duration<double>(now - seats_changed_).count();
  seats_changed_ = now;
  --seats_taken_;
  ++counts_.seats_released;
  // A request that ended in the engine freed its blocks before its output
  // came here; a released reservation frees them after (ReleaseInEngine).
  BlocksFreedLocked();
}

std::map<std::string, Decoder::Entry>::iterator Decoder::EraseLocked(
    std::map<std::string, Entry>::iterator it) {
  if (Seated(it->second.stage)) GiveSeatBackLocked();
  NoteEndedLocked(it->first);
  return requests_.erase(it);
}

void Decoder::SeatFreedLocked() {
  if (waiting_.empty() || serve_kick_) return;
  serve_kick_ = true;
  lease_cv_.notify_all();
}

void Decoder::BlocksFreedLocked() {
  ++blocks_freed_;
  SeatFreedLocked();
}

void Decoder::EndGrowthLocked(uint64_t reservation_id) {
  // Lock order: the decoder's, then the engine's (as ReserveIn's release).
  if (engine_.EndReservationGrowth(reservation_id).ok()) BlocksFreedLocked();
}

void Decoder::OrphanLocked(uint64_t reservation_id) {
  auto h = reservations_.find(reservation_id);
  if (h == reservations_.end()) return;
  h->second.orphaned = true;
  EndGrowthLocked(reservation_id);
}

void Decoder::ReleaseInEngine(uint64_t reservation_id) {
  if (!engine_.ReleaseReservation(reservation_id).ok()) return;  // NOT_FOUND: consumed or gone
  std::lock_guard lock(mu_);
  BlocksFreedLocked();
}

void Decoder::AbortInEngine(const std::string& request_id) {
  if (!engine_.Abort(request_id).ok()) return;  // NOT_FOUND: it just finished
  std::lock_guard lock(mu_);
  BlocksFreedLocked();
}

void Decoder::ServeWaiting() {
  for (;;) {
    std::unique_ptr<Waiter> w;
    uint64_t epoch = 0;
    {
      std::lock_guard lock(mu_);
      serve_kick_ = false;
      if (waiting_.empty()) return;
      const Waiter& first = *waiting_.front();
      // A retry whose request holds its seat (a second prefiller took it
      // over) needs blocks, not a seat: ReserveIn gives the claim back.
      const auto held = requests_.find(first.request_id);
      const bool has_seat = held != requests_.end() && Seated(held->second.stage);
      if (!has_seat && options_.max_seats > 0 && seats_taken_ + seats_claimed_ >= options_.max_seats) {
        return;
      }
      // Short of blocks when it last tried, and none came free since.
      if (first.short_of_blocks() && first.kv_epoch == blocks_freed_) return;
      w = std::move(waiting_.front());
      waiting_.pop_front();
      // Claimed: ReserveIn takes it or gives it back (a seat given back
      // lets the next round seat another call).
      ++seats_claimed_;
      ++waiters_trying_;  // still waiting while it tries (counts())
      epoch = blocks_freed_;
    }
    bool kv_short = false;
    Result<KvTargetInfo> answer = *ReserveIn(w->args(), /*park=*/nullptr, /*seated=*/true, &kv_short);
    {
      std::lock_guard lock(mu_);
      --waiters_trying_;
      if (kv_short) {
        if (!w->short_of_blocks()) ++counts_.kv_waits;  // it waited for a seat until now
        w->kv_epoch = epoch;  // blocks freed since are tried at the next round
        w->kv_why = answer.status().message();
        // Still first in line; the lease thread refuses it when its wait
        // runs out. One whose request was cancelled meanwhile ends now.
        if (!requests_.contains(w->request_id)) {
          answer = CancelledError(fmt::format("request '{}' was cancelled", w->request_id));
        } else if (w->wait_until > SteadyClock::now()) {
          waiting_.push_front(std::move(w));
          continue;
        } else {
          ++counts_.reserve_waits_expired;
          ++counts_.reservations_refused;
          answer = ResourceExhaustedError(NoBlocksCameFree(*w));
        }
      }
    }
    if (answer.ok()) {
      ObserveReserveWait(std::chrono::duration<double>(SteadyClock::now() - w->arrived).count());
    }
    w->done(answer);
  }
}

void Decoder::ObserveReserveWait(double seconds) {
  if (options_.reserve_wait != nullptr) options_.reserve_wait->Observe(seconds);
}

std::string Decoder::NoBlocksCameFree(const Waiter& w) {
  return fmt::format("request '{}': no KV blocks came free for its {}-token prompt while the "
                     "reserve call could wait ({})",
                     w.request_id, w.prompt_ids.size(), w.kv_why);
}

void Decoder::ExpireWaiting(SteadyClock::time_point now) {
  std::vector<std::unique_ptr<Waiter>> expired;
  std::vector<std::unique_ptr<Waiter>> never_registered;
  {
    std::lock_guard lock(mu_);
    for (auto w = unregistered_.begin(); w != unregistered_.end();) {
      if ((*w)->wait_until > now) {
        ++w;
        continue;
      }
      never_registered.push_back(std::move(*w));
      w = unregistered_.erase(w);
    }
    for (auto w = waiting_.begin(); w != waiting_.end();) {
      if ((*w)->wait_until > now) {
        ++w;
        continue;
      }
      ++counts_.reserve_waits_expired;
      ++counts_.reservations_refused;
      expired.push_back(std::move(*w));
      w = waiting_.erase(w);
    }
  }
  for (auto& w : never_registered) {
    w->done(NotFoundError(fmt::format(
        "request '{}' is not registered on this decoder: it did not register within {} ms of the "
        "reserve call (never opened, cancelled or finished)",
        w->request_id,
        std::chrono::duration_cast<std::chrono::milliseconds>(w->wait_until - w->arrived)
            .count())));
  }
  for (auto& w : expired) {
    if (w->short_of_blocks()) {
      w->done(ResourceExhaustedError(NoBlocksCameFree(*w)));
      continue;
    }
    w->done(ResourceExhaustedError(fmt::format(
        "request '{}': no decode seat came free while the reserve call could wait (every one of "
        "scheduler.max_num_seqs {} is reserved or decoding)",
        w->request_id, options_.max_seats)));
  }
}

void Decoder::Answer(std::vector<std::unique_ptr<Waiter>>& calls, const Status& status) {
  for (auto& w : calls) w->done(status);
  calls.clear();
}

}  // namespace tandem::decoder
