// A table of values by stream handle: open addressing, read once per item
// of every batch of a multiplexed decode stream, at both ends (issue 23):
// the proxy's requests by handle (proxy/decode_mux_client.h; session 10,
// mux-deliver; docs/decode-stream.md "Reading a batch") and the decoder's
// open item per handle in the batch it assembles (decoder/decode_mux_batch.h;
// session 11, tok-chain).
//
// Why not std::unordered_map: its find walks the bucket array, the node
// before the entry and the entry, three dependent loads that are all
// cache-cold after a decode step (~6 ms), and every insert allocates a
// node; here one slot holds the key and the value. The proxy makes the
// handles (1, 2, 3, ... per stream), so the handle's low bits are its home
// slot: the live handles are a window of consecutive numbers and rarely
// collide. Linear probing; an erase shifts the entries behind it back (no
// tombstones); the table doubles past half full and never shrinks (it is
// as big as the stream's peak of requests).
//
// Thread-safety: none (the owner's lock guards it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tandem {

template <class V>
class HandleTable {
 public:
  // Handle 0 marks a free slot: it is never a key.
  V* Find(uint64_t handle) {
    const size_t i = IndexOf(handle);
    return i == kNone ? nullptr : &slots_[i].value;
  }
  // `handle` (not 0) must not be in the table.
  void Insert(uint64_t handle, V value) {
    if (2 * (size_ + 1) > slots_.size()) Grow();
    Place(handle, std::move(value));
    ++size_;
  }
  // Removes `handle`; its value, or a default V when it was not there.
  V Take(uint64_t handle) {
    const size_t i = IndexOf(handle);
    if (i == kNone) return V();
    V out = std::move(slots_[i].value);
    EraseAt(i);
    --size_;
    return out;
  }
  size_t size() const { return size_; }
  // Empties it, keeping its slots (a table refilled every batch allocates
  // nothing once grown).
  void Clear() {
    if (size_ == 0) return;
    for (Slot& s : slots_) {
      if (s.handle != 0) {
        s.handle = 0;
        s.value = V();
      }
    }
    size_ = 0;
  }
  // Calls f(handle, value&) for every entry, in no particular order.
  template <class F>
  void ForEach(F&& f) {
    for (Slot& s : slots_) {
      if (s.handle != 0) f(s.handle, s.value);
    }
  }
  void swap(HandleTable& other) noexcept {
    slots_.swap(other.slots_);
    std::swap(mask_, other.mask_);
    std::swap(size_, other.size_);
  }

 private:
  struct Slot {
    uint64_t handle = 0;
    V value{};
  };
  static constexpr size_t kInitialSlots = 64;
  static constexpr size_t kNone = ~size_t{0};

  size_t IndexOf(uint64_t handle) const {
    if (handle == 0) return kNone;
    for (size_t i = handle & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].handle == handle) return i;
      if (slots_[i].handle == 0) return kNone;
    }
  }

  void Place(uint64_t handle, V value) {
    size_t i = handle & mask_;
    while (slots_[i].handle != 0) i = (i + 1) & mask_;
    slots_[i].handle = handle;
    slots_[i].value = std::move(value);
  }
  void Grow() {
    std::vector<Slot> old(slots_.empty() ? kInitialSlots : 2 * slots_.size());
    old.swap(slots_);
    mask_ = slots_.size() - 1;
    for (Slot& s : old) {
      if (s.handle != 0) Place(s.handle, std::move(s.value));
    }
  }
  // Backward-shift deletion: every entry of the run after `hole` that may
  // sit there (its home is not in (hole, j]) moves into it.
  void EraseAt(size_t hole) {
    for (size_t j = (hole + 1) & mask_; slots_[j].handle != 0; j = (j + 1) & mask_) {
      const size_t home = slots_[j].handle & mask_;
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole].handle = slots_[j].handle;
        slots_[hole].value = std::move(slots_[j].value);
        hole = j;
      }
    }
    slots_[hole].handle = 0;
    slots_[hole].value = V();
  }

  std::vector<Slot> slots_ = std::vector<Slot>(kInitialSlots);  // [power of two]
  size_t mask_ = kInitialSlots - 1;
  size_t size_ = 0;
};

}  // namespace tandem
