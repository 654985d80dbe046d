// Plain types shared by the router's parts: worker ids and roles, the
// worker-set bit mask, load reports and KV events as the router sees them.
// The proxy converts its protobuf messages into these at the RPC edge; the
// router never sees protobuf.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace tandem::router {

// Small dense integers assigned by WorkerSet; reused after a worker leaves.
using WorkerId = uint32_t;
inline constexpr WorkerId kNoWorker = UINT32_MAX;
// One bit per worker in every index entry: 128 workers fit in 16 bytes.
inline constexpr uint32_t kMaxWorkers = 128;

enum class WorkerRole { kPrefill, kDecode, kBoth };
std::string_view WorkerRoleName(WorkerRole role);
inline bool CanPrefill(WorkerRole r) { return r != WorkerRole::kDecode; }
inline bool CanDecode(WorkerRole r) { return r != WorkerRole::kPrefill; }

// What the router needs to know about a worker (from proto WorkerInfo).
struct WorkerInfo {
  std::string name;   // unique in the fleet
  WorkerRole role = WorkerRole::kBoth;
  std::string node;   // label "node": workers on one host share a fast link
  std::string zone;   // label "zone"
  uint64_t epoch = 0;            // random per process start (KV event epoch)
  uint32_t num_blocks = 0;       // KV pool size; free blocks until the first report (0: unknown)
  // Decode seats: requests a decoder holds reserved or decoding at once
  // (its scheduler.max_num_seqs); 0: unknown, seats ignored.
  uint32_t decode_seats = 0;
  uint64_t block_bytes = 0;      // bytes of one KV block (all layers), for transfer time
  // Its rank layout (issue 18) and the model dimensions it splits: a
  // prefiller is paired only with decoders whose layout
  // parallel::KvLayoutsPairable accepts.
  uint32_t tensor_parallel = 1;
  uint32_t pipeline_parallel = 1;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
};

// A worker's own account of its load (proto LoadReport).
struct LoadReport {
  uint32_t queued_prefill_tokens = 0;
  uint32_t active_decode_blocks = 0;
  uint32_t free_blocks = 0;
  uint32_t running_requests = 0;
  // Decoder: requests registered (Decode streams open), each of which holds
  // or will need one of its decode seats.
  uint32_t registered_requests = 0;
  // Decoder: reservations held (their blocks are in use, their requests
  // not running yet).
  uint32_t num_reservations = 0;
  // Decoder: blocks its growth reserve keeps free now (docs/engine.md,
  // "Growth reserve"): a reservation needs them free beyond its own.
  uint32_t kv_growth_reserve_blocks = 0;
  // Decoder: the reserve's ratio (0: off, or not reported); a new request's
  // reservation keeps this share of what it may generate free too.
  float kv_growth_ratio = 0;
  // Totals since the worker started: prefill tokens computed and the
  // seconds of the engine steps that computed them (its prefill rate).
  uint64_t prefill_tokens_total = 0;
  double prefill_seconds_total = 0;
  // Their causal-attention (query, key) pairs, total, and one pair's cost
  // in prefill tokens (0: not reported; PrefillRate).
  uint64_t prefill_attention_pairs_total = 0;
  double prefill_pair_cost = 0;
  // Decoder: decode seats given back and seat-seconds, totals since the
  // worker started (its mean seat hold time: SeatTurnover).
  uint64_t seats_released_total = 0;
  double seat_seconds_total = 0;
};

enum class KvEventKind { kStored, kRemoved, kCleared };
// The KV memory tier an event is about (docs/engine.md, "KV tiers").
enum class KvTier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };

// One KV event (DESIGN.md section 4). `hashes` borrows the caller's storage
// (e.g. a protobuf repeated field) for the duration of the call.
struct KvEventView {
  KvEventKind kind = KvEventKind::kStored;
  uint64_t epoch = 0;
  uint64_t event_id = 0;              // 1, 2, 3, ... within an epoch
  uint64_t parent_hash = 0;           // stored only; not needed by a chained-hash index
  std::span<const uint64_t> hashes;   // stored/removed; empty for cleared
  KvTier tier = KvTier::kDevice;      // stored/removed: the tier entered / left
};

// A set of workers: bit i = worker i.
class WorkerMask {
 public:
  static constexpr uint32_t kWords = kMaxWorkers / 64;

  void Set(WorkerId w) { words_[w >> 6] |= Bit(w); }
  void Clear(WorkerId w) { words_[w >> 6] &= ~Bit(w); }
  bool Test(WorkerId w) const { return (words_[w >> 6] & Bit(w)) != 0; }
  bool Any() const {
    uint64_t acc = 0;
    for (uint64_t x : words_) acc |= x;
    return acc != 0;
  }
  uint32_t Count() const {
    uint32_t n = 0;
    for (uint64_t x : words_) n += static_cast<uint32_t>(std::popcount(x));
    return n;
  }
  WorkerMask& operator&=(const WorkerMask& o) {
    for (uint32_t i = 0; i < kWords; ++i) words_[i] &= o.words_[i];
    return *this;
  }
  // this & ~o
  WorkerMask AndNot(const WorkerMask& o) const {
    WorkerMask r;
    for (uint32_t i = 0; i < kWords; ++i) r.words_[i] = words_[i] & ~o.words_[i];
    return r;
  }
  // Calls f(WorkerId) for every set bit, lowest first.
  template <typename F>
  void ForEach(F&& f) const {
    for (uint32_t i = 0; i < kWords; ++i) {
      for (uint64_t x = words_[i]; x != 0; x &= x - 1) {
        f(static_cast<WorkerId>(i * 64 + static_cast<uint32_t>(std::countr_zero(x))));
      }
    }
  }
  friend bool operator==(const WorkerMask&, const WorkerMask&) = default;

 private:
  static uint64_t Bit(WorkerId w) { return uint64_t{1} << (w & 63); }
  uint64_t words_[kWords] = {};
};

}  // namespace tandem::router
