// KV events of DESIGN.md section 4: what a worker's prefix cache gained or
// lost, so the router's index can follow it.
//   stored(hashes, parent)  blocks whose chained hashes are `hashes` (in chain
//                           order) became reusable; `parent` is the hash of
//                           the block before hashes[0] (the root hash,
//                           RootHash(context), for a sequence's first block)
//   removed(hashes)         these blocks were evicted
//   cleared                 the whole cache was dropped (every tier)
// stored/removed name the tier (device, host, disk; engine/kv_tier.h) the
// blocks entered or left: a block the device evicts to host memory is
// removed(device) + stored(host); a lower-tier block onboarded for a
// prefix hit is stored(device) (+ removed(host) when it came from host).
// Every event has an id, increasing by one per event from 1, and the worker
// epoch (a new epoch means the worker restarted: forget what it said
// before). A subscriber that sees a gap in ids asks for a snapshot.
//
// Thread-safety: every method may be called from any thread. Publish is
// called by the engine (under its lock); subscriber callbacks run on the
// publishing thread and must be quick and must not call into the engine.
//
// Wake subscribers (issue 23): a drainer that only needs to know that
// events are queued (the worker's Watch loop) is woken once per batch, not
// once per event. Outside a hold every publish wakes it; while the engine
// holds (Hold/Release: while it steps, flushed once per step as the step's
// forward starts; docs/engine.md), the wake waits for the release, so one
// step's events reach the proxy in one update. Events are
// queued (Drain) at once either way; nothing is held past the release.
// Quiet events (published with `quiet`: the runs of output blocks a decode
// step commits, Engine::kDecodeCommitBlocks) wake nobody: queued, they leave with
// the drainer's next wake-up — any other event, or the Watch loop's next
// load sample (worker.load_interval while the worker is busy; docs/
// engine.md). Issue 23: a wake-up, a message and the proxy's answer to it
// per run per sequence. The stored events of a long prompt's chunk steps
// before its last are quiet too; the last chunk's step wakes the drainer
// (WakeIfQuiet) even when it stores no block, so a prompt's blocks leave
// at once when its prefill is done (docs/router.md, "Freshness"). So are
// the evictions that make room for a prompt's chunks and for a decoder's
// reservation (session 31; `quiet` below): they leave with the prompt's
// blocks, in one update per prompt instead of one per chunk. A
// prefill-only prompt's last chunk is quiet too (session 32): its blocks
// leave when the prefiller releases it after the push (WakeNow in
// Engine::ReleasePrefill / Abort), with the Prefill reply.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "engine/kv_tier.h"

namespace tandem::engine {

enum class KvEventKind { kStored, kRemoved, kCleared };

struct KvEvent {
  uint64_t event_id = 0;  // 1, 2, 3, ... within an epoch
  uint64_t epoch = 0;
  KvEventKind kind = KvEventKind::kStored;
  std::vector<uint64_t> hashes;  // stored/removed: block hashes; cleared: empty
  uint64_t parent_hash = 0;      // stored only
  KvTier tier = KvTier::kDevice; // stored/removed
};

// All cached blocks at one event id: a subscriber that applies this and
// then every event with a larger id has the worker's exact state.
struct KvSnapshot {
  uint64_t epoch = 0;
  uint64_t last_event_id = 0;
  struct Entry {
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    KvTier tier = KvTier::kDevice;
  };
  std::vector<Entry> blocks;
};

class KvEventPublisher {
 public:
  // `queue_capacity`: events kept for Drain; past it the oldest are dropped
  // (the drainer sees the gap in ids and resyncs with a snapshot).
  explicit KvEventPublisher(uint64_t epoch, size_t queue_capacity = 1 << 16);

  uint64_t epoch() const { return epoch_; }
  uint64_t last_event_id() const;

  using Callback = std::function<void(const KvEvent&)>;
  // Returns a subscription id for Unsubscribe. Called for every event.
  uint64_t Subscribe(Callback callback);
  // Called once after a publish outside a hold, and once at the release of
  // a hold during which events were published (see above).
  using WakeCallback = std::function<void()>;
  uint64_t SubscribeWake(WakeCallback callback);
  void Unsubscribe(uint64_t subscription);

  // Holds wake subscribers until the matching Release (holds nest).
  void Hold();
  void Release();
  // Wakes the wake subscribers (as a publish does: at the release while
  // held) when quiet events were queued since the last wake-up; nothing
  // otherwise.
  void WakeIfQuiet();
  // Wakes the wake subscribers now, inside a hold too, when queued events
  // have not been announced by a wake-up yet (quiet ones, or ones a hold
  // defers); nothing otherwise. For what the drainer should send at once:
  // a prefiller's parked prompt released as it replies (Engine::
  // ReleasePrefill), not at the engine's next step boundary.
  void WakeNow();

  // Takes up to `max_events` queued events, oldest first.
  std::vector<KvEvent> Drain(size_t max_events = SIZE_MAX);

  // Assigns the next id and delivers the event (called by the block manager).
  // `quiet`: queued without waking the wake subscribers (see above): a
  // decode step's run of output blocks and a prompt's chunks before its
  // last (BlockManager::Commit), the evictions that make room for a
  // prompt's chunk or a reservation (BlockManager::Allocate).
  void PublishStored(std::vector<uint64_t> hashes, uint64_t parent_hash,
                     KvTier tier = KvTier::kDevice, bool quiet = false);
  void PublishRemoved(std::vector<uint64_t> hashes, KvTier tier = KvTier::kDevice,
                      bool quiet = false);
  void PublishCleared();

 private:
  void Publish(KvEvent event, bool quiet);
  // Calls the wake subscribers; nothing queued is left unannounced.
  void WakeLocked();

  const uint64_t epoch_;
  const size_t queue_capacity_;
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  uint64_t next_subscription_ = 1;
  std::deque<KvEvent> queue_;
  std::map<uint64_t, Callback> subscribers_;
  std::map<uint64_t, WakeCallback> wake_subscribers_;
  uint32_t holds_ = 0;       // guarded by mu_
  bool wake_pending_ = false;  // guarded by mu_: published during the current hold
  bool quiet_queued_ = false;  // guarded by mu_: quiet events since the last wake-up
};

}  // namespace tandem::engine
