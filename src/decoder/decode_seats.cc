// Decode seats (DecoderOptions::max_seats; docs/serving-workers.md "Decode
// seats"): a request holds a seat from its reservation until it ends, so no
// more requests are reserved or decoding here than the engine's running
// batch takes. A Reserve that finds every seat taken waits for one here,
// in arrival order, before its prefill starts: the wait counts in the
// request's time to first token instead of coming between its first token
// (the prefiller's) and its second.
//
// Seats free on many threads (the engine's, the transport's, gRPC's); the
// waiting calls are seated and answered on the lease thread, which a freed
// seat wakes. That keeps Reserve's work (the engine's reservation, the
// prefiller's watch) and the callers' replies off the engine thread, and
// never runs a reply under the decoder's lock.
#include <fmt/format.h>

#include "decoder/decoder.h"

namespace tandem::decoder {

using SteadyClock = std::chrono::steady_clock;

uint64_t Decoder::ReserveOrWait(const std::string& request_id, const std::string& prefiller,
                                std::span<const uint32_t> prompt_ids,
                                std::string_view prefiller_descriptor,
                                parallel::ParallelLayout prefill_layout,
                                SteadyClock::time_point wait_until, ReserveDone done) {
  std::optional<Result<KvTargetInfo>> answer;
  uint64_t ticket = 0;
  {
    const auto pass = lifeline_.Enter();
    if (!pass) {
      answer = UnavailableError("this decoder is shutting down");
    } else {
      const Park park{wait_until, &done, &ticket};
      answer = ReserveIn({request_id, prefiller, prompt_ids, prefiller_descriptor, prefill_layout},
                         &park, /*seated=*/false);
    }
  }
  if (!answer) return ticket;  // waits; `done` moved into the queue
  done(*answer);
  return 0;
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
  }
  Answer(gone, CancelledError("the reserve call went away while it waited for a decode seat"));
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
  SeatFreedLocked();
}

std::map<std::string, Decoder::Entry>::iterator Decoder::EraseLocked(
    std::map<std::string, Entry>::iterator it) {
  if (Seated(it->second.stage)) GiveSeatBackLocked();
  return requests_.erase(it);
}

void Decoder::SeatFreedLocked() {
  if (waiting_.empty() || serve_kick_) return;
  serve_kick_ = true;
  lease_cv_.notify_all();
}

void Decoder::ServeWaiting() {
  for (;;) {
    std::vector<std::unique_ptr<Waiter>> seated;
    {
      std::lock_guard lock(mu_);
      serve_kick_ = false;
      while (!waiting_.empty() && seats_taken_ + seats_claimed_ < options_.max_seats) {
        seated.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
        ++seats_claimed_;
      }
    }
    if (seated.empty()) return;
    // Each call's seat is claimed: ReserveIn takes it or gives it back (a
    // seat given back lets the next round seat another call).
    for (auto& w : seated) {
      w->done(*ReserveIn(w->args(), /*park=*/nullptr, /*seated=*/true));
    }
  }
}

void Decoder::ExpireWaiting(SteadyClock::time_point now) {
  std::vector<std::unique_ptr<Waiter>> expired;
  {
    std::lock_guard lock(mu_);
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
  for (auto& w : expired) {
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
