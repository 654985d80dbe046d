#include "router/prefix_index.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <shared_mutex>
#include <string>

namespace tandem::router {

std::string_view EventResultName(EventResult r) {
  switch (r) {
    case EventResult::kApplied: return "applied";
    case EventResult::kDuplicate: return "duplicate";
    case EventResult::kStaleEpoch: return "stale_epoch";
    case EventResult::kNeedsSnapshot: return "needs_snapshot";
    case EventResult::kAwaitingSnapshot: return "awaiting_snapshot";
  }
  return "?";
}

namespace {

// Allocates big tables on 2 MiB boundaries and asks for huge pages: lookups
// touch random slots of a table of tens of MiB, and with 4 KiB pages nearly
// every one would also miss the TLB. (A hint; without THP it changes nothing.)
// From 1 MiB on, rounded up to whole huge pages (at most twice the bytes):
// the 131,072-block pool's shards are 1.5 MiB each, and an event's stores
// into them went from 44.3 to 32.9 ns per hash with huge pages (medians of
// four alternated bench_router BM_ApplyColdEvents runs; issue 23, session
// 35).
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHugeBytes = size_t{2} << 20;
  static constexpr size_t kMinBytes = size_t{1} << 20;  // smaller: plain operator new
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT: rebinding

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMinBytes) return static_cast<T*>(::operator new(bytes));
    const size_t rounded = (bytes + kHugeBytes - 1) / kHugeBytes * kHugeBytes;
    void* p = std::aligned_alloc(kHugeBytes, rounded);
    if (p == nullptr) throw std::bad_alloc();
    madvise(p, rounded, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kMinBytes) {
      ::operator delete(p);
    } else {
      std::free(p);
    }
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
};

}  // namespace

// One shard: an open-addressing (linear probing) table hash -> WorkerMask.
// The hashes are XXH3 outputs, so their low bits index the table directly
// (the top bits chose the shard). Key 0 marks an empty slot; the one real
// hash equal to 0 lives in `zero_`. A removal that empties a slot's mask
// deletes the slot by backward shift (the entries after it in its probe
// run move back into the gap), so steady store/remove churn leaves no
// tombstones and never rehashes a table. Only while a worker's entries are
// being dropped (DropWorkerEntries' sliced scan, which entries must not
// move under) does an emptied slot stay as a tombstone: it keeps its key so
// probes pass over it, is reused by inserts and is dropped at the next
// rehash.
class PrefixIndex::Shard {
 public:
  mutable std::shared_mutex mu;

  // Everything below: caller holds `mu` (shared for const methods).
  WorkerMask Get(uint64_t key) const {
    if (key == 0) return zero_;
    if (slots_.empty()) return {};
    for (uint64_t i = key & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.mask;
      if (s.key == 0) return {};
    }
  }

  // May be called without `mu`: reads the table's address through relaxed
  // atomics, so a concurrent rehash only makes the hint useless (a prefetch
  // of a stale address never faults). Lets a lookup start every memory
  // access of a chunk before it takes any lock.
  void PrefetchHint(uint64_t key) const {
    const char* base = hint_base_.load(std::memory_order_relaxed);
    if (base != nullptr) {
      // The slot and the next one (linear probing) may span two lines.
      const char* slot = base + (key & hint_mask_.load(std::memory_order_relaxed)) * sizeof(Slot);
      __builtin_prefetch(slot);
      __builtin_prefetch(slot + 2 * sizeof(Slot) - 1);
    }
  }

  // True when the worker did not hold `key` before.
  bool Set(uint64_t key, WorkerId worker) {
    if (key == 0) {
      const bool added = !zero_.Test(worker);
      if (!zero_.Any()) ++live_;
      zero_.Set(worker);
      return added;
    }
    if ((used_ + 1) * 2 > slots_.size()) Rehash();  // over half full (tombstones count)
    uint64_t tomb = UINT64_MAX;
    uint64_t i = key & mask_;
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) {
        const bool added = !s.mask.Test(worker);
        if (!s.mask.Any()) ++live_;
        s.mask.Set(worker);
        return added;
      }
      if (s.key == 0) break;
      if (tomb == UINT64_MAX && !s.mask.Any()) tomb = i;
    }
    if (tomb != UINT64_MAX) {
      i = tomb;
    } else {
      ++used_;
    }
    slots_[i].key = key;
    slots_[i].mask = WorkerMask{};
    slots_[i].mask.Set(worker);
    ++live_;
    return true;
  }

  // True when the worker held `key`.
  bool Unset(uint64_t key, WorkerId worker) {
    if (key == 0) {
      if (zero_.Test(worker)) {
        zero_.Clear(worker);
        if (!zero_.Any()) --live_;
        return true;
      }
      return false;
    }
    if (slots_.empty()) return false;
    for (uint64_t i = key & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) {
        if (!s.mask.Test(worker)) return false;
        s.mask.Clear(worker);
        if (!s.mask.Any()) {
          --live_;
          if (drops_ == 0) Erase(i);
        }
        return true;
      }
      if (s.key == 0) return false;
    }
  }

  // Removes `worker` from slots [begin, end) (and from the hash 0 with the
  // first slice). Returns false once begin is past the table.
  // `cleared` counts the entries the worker lost.
  bool ClearWorkerSlice(WorkerId worker, uint64_t begin, uint64_t end, uint64_t* cleared) {
    if (begin == 0 && Unset(0, worker)) ++*cleared;
    if (begin >= slots_.size()) return false;
    end = std::min<uint64_t>(end, slots_.size());
    for (uint64_t i = begin; i < end; ++i) {
      Slot& s = slots_[i];
      if (s.key != 0 && s.mask.Test(worker)) {
        s.mask.Clear(worker);
        if (!s.mask.Any()) --live_;
        ++*cleared;
      }
    }
    return true;
  }

  // Bumped by every rehash (entries move): a sliced scan restarts.
  uint64_t generation() const { return generation_; }

  // Brackets a sliced scan of DropWorkerEntries (calls nest: one per worker
  // being dropped). In between, removals leave tombstones instead of
  // shifting entries, which could carry an entry from a slice not yet
  // scanned into one already scanned.
  void BeginDrop() { ++drops_; }
  void EndDrop() { --drops_; }

  uint64_t CountWorker(WorkerId worker) const {
    uint64_t n = zero_.Test(worker) ? 1 : 0;
    for (const Slot& s : slots_) n += (s.key != 0 && s.mask.Test(worker)) ? 1 : 0;
    return n;
  }

  uint64_t live() const { return live_; }

  // Grows the table (never shrinks it) to hold `live` entries with room
  // before the next rehash, and keeps at least that capacity from now on.
  // The new table is written here, so its pages are resident before the
  // first event needs them.
  void Reserve(uint64_t live) {
    uint64_t cap = 1024;
    while (cap < live * 2) cap <<= 1;  // `live` stays under the rehash mark (half full)
    min_capacity_ = std::max(min_capacity_, cap);
    if (cap > slots_.size()) Rehash();
  }

  uint64_t capacity() const { return slots_.size(); }

  // The table's bytes, readable without `mu` (a relaxed atomic: exact
  // except during a rehash, which only makes it stale).
  uint64_t table_bytes_hint() const {
    return (hint_mask_.load(std::memory_order_relaxed) + 1) * sizeof(Slot);
  }

 private:
  struct Slot {
    uint64_t key = 0;
    WorkerMask mask;
  };

  // Empties slot i, whose mask is empty, by backward shift: each later
  // entry of the probe run whose home slot is not in (i, j] moves back into
  // the gap, which moves on to where it was. The run ends at an empty slot.
  // Tombstones move like entries. Lookups then find every key as before,
  // and the slot counts as unused again.
  void Erase(uint64_t i) {
    for (uint64_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      const Slot& s = slots_[j];
      if (s.key == 0) break;
      // How far j is from its home slot and from the gap.
      if (((j - s.key) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = s;
        i = j;
      }
    }
    slots_[i] = Slot{};
    --used_;
  }

  // Rebuilds with only live entries, at most 40 % full afterwards (so that
  // the next rehash, at 50 % used, is many inserts away), and never below
  // the reserved capacity. Under half full the probe runs stay short: a
  // lookup of Overlap's search went from ~28 to ~20 ns when the maximum
  // load went from 70 % to 50 % (the bench's staggered prompt), for 48–120
  // bytes of table per indexed hash. A rehash at the same capacity (the
  // tombstones a worker's drop left) rebuilds the table in place, so
  // its pages stay resident instead of a fresh allocation faulting them in
  // again.
  void Rehash() {
    uint64_t cap = 1024;
    while (cap * 2 < (live_ + 1) * 5) cap <<= 1;
    cap = std::max(cap, min_capacity_);
    ++generation_;
    if (cap == slots_.size()) {
      live_scratch_.clear();
      for (const Slot& s : slots_) {
        if (s.key != 0 && s.mask.Any()) live_scratch_.push_back(s);
      }
      std::fill(slots_.begin(), slots_.end(), Slot{});
      Reinsert(live_scratch_.begin(), live_scratch_.end());
      return;
    }
    std::vector<Slot, HugePageAllocator<Slot>> old;
    old.swap(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    hint_base_.store(nullptr, std::memory_order_relaxed);
    hint_mask_.store(mask_, std::memory_order_relaxed);
    hint_base_.store(reinterpret_cast<const char*>(slots_.data()), std::memory_order_relaxed);
    Reinsert(old.begin(), old.end());
  }

  // Puts the live slots of [begin, end) into the empty table.
  template <typename It>
  void Reinsert(It begin, It end) {
    used_ = 0;
    for (It it = begin; it != end; ++it) {
      const Slot& s = *it;
      if (s.key == 0 || !s.mask.Any()) continue;
      uint64_t i = s.key & mask_;
      while (slots_[i].key != 0) i = (i + 1) & mask_;
      slots_[i] = s;
      ++used_;
    }
  }

  std::vector<Slot, HugePageAllocator<Slot>> slots_;  // [capacity], a power of two
  uint64_t mask_ = 0;        // capacity - 1
  uint64_t used_ = 0;        // slots with a key (live + tombstones)
  uint64_t live_ = 0;        // keys with a non-empty mask (zero_ included)
  WorkerMask zero_;          // holders of the hash 0
  uint64_t generation_ = 0;  // rehashes so far
  uint32_t drops_ = 0;       // DropWorkerEntries scans in progress (BeginDrop)
  uint64_t min_capacity_ = 0;  // Reserve's: a rehash never goes below it
  std::vector<Slot> live_scratch_;  // an in-place rehash's live entries (kept: no allocation next time)
  std::atomic<const char*> hint_base_{nullptr};  // slots_.data(), for PrefetchHint
  std::atomic<uint64_t> hint_mask_{0};           // mask_, for PrefetchHint
};

namespace {

// How a stored or removed event is written (ForEachByShard), issue 23
// (session 35). Prefetching a whole chunk of 512 slots and then writing
// them grouped by shard left most slots out of the cache again by the time
// they were written (the prefetches outrun the cache's outstanding
// misses): 39.4 ns per stored hash and 27.6 per removed one on the sim
// fleet's cold tables (3 MiB; medians of six alternated bench_router
// BM_ApplyColdEvents runs). Writing the hashes in their order, each slot
// prefetched kWriteAhead hashes earlier, under every shard's lock for a
// chunk of kWriteChunk: 26.1 and 20.1. But on tables past the TLB's reach,
// in order is slower (58-65 against 40 per stored hash on the 131,072-
// block pool's 24 MiB with 4 KiB pages: every write a page walk in another
// shard's table; 35-42 against 32-33 on huge pages), so it is used only
// while all tables together fit in kInOrderMaxTableBytes.
constexpr size_t kWriteChunk = 256;  // a lookup waits for at most one (~7 us cold)
constexpr size_t kWriteAhead = 16;
constexpr uint64_t kInOrderMaxTableBytes = uint64_t{4} << 20;

// Positions of up to kMaxChunk hashes grouped by shard (a counting sort),
// so that each shard's lock is taken once per chunk.
constexpr size_t kMaxChunk = 512;

struct ShardGroups {
  std::array<uint16_t, kMaxChunk> order;                    // [len]: positions, by shard
  std::array<uint16_t, PrefixIndex::kNumShards + 1> start;  // [shards + 1]: offsets into order

  void Build(const uint64_t* h, size_t len, uint32_t (*shard_of_hash)(uint64_t)) {
    std::array<uint8_t, kMaxChunk> shard_of;  // [len]
    start.fill(0);
    for (size_t i = 0; i < len; ++i) {
      shard_of[i] = static_cast<uint8_t>(shard_of_hash(h[i]));
      ++start[shard_of[i] + 1];
    }
    for (uint32_t s = 0; s < PrefixIndex::kNumShards; ++s) start[s + 1] += start[s];
    std::array<uint16_t, PrefixIndex::kNumShards> fill;
    std::copy(start.begin(), start.end() - 1, fill.begin());
    for (size_t i = 0; i < len; ++i) order[fill[shard_of[i]]++] = static_cast<uint16_t>(i);
  }
};

}  // namespace

PrefixIndex::PrefixIndex() {
  for (auto& s : shards_) s = std::make_unique<Shard>();
}

PrefixIndex::~PrefixIndex() = default;

bool PrefixIndex::IsOldEpoch(const WorkerState& s, uint64_t epoch) {
  return std::find(s.old_epochs.begin(), s.old_epochs.end(), epoch) != s.old_epochs.end();
}

void PrefixIndex::RetireEpoch(WorkerState& s) {
  constexpr size_t kKeep = 16;
  if (s.old_epochs.size() >= kKeep) s.old_epochs.erase(s.old_epochs.begin());
  s.old_epochs.push_back(s.epoch);
}

Status PrefixIndex::AddWorker(WorkerId worker, uint64_t epoch) {
  if (worker >= kMaxWorkers) {
    return InvalidArgumentError("worker id " + std::to_string(worker) + " is out of range; at most " +
                                std::to_string(kMaxWorkers) + " workers");
  }
  WorkerState& s = workers_[worker];
  std::lock_guard lock(s.mu);
  if (s.registered) return AlreadyExistsError("worker " + std::to_string(worker) + " is already in the index");
  std::erase(s.old_epochs, epoch);
  s.registered = true;
  s.awaiting_snapshot = false;
  s.epoch = epoch;
  s.last_event_id = 0;
  return Status::Ok();
}

Status PrefixIndex::RemoveWorker(WorkerId worker) {
  if (worker >= kMaxWorkers) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  WorkerState& s = workers_[worker];
  std::lock_guard lock(s.mu);
  if (!s.registered) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  DropWorkerEntries(worker);
  RetireEpoch(s);
  s.registered = false;
  return Status::Ok();
}

Result<EventResult> PrefixIndex::Apply(WorkerId worker, const KvEventView& event) {
  if (worker >= kMaxWorkers) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  WorkerState& s = workers_[worker];
  std::lock_guard lock(s.mu);
  if (!s.registered) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  if (event.epoch != s.epoch) {
    if (IsOldEpoch(s, event.epoch)) return EventResult::kStaleEpoch;
    // The worker restarted: what it said before is gone with its cache.
    RetireEpoch(s);
    s.epoch = event.epoch;
    s.last_event_id = 0;
    DropWorkerEntries(worker);
    if (event.event_id != 1) {
      s.awaiting_snapshot = true;
      return EventResult::kNeedsSnapshot;
    }
    s.awaiting_snapshot = false;
  } else if (s.awaiting_snapshot) {
    return EventResult::kAwaitingSnapshot;
  } else if (event.event_id <= s.last_event_id) {
    return EventResult::kDuplicate;
  } else if (event.event_id != s.last_event_id + 1) {
    s.awaiting_snapshot = true;
    return EventResult::kNeedsSnapshot;
  }
  // Events about the host/disk tiers only advance the id here; the
  // router's TierIndex keeps those blocks.
  if (event.tier == KvTier::kDevice || event.kind == KvEventKind::kCleared) {
    switch (event.kind) {
      case KvEventKind::kStored: StoreBlocks(worker, event.hashes); break;
      case KvEventKind::kRemoved: RemoveBlocks(worker, event.hashes); break;
      case KvEventKind::kCleared: DropWorkerEntries(worker); break;
    }
  }
  s.last_event_id = event.event_id;
  return EventResult::kApplied;
}

Result<EventResult> PrefixIndex::ApplySnapshot(WorkerId worker, uint64_t epoch, uint64_t last_event_id,
                                               std::span<const uint64_t> hashes) {
  if (worker >= kMaxWorkers) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  WorkerState& s = workers_[worker];
  std::lock_guard lock(s.mu);
  if (!s.registered) return NotFoundError("worker " + std::to_string(worker) + " is not in the index");
  if (epoch != s.epoch) {
    if (IsOldEpoch(s, epoch)) return EventResult::kStaleEpoch;
    RetireEpoch(s);
    s.epoch = epoch;
  }
  // Replaying events after an older snapshot is harmless (stored/removed
  // are idempotent), so any snapshot of the current epoch is accepted.
  DropWorkerEntries(worker);
  StoreBlocks(worker, hashes);
  s.last_event_id = last_event_id;
  s.awaiting_snapshot = false;
  return EventResult::kApplied;
}

void PrefixIndex::StoreBlocks(WorkerId worker, std::span<const uint64_t> hashes) {
  uint64_t added = 0;
  ForEachByShard(hashes, [worker, &added](Shard& shard, uint64_t h) { added += shard.Set(h, worker); });
  held_[worker].fetch_add(added, std::memory_order_relaxed);
}

void PrefixIndex::RemoveBlocks(WorkerId worker, std::span<const uint64_t> hashes) {
  uint64_t removed = 0;
  ForEachByShard(hashes, [worker, &removed](Shard& shard, uint64_t h) { removed += shard.Unset(h, worker); });
  held_[worker].fetch_sub(removed, std::memory_order_relaxed);
}

uint64_t PrefixIndex::HeldBlocks(WorkerId worker) const {
  return worker < kMaxWorkers ? held_[worker].load(std::memory_order_relaxed) : 0;
}

template <typename F>
void PrefixIndex::ForEachByShard(std::span<const uint64_t> hashes, F&& f) {
  if (hashes.size() < 8) {  // small events: grouping costs more than it saves
    for (uint64_t h : hashes) {
      Shard& shard = *shards_[ShardOf(h)];
      std::unique_lock lock(shard.mu);
      f(shard, h);
    }
    return;
  }
  if (!InOrderWrites()) {
    // Prefetch a whole chunk, then write it grouped by shard, one shard's
    // lock at a time.
    ShardGroups groups;
    for (size_t begin = 0; begin < hashes.size(); begin += kMaxChunk) {
      const size_t len = std::min(hashes.size() - begin, kMaxChunk);
      const uint64_t* h = hashes.data() + begin;
      for (size_t i = 0; i < len; ++i) shards_[ShardOf(h[i])]->PrefetchHint(h[i]);
      groups.Build(h, len, &ShardOf);
      for (uint32_t s = 0; s < kNumShards; ++s) {
        if (groups.start[s] == groups.start[s + 1]) continue;
        Shard& shard = *shards_[s];
        std::unique_lock lock(shard.mu);
        for (uint32_t k = groups.start[s]; k < groups.start[s + 1]; ++k)
          f(shard, h[groups.order[k]]);
      }
    }
    return;
  }
  // Every shard's lock for a chunk, taken in shard order (so two writers
  // never deadlock; readers hold one shard's lock at a time), and the
  // hashes written in their own order, each slot prefetched kWriteAhead
  // hashes before it is written.
  struct AllLocked {
    const std::array<std::unique_ptr<Shard>, kNumShards>& shards;
    explicit AllLocked(const std::array<std::unique_ptr<Shard>, kNumShards>& s) : shards(s) {
      for (const auto& shard : shards) shard->mu.lock();
    }
    ~AllLocked() {
      for (const auto& shard : shards) shard->mu.unlock();
    }
  };
  for (size_t begin = 0; begin < hashes.size(); begin += kWriteChunk) {
    const size_t len = std::min(hashes.size() - begin, kWriteChunk);
    const uint64_t* h = hashes.data() + begin;
    for (size_t i = 0; i < std::min(len, kWriteAhead); ++i)
      shards_[ShardOf(h[i])]->PrefetchHint(h[i]);
    AllLocked locked(shards_);
    for (size_t i = 0; i < len; ++i) {
      if (i + kWriteAhead < len)
        shards_[ShardOf(h[i + kWriteAhead])]->PrefetchHint(h[i + kWriteAhead]);
      f(*shards_[ShardOf(h[i])], h[i]);
    }
  }
}

bool PrefixIndex::InOrderWrites() const {
  uint64_t bytes = 0;
  for (const auto& shard : shards_) bytes += shard->table_bytes_hint();
  return bytes <= kInOrderMaxTableBytes;
}

void PrefixIndex::DropWorkerEntries(WorkerId worker) {
  // A shard at a time and a slice of it at a time, so that a lookup never
  // waits for more than one slice. The worker's own mutex is held by the
  // caller, so no new entry of this worker appears meanwhile; entries move
  // only in a rehash, after which the shard's scan starts over.
  constexpr uint64_t kSliceSlots = 8192;
  for (auto& shard : shards_) {
    uint64_t begin = 0;
    uint64_t generation = 0;
    bool started = false;
    for (;;) {
      std::unique_lock lock(shard->mu);
      if (!started) {
        shard->BeginDrop();  // other workers' removals shift no entry meanwhile
        started = true;
        generation = shard->generation();
      } else if (shard->generation() != generation) {
        begin = 0;
        generation = shard->generation();
      }
      uint64_t cleared = 0;
      const bool more = shard->ClearWorkerSlice(worker, begin, begin + kSliceSlots, &cleared);
      held_[worker].fetch_sub(cleared, std::memory_order_relaxed);
      if (!more) {
        shard->EndDrop();
        break;
      }
      begin += kSliceSlots;
    }
  }
}

void PrefixIndex::LookupMany(const uint64_t* hashes, size_t n, WorkerMask* masks) const {
  ShardGroups groups;
  for (size_t begin = 0; begin < n; begin += kMaxChunk) {
    const size_t len = std::min(n - begin, kMaxChunk);
    const uint64_t* h = hashes + begin;
    WorkerMask* m = masks + begin;
    for (size_t i = 0; i < len; ++i) shards_[ShardOf(h[i])]->PrefetchHint(h[i]);
    groups.Build(h, len, &ShardOf);
    for (uint32_t s = 0; s < kNumShards; ++s) {
      if (groups.start[s] == groups.start[s + 1]) continue;
      const Shard& shard = *shards_[s];
      std::shared_lock lock(shard.mu);
      for (uint32_t k = groups.start[s]; k < groups.start[s + 1]; ++k) {
        m[groups.order[k]] = shard.Get(h[groups.order[k]]);
      }
    }
  }
}

void PrefixIndex::OverlapEveryBlock(std::span<const uint64_t> block_hashes, OverlapBlocks* out) const {
  out->fill(0);
  const size_t n = block_hashes.size();
  // Lookups go in chunks growing from 32 to 512 blocks, and the walk stops
  // after the chunk where the last worker missed.
  std::array<WorkerMask, kMaxChunk> masks;  // [chunk]: holders of each block
  WorkerMask alive;
  size_t begin = 0;
  size_t chunk = 32;
  while (begin < n) {
    const size_t len = std::min(n - begin, chunk);
    LookupMany(block_hashes.data() + begin, len, masks.data());
    for (size_t i = 0; i < len; ++i) {
      const WorkerMask& m = masks[i];
      if (begin + i == 0) {
        alive = m;
      } else {
        const uint32_t pos = static_cast<uint32_t>(begin + i);
        alive.AndNot(m).ForEach([&](WorkerId w) { (*out)[w] = pos; });
        alive &= m;
      }
      if (!alive.Any()) return;
    }
    begin += len;
    chunk = std::min(chunk * 4, kMaxChunk);
  }
  alive.ForEach([&](WorkerId w) { (*out)[w] = static_cast<uint32_t>(n); });
}

namespace {

// Workers `who` hold block `lo` and miss block `hi` (hi may be the prompt's
// length: past the end); each one's answer lies in (lo, hi].
struct Gap {
  uint32_t lo = 0, hi = 0;
  WorkerMask who;
  uint32_t probes_begin = 0, probes_end = 0;  // its probes in this round
};

// Gaps each probed interval is cut into per round.
constexpr uint32_t kFanout = 16;

struct SearchScratch {
  std::vector<uint32_t> pos;      // [probes]: block positions, ascending within a gap
  std::vector<uint64_t> keys;     // [probes]: their hashes
  std::vector<WorkerMask> masks;  // [probes]: their holders
  std::vector<Gap> gaps, next;
};

}  // namespace

void PrefixIndex::Overlap(std::span<const uint64_t> block_hashes, OverlapBlocks* out) const {
  const size_t n = block_hashes.size();
  if (n <= kEveryBlockMax) {
    OverlapEveryBlock(block_hashes, out);
    return;
  }
  out->fill(0);
  thread_local SearchScratch t;  // no allocation once warm
  const auto lookup = [&] {
    t.keys.resize(t.pos.size());
    t.masks.resize(t.pos.size());
    for (size_t i = 0; i < t.pos.size(); ++i) t.keys[i] = block_hashes[t.pos[i]];
    LookupMany(t.keys.data(), t.keys.size(), t.masks.data());
  };
  // Walks one gap's probes in order: a worker leaves `alive` at its first
  // missed probe, giving the smaller gap (previous probe, that probe].
  // Gaps one block wide are answered at once.
  const auto split = [&](uint32_t lo, WorkerMask alive, uint32_t hi, uint32_t begin, uint32_t end) {
    uint32_t prev = lo;
    const auto emit = [&](const WorkerMask& who, uint32_t gap_hi) {
      if (gap_hi == prev + 1) {
        who.ForEach([&](WorkerId w) { (*out)[w] = gap_hi; });
      } else {
        t.next.push_back(Gap{prev, gap_hi, who});
      }
    };
    for (uint32_t k = begin; k < end; ++k) {
      const WorkerMask dropped = alive.AndNot(t.masks[k]);
      if (dropped.Any()) emit(dropped, t.pos[k]);
      alive &= t.masks[k];
      if (!alive.Any()) return;
      prev = t.pos[k];
    }
    emit(alive, hi);
  };

  // Round 1: block 0, the last block and 15 evenly spaced between them.
  const uint32_t last = static_cast<uint32_t>(n - 1);
  t.pos.clear();
  for (uint32_t k = 0; k <= kFanout; ++k) t.pos.push_back(static_cast<uint32_t>(uint64_t{last} * k / kFanout));
  lookup();
  t.next.clear();
  // Workers missing block 0 keep 0; the others start alive at block 0.
  split(0, t.masks[0], static_cast<uint32_t>(n), 1, static_cast<uint32_t>(t.pos.size()));

  // Later rounds: 15 evenly spaced blocks inside each open gap, or all of
  // its blocks when it has at most 16; every gap's probes in one lookup.
  while (!t.next.empty()) {
    t.gaps.swap(t.next);
    t.next.clear();
    t.pos.clear();
    for (Gap& g : t.gaps) {
      g.probes_begin = static_cast<uint32_t>(t.pos.size());
      const uint32_t width = g.hi - g.lo;  // > 1
      if (width <= kFanout) {
        for (uint32_t p = g.lo + 1; p < g.hi; ++p) t.pos.push_back(p);
      } else {
        for (uint32_t k = 1; k < kFanout; ++k) t.pos.push_back(g.lo + static_cast<uint32_t>(uint64_t{width} * k / kFanout));
      }
      g.probes_end = static_cast<uint32_t>(t.pos.size());
    }
    lookup();
    for (const Gap& g : t.gaps) split(g.lo, g.who, g.hi, g.probes_begin, g.probes_end);
  }
}

void PrefixIndex::Reserve(uint64_t hashes) {
  hashes = std::min(hashes, kReserveMaxHashes);
  // A shard's share, plus room for the hash's uneven spread over shards.
  const uint64_t share = hashes / kNumShards;
  const uint64_t per_shard = share + share / 8 + 64;
  for (auto& shard : shards_) {
    std::unique_lock lock(shard->mu);
    shard->Reserve(per_shard);
  }
}

uint64_t PrefixIndex::TableSlots() const {
  uint64_t n = 0;
  for (const auto& shard : shards_) {
    std::shared_lock lock(shard->mu);
    n += shard->capacity();
  }
  return n;
}

uint64_t PrefixIndex::Rehashes() const {
  uint64_t n = 0;
  for (const auto& shard : shards_) {
    std::shared_lock lock(shard->mu);
    n += shard->generation();
  }
  return n;
}

WorkerMask PrefixIndex::Holders(uint64_t hash) const {
  const Shard& shard = *shards_[ShardOf(hash)];
  std::shared_lock lock(shard.mu);
  return shard.Get(hash);
}

uint64_t PrefixIndex::BlocksOf(WorkerId worker) const {
  uint64_t n = 0;
  for (const auto& shard : shards_) {
    std::shared_lock lock(shard->mu);
    n += shard->CountWorker(worker);
  }
  return n;
}

uint64_t PrefixIndex::size() const {
  uint64_t n = 0;
  for (const auto& shard : shards_) {
    std::shared_lock lock(shard->mu);
    n += shard->live();
  }
  return n;
}

}  // namespace tandem::router
