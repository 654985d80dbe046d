#include "proxy/watch_batch.h"

#include <cstring>

#include "common/wire_ids.h"
#include "proxy/wire_scan.h"

namespace tandem::proxy {
namespace {

// WorkerUpdate, KvEvent, KvEvent.Stored/Removed field numbers (worker.proto).
constexpr uint64_t kUpdateEpoch = 5, kUpdateEvents = 240, kUpdateBatchedLoad = 241;
constexpr uint64_t kEventId = 1, kEventEpoch = 2, kEventStored = 3, kEventRemoved = 4,
                   kEventCleared = 5;
constexpr uint64_t kStoredParentHash = 1, kBlocksTier = 45, kBlocksFixed64 = 370;

// KvEvent.Stored (stored) or KvEvent.Removed into `v`; its hashes appended to `hashes`
// (whose capacity is never exceeded: the spans stay valid).
bool ParseBlocks(std::string_view b, bool stored, router::KvEventView& v,
                 std::vector<uint64_t>& hashes) {
  const uint8_t* p = wire::Begin(b);
  const uint8_t* const end = wire::End(b);
  wire::Field f;
  bool have_hashes = false;
  while (p < end) {
    if (!wire::NextField(p, end, &f)) return false;
    if (stored && f.number == kStoredParentHash && f.type == 0) {
      v.parent_hash = f.value;
    } else if (f.number == kBlocksTier && f.type == 0) {
      v.tier = static_cast<router::KvTier>(static_cast<int32_t>(f.value));  // an open enum
    } else if (f.number == kBlocksFixed64 && f.type == 2 && !have_hashes &&
               f.bytes.size() % 8 == 0) {
      const size_t n = f.bytes.size() / 8;
      if (hashes.size() + n > hashes.capacity()) return false;  // cannot happen: sized by the payload
      const size_t at = hashes.size();
      hashes.resize(at + n);
      std::memcpy(hashes.data() + at, f.bytes.data(), f.bytes.size());
      v.hashes = std::span<const uint64_t>(hashes.data() + at, n);
      have_hashes = true;
    } else {
      return false;  // varint hashes (field 1 or 2), a second run, anything else
    }
  }
  return true;
}

bool ParseEvent(std::string_view b, router::KvEventView& v, std::vector<uint64_t>& hashes) {
  const uint8_t* p = wire::Begin(b);
  const uint8_t* const end = wire::End(b);
  wire::Field f;
  int kinds = 0;
  while (p < end) {
    if (!wire::NextField(p, end, &f)) return false;
    if (f.number == kEventId && f.type == 0) {
      v.event_id = f.value;
    } else if (f.number == kEventEpoch && f.type == 0) {
      v.epoch = f.value;
    } else if ((f.number == kEventStored || f.number == kEventRemoved) && f.type == 2) {
      const bool stored = f.number == kEventStored;
      v.kind = stored ? router::KvEventKind::kStored : router::KvEventKind::kRemoved;
      if (++kinds > 1 || !ParseBlocks(f.bytes, stored, v, hashes)) return false;
    } else if (f.number == kEventCleared && f.type == 2 && f.bytes.empty()) {
      v.kind = router::KvEventKind::kCleared;
      if (++kinds > 1) return false;
    } else {
      return false;
    }
  }
  return kinds == 1;
}

}  // namespace

bool ParseWatchBatch(std::string_view payload, WatchBatch& out) {
  out.epoch = 0;
  out.events.clear();
  out.has_load = false;
  out.hashes.clear();
  // No event's hashes can take more bytes than the frame: the spans into
  // `hashes` never move.
  out.hashes.reserve(payload.size() / 8);
  const uint8_t* p = wire::Begin(payload);
  const uint8_t* const end = wire::End(payload);
  wire::Field f;
  while (p < end) {
    if (!wire::NextField(p, end, &f)) return false;
    if (f.number == kUpdateEpoch && f.type == 0) {
      out.epoch = f.value;
    } else if (f.number == kUpdateEvents && f.type == 2) {
      if (!ParseEvent(f.bytes, out.events.emplace_back(), out.hashes)) return false;
    } else if (f.number == kUpdateBatchedLoad && f.type == 2 && !out.has_load) {
      if (!out.load.ParseFromArray(f.bytes.data(), static_cast<int>(f.bytes.size()))) return false;
      out.has_load = true;
    } else {
      return false;
    }
  }
  return true;
}

router::KvEventView KvEventViewFromProto(const tandem::v1::KvEvent& e) {
  router::KvEventView v;
  v.epoch = e.epoch();
  v.event_id = e.event_id();
  // The view reads the message's hashes in place (no copy per event).
  if (e.has_stored()) {
    v.kind = router::KvEventKind::kStored;
    v.parent_hash = e.stored().parent_hash();
    v.tier = static_cast<router::KvTier>(e.stored().tier());
    v.hashes = BlockHashesOf(e.stored());
  } else if (e.has_removed()) {
    v.kind = router::KvEventKind::kRemoved;
    v.tier = static_cast<router::KvTier>(e.removed().tier());
    v.hashes = BlockHashesOf(e.removed());
  } else {
    v.kind = router::KvEventKind::kCleared;
  }
  return v;
}

}  // namespace tandem::proxy
