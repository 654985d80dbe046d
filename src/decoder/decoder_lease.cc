// The decoder's leases and its prefillers' liveness (docs/failure-handling.md
// "Quarantine"): the lease thread (expiries, deadlines of requests waiting
// for their KV, and the waiting Reserve calls of decode_seats.cc), and the
// watch on each prefiller's transport that tells a dead writer from a slow
// one. Split from decoder.cc; the same class.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/logging.h"
#include "decoder/decoder.h"
#include "kvtransfer/descriptor.h"

namespace tandem::decoder {

using SteadyClock = std::chrono::steady_clock;
using SystemClock = std::chrono::system_clock;

void Decoder::WakeLeaseLoopLocked(SteadyClock::time_point due) {
  if (due >= lease_wake_at_) return;  // the loop wakes by then anyway
  lease_wake_at_ = due;
  lease_kick_ = true;
  lease_cv_.notify_all();
  if (options_.on_pending_work) options_.on_pending_work();
}

// Sleeps until the earliest lease expiry or deadline of a request waiting
// for its KV, or until Register/Reserve set a sooner one (issue 23: it
// polled every 50 ms, also with nothing to watch).
void Decoder::LeaseLoop(std::stop_token stop) {
  while (!stop.stop_requested()) {
    {
      std::unique_lock lock(mu_);
      auto next = SteadyClock::time_point::max();
      const auto now = SteadyClock::now();
      const auto wall = SystemClock::now();
      for (const auto& [_, h] : reservations_) {
        if (!h.quarantined) next = std::min(next, h.lease_expiry);
      }
      for (const auto& [_, e] : requests_) {
        if (e.stage != Stage::kRunning && e.spec.deadline) {
          next = std::min(next, now + (*e.spec.deadline - wall));
        }
      }
      for (const auto& w : waiting_) next = std::min(next, w->wait_until);
      for (const auto& w : unregistered_) next = std::min(next, w->wait_until);
      if (serve_kick_) next = now;  // a seat came free for a waiting call
      if (next > now) {
        // A wall-clock deadline is re-read at least every second.
        if (next != SteadyClock::time_point::max()) {
          next = std::min(next + std::chrono::milliseconds(1), now + std::chrono::seconds(1));
        }
        lease_wake_at_ = next;
        lease_kick_ = false;
        lease_cv_.wait_until(lock, stop, next, [this] { return lease_kick_ || serve_kick_; });
        lease_wake_at_ = SteadyClock::time_point::min();  // awake: no kick needed
        if (stop.stop_requested()) break;
      }
    }
    const auto now = SteadyClock::now();
    const auto wall = SystemClock::now();
    std::vector<uint64_t> release;
    std::vector<std::pair<std::shared_ptr<Emitter>, Status>> fail;
    {
      std::lock_guard lock(mu_);
      for (auto h = reservations_.begin(); h != reservations_.end();) {
        if (h->second.quarantined || h->second.lease_expiry > now) {
          ++h;
          continue;
        }
        ++counts_.leases_expired;
        // Acknowledge-or-dead: the prefiller may still be writing (a slow
        // push, a paused process). The blocks stay out of the free list
        // until its notice comes or it is declared dead.
        // A writer the decoder cannot watch (no or unusable descriptor: an
        // older prefiller, a test client) would hold the blocks forever:
        // freed at expiry as before the quarantine existed.
        const bool unwatched = h->second.writer_agent.empty();
        const bool dead = unwatched || WriterDeadLocked(h->second);
        LogRequest(spdlog::level::warn, h->second.request_id,
                   "reservation {} from '{}' expired after {} s without its KV; {}", h->first,
                   h->second.prefiller, options_.lease_seconds,
                   unwatched ? "its prefiller cannot be watched: blocks freed"
                   : dead    ? "its prefiller is dead: blocks freed"
                             : "blocks quarantined until the prefiller confirms no write is "
                               "outstanding or is declared dead");
        auto it = requests_.find(h->second.request_id);
        if (!h->second.orphaned && it != requests_.end() &&
            it->second.stage == Stage::kReserved && it->second.reservation_id == h->first) {
          fail.emplace_back(it->second.emitter,
                            UnavailableError(fmt::format(
                                "the KV for request '{}' did not arrive within the {} s lease",
                                h->second.request_id, options_.lease_seconds)));
          EraseLocked(it);
        }
        if (dead) {
          if (!unwatched) ++counts_.quarantine_released_dead;
          release.push_back(h->first);
          h = reservations_.erase(h);
        } else {
          h->second.quarantined = true;
          EndGrowthLocked(h->first);
          ++h;
        }
      }
      // Deadlines of requests still waiting for their KV (running ones are
      // the engine's).
      for (auto it = requests_.begin(); it != requests_.end();) {
        Entry& e = it->second;
        if (e.stage == Stage::kRunning || !e.spec.deadline || *e.spec.deadline > wall) {
          ++it;
          continue;
        }
        if (e.stage == Stage::kReserved) {
          OrphanLocked(e.reservation_id);
        }
        fail.emplace_back(e.emitter, DeadlineExceededError(fmt::format(
                                      "request '{}': deadline passed before its KV arrived",
                                      e.spec.request_id)));
        it = EraseLocked(it);
      }
    }
    for (uint64_t id : release) ReleaseInEngine(id);
    for (auto& [emitter, status] : fail) Fail(emitter, status);
    ServeWaiting();
    ExpireWaiting(SteadyClock::now());
  }
}

bool Decoder::WriterDeadLocked(const Held& h) const {
  if (h.writer_agent.empty()) return false;
  auto it = dead_writers_.find(h.writer_agent);
  return it != dead_writers_.end() && it->second >= h.writer_generation;
}

void Decoder::OnPrefillerLost(const std::string& agent, uint64_t generation) {
  std::vector<uint64_t> release;
  {
    std::lock_guard lock(mu_);
    uint64_t& dead = dead_writers_[agent];
    dead = std::max(dead, generation);
    for (auto h = reservations_.begin(); h != reservations_.end();) {
      if (!h->second.quarantined || !WriterDeadLocked(h->second)) {
        ++h;
        continue;
      }
      ++counts_.quarantine_released_dead;
      LogRequest(spdlog::level::warn, h->second.request_id,
                 "quarantined reservation {} released: prefiller '{}' (generation {}) is dead",
                 h->first, agent, h->second.writer_generation);
      release.push_back(h->first);
      h = reservations_.erase(h);
    }
  }
  for (uint64_t id : release) ReleaseInEngine(id);
}

void Decoder::OnPrefillerEndpointFailed(const std::string& agent, uint64_t generation) {
  {
    std::lock_guard lock(mu_);
    uint64_t& g = endpoint_failed_[agent];
    g = std::max(g, generation);
  }
  OnPrefillerLost(agent, generation);
}

bool Decoder::ReviveWriter(const std::string& agent, uint64_t generation) {
  std::lock_guard lock(mu_);
  auto it = endpoint_failed_.find(agent);
  if (it == endpoint_failed_.end() || it->second != generation) return false;
  endpoint_failed_.erase(it);
  // Older generations stay dead (generations only grow); this one lives.
  if (auto d = dead_writers_.find(agent); d != dead_writers_.end() && d->second >= generation) {
    d->second = generation - 1;
  }
  spdlog::info("prefiller '{}' (generation {}) was declared dead by its KV endpoint but reserves "
               "again: alive; watched again through a new endpoint",
               agent, generation);
  return true;
}

void Decoder::WatchPrefiller(std::string_view descriptor, std::string* agent, uint64_t* generation) {
  auto desc = kvtransfer::ParseDescriptor(descriptor);
  if (!desc.ok()) {
    spdlog::warn("reserve: unreadable prefiller transport descriptor ({}); its expired "
                 "reservations wait for its notice",
                 desc.status().message());
    return;
  }
  *agent = desc->agent_name;
  *generation = desc->generation;
  if (desc->agent_name == transport_.agent_name()) return;  // ourselves (role both): alive while we are
  std::string key(descriptor);
  uint64_t older = 0;
  const bool revived = ReviveWriter(desc->agent_name, desc->generation);
  {
    std::lock_guard lock(watch_mu_);
    if (auto w = watched_.find(key); w != watched_.end()) {
      // Watched already, unless that endpoint failed: then a new one (the
      // failed one stays with the transport, unused).
      if (!revived) return;
      watched_.erase(w);
    }
    // A newer generation of the same agent: the older process is gone.
    for (const auto& [d, peer] : watched_) {
      auto old = kvtransfer::ParseDescriptor(d);
      if (old.ok() && old->agent_name == desc->agent_name && old->generation < desc->generation) {
        older = std::max(older, old->generation);
      }
    }
    watched_[key] = 0;  // claimed; the import below fills it in
  }
  if (older != 0) OnPrefillerLost(desc->agent_name, older);
  auto peer = transport_.ImportPeer(descriptor);
  std::lock_guard lock(watch_mu_);
  if (!peer.ok()) {
    spdlog::warn("cannot watch prefiller '{}' through the KV transport ({}); its expired "
                 "reservations are freed at expiry",
                 desc->agent_name, peer.status().message());
    watched_.erase(key);  // tried again with its next reservation
    agent->clear();
    return;
  }
  watched_[key] = *peer;
}

}  // namespace tandem::decoder
