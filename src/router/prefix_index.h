// PrefixIndex: which workers hold which KV blocks, fed by each worker's KV
// event stream (DESIGN.md sections 4 and 5).
//
// Block hashes are chained (h_i depends on every earlier token), so a flat
// map hash -> set of workers answers "how many leading blocks of this prompt
// does worker w hold": the first position of the prompt where w is not a
// holder. No tree is needed, and a stored event's parent hash is not used.
// Overlap finds those positions by search, not by reading every block (see
// Overlap below).
//
// Event stream rules, per worker (state kept per worker):
//   - events arrive with (epoch, event_id); ids go 1, 2, 3, ... per epoch.
//   - id <= last applied: duplicate, ignored.
//   - id  > last + 1: gap. The worker needs a snapshot; its entries are kept
//     (mostly right, better than nothing) until ApplySnapshot replaces them;
//     later events are ignored until then.
//   - a new epoch (the worker restarted): its entries are dropped. Event id 1
//     of the new epoch starts the history afresh; any other id needs a
//     snapshot.
//   - an epoch the worker had before (a late message from before a restart,
//     or from the previous holder of a reused worker id): ignored.
//
// Thread-safety: every method may be called from any thread, concurrently.
// Entries are sharded by hash, each shard behind a std::shared_mutex;
// writers hold every shard's lock (taken in shard order) for one chunk of
// up to 256 of an event's blocks, written in the event's order (or one
// shard's lock for a slice of 8192 slots when a worker is dropped), lookups
// take each shard's shared lock once per round of probes (three rounds for
// 512 blocks), one at a time. Events of one worker are applied in the
// order the calls are made (a per-worker mutex); different workers proceed
// in parallel. A lookup concurrent with writes sees each block either
// before or after the write: the index is a routing hint, not a
// transaction.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "router/types.h"

namespace tandem::router {

enum class EventResult {
  kApplied,
  kDuplicate,         // id already applied: ignored
  kStaleEpoch,        // an epoch the worker no longer has: ignored
  kNeedsSnapshot,     // gap or restart: ask the worker for a snapshot now
  kAwaitingSnapshot,  // already asked (kNeedsSnapshot returned before): ignored
};
std::string_view EventResultName(EventResult r);

// Leading cached blocks per worker, indexed by WorkerId.
using OverlapBlocks = std::array<uint32_t, kMaxWorkers>;

class PrefixIndex {
 public:
  PrefixIndex();
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // A worker joins with `epoch` and no cached blocks; its history starts at
  // event id 1. Error if the id is out of range or already registered.
  Status AddWorker(WorkerId worker, uint64_t epoch);
  // Drops the worker's entries; its later events are refused (NotFound).
  // The epochs it had stay remembered as stale for the id's next holder.
  Status RemoveWorker(WorkerId worker);

  // Sizes the tables for `hashes` distinct indexed hashes (capped at
  // kReserveMaxHashes) so that storing that many grows no table, and writes
  // them now: a fresh fleet's first prompts then neither rehash nor fault
  // pages in on the event path. Never shrinks; tables still grow past it
  // on demand. The router calls it at AddWorker with the registered
  // workers' KV capacity (blocks) summed.
  void Reserve(uint64_t hashes);
  // At most 24 MiB of tables (32 where huge pages back them).
  static constexpr uint64_t kReserveMaxHashes = uint64_t{1} << 18;
  // Slots of all tables (24 bytes each) and rehashes so far (tests, debugging).
  uint64_t TableSlots() const;
  uint64_t Rehashes() const;
  // Whether an event's blocks are written in their order under every
  // shard's lock (while the tables take at most 4 MiB together) rather
  // than grouped by shard (prefix_index.cc, kWriteChunk; tests).
  bool InOrderWrites() const;

  // Applies one event. Error (NotFound) only for an unregistered worker.
  Result<EventResult> Apply(WorkerId worker, const KvEventView& event);

  // Replaces the worker's entries with `hashes` (every block it caches), as
  // of `last_event_id` in `epoch`; events after that id then apply. A
  // snapshot of an epoch the worker no longer has returns kStaleEpoch.
  Result<EventResult> ApplySnapshot(WorkerId worker, uint64_t epoch, uint64_t last_event_id,
                                    std::span<const uint64_t> hashes);

  // For each worker, how many leading entries of `block_hashes` it holds.
  // Workers holding none get 0.
  //
  // Searches instead of reading every block: a worker's cached blocks of
  // one chain form a prefix of it (the engine evicts a released sequence's
  // tail before its head and a reuse always starts at block 0; see
  // docs/router.md, "Prefix index"), so the holders of block i include the
  // holders of block i+1 and each worker's answer is where it drops out.
  // The lookup probes 17 evenly spaced blocks, then 15 inside each gap
  // where some worker dropped out, and so on down to single blocks: a fully
  // cached 512-block prompt costs 17 lookups instead of 512, one change
  // point about 33. For every worker the answer is a position p with the
  // worker holding block p-1 (or p = 0) and missing block p (or p = n); it
  // is the first miss whenever the worker's blocks of this chain form a
  // prefix. If they have a hole (a transient state: an event half applied,
  // or the engine corner case in docs/router.md) the answer may lie past
  // the hole. Answers never shrink as a worker stores more blocks. Prompts
  // of at most kEveryBlockMax blocks are read whole (OverlapEveryBlock).
  void Overlap(std::span<const uint64_t> block_hashes, OverlapBlocks* out) const;
  // The same, reading blocks in order until every worker has missed one:
  // exactly the first miss, holes or not; costs one lookup per block up to
  // the last holder's miss.
  void OverlapEveryBlock(std::span<const uint64_t> block_hashes, OverlapBlocks* out) const;
  static constexpr size_t kEveryBlockMax = 48;

  // Blocks the worker holds right now, as its events said (a counter kept
  // with every store and removal: O(1), for placement).
  uint64_t HeldBlocks(WorkerId worker) const;
  // Workers holding `hash` (tests, debugging).
  WorkerMask Holders(uint64_t hash) const;
  // Indexed (hash, worker) pairs of one worker (a scan: tests, debugging).
  uint64_t BlocksOf(WorkerId worker) const;
  // Distinct hashes with at least one holder.
  uint64_t size() const;

  static constexpr uint32_t kShardBits = 4;
  static constexpr uint32_t kNumShards = 1u << kShardBits;

 private:
  class Shard;
  struct WorkerState {
    std::mutex mu;  // serializes one worker's events; taken before any shard lock
    bool registered = false;
    bool awaiting_snapshot = false;
    uint64_t epoch = 0;
    uint64_t last_event_id = 0;
    std::vector<uint64_t> old_epochs;  // epochs now stale, most recent last (bounded)
  };

  static uint32_t ShardOf(uint64_t hash) {
    return static_cast<uint32_t>(hash >> (64 - kShardBits));
  }
  // Calls f(shard, hash) for each hash, in order, under that shard's write
  // lock: every shard's lock is taken once per chunk of hashes.
  template <typename F>
  void ForEachByShard(std::span<const uint64_t> hashes, F&& f);
  void StoreBlocks(WorkerId worker, std::span<const uint64_t> hashes);
  void RemoveBlocks(WorkerId worker, std::span<const uint64_t> hashes);
  void DropWorkerEntries(WorkerId worker);
  // masks[i] = holders of hashes[i], for any number of hashes: every slot is
  // prefetched first, then each shard's lock is taken once per 512 hashes.
  void LookupMany(const uint64_t* hashes, size_t n, WorkerMask* masks) const;
  static bool IsOldEpoch(const WorkerState& s, uint64_t epoch);
  static void RetireEpoch(WorkerState& s);

  std::array<std::unique_ptr<Shard>, kNumShards> shards_;
  std::array<WorkerState, kMaxWorkers> workers_;
  std::array<std::atomic<uint64_t>, kMaxWorkers> held_{};  // [worker]: HeldBlocks
};

}  // namespace tandem::router
