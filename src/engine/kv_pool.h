// The paged KV pool of DESIGN.md section 4: `num_blocks` blocks of
// `block_size` tokens, each one contiguous byte range holding that block's K
// and V for every layer, in the fixed (wire) order
//   [layer][K,V][kv_head][token][head_dim]  (f32).
// The memory comes from a caller-provided KvPoolAllocator: the transport's
// (UCX ucp_mem_map) in prefillers and decoders, plain aligned memory in
// `tandem generate` and tests.
//
// Thread-safety: KvLayout is a value. KvPool's geometry is immutable; the
// bytes of a block are written only by whoever holds the block (the engine
// thread, or a transport writing into a reserved block).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/status.h"

namespace tandem::engine {

// Supplies the pool's memory. The memory must stay valid (and is owned by
// the allocator) until the allocator is destroyed; Allocate is called once
// per pool, from the thread that creates the engine.
class KvPoolAllocator {
 public:
  virtual ~KvPoolAllocator() = default;
  // At least 64-byte aligned, `bytes` long.
  virtual Result<std::span<std::byte>> Allocate(size_t bytes) = 0;
};

// Plain 64-byte aligned heap memory (zeroed), freed with the allocator.
class AlignedKvPoolAllocator final : public KvPoolAllocator {
 public:
  AlignedKvPoolAllocator() = default;
  ~AlignedKvPoolAllocator() override;
  AlignedKvPoolAllocator(const AlignedKvPoolAllocator&) = delete;
  AlignedKvPoolAllocator& operator=(const AlignedKvPoolAllocator&) = delete;
  Result<std::span<std::byte>> Allocate(size_t bytes) override;

 private:
  std::byte* data_ = nullptr;
};

// Makes every page of `mem` resident and writable now (issue 23): a
// serving engine's KV pool is touched once at start-up, like vLLM's, instead
// of one page fault (a shmem fault for UCX's pool) per new block on the
// decode step's critical path. MADV_POPULATE_WRITE (Linux >= 5.14) where the
// kernel has it, else one write per page (the bytes keep their value). Call
// it before anything else writes the memory. Errors name the range.
Status PrefaultMemory(std::span<std::byte> mem);

// Geometry of one block; all offsets/strides in floats unless named _bytes.
struct KvLayout {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_size = 16;  // tokens per block

  // One K (or V) plane of one layer: [kv_head][token][head_dim].
  size_t plane_floats() const {
    return static_cast<size_t>(num_kv_heads) * block_size * head_dim;
  }
  size_t block_floats() const { return static_cast<size_t>(num_layers) * 2 * plane_floats(); }
  size_t block_bytes() const { return block_floats() * sizeof(float); }
  // Offset of layer `layer`'s K plane (kv = 0) or V plane (kv = 1) in a block.
  size_t plane_offset(uint32_t layer, uint32_t kv) const {
    return (static_cast<size_t>(layer) * 2 + kv) * plane_floats();
  }
  // Per-token KV bytes over all layers (K and V).
  size_t bytes_per_token() const { return block_bytes() / block_size; }
};

class KvPool {
 public:
  // Allocates num_blocks * layout.block_bytes() from `allocator` (borrowed;
  // it must outlive the pool).
  static Result<std::unique_ptr<KvPool>> Create(const KvLayout& layout, uint32_t num_blocks,
                                                KvPoolAllocator& allocator);

  const KvLayout& layout() const { return layout_; }
  uint32_t num_blocks() const { return num_blocks_; }
  float* base() const { return base_; }  // [num_blocks][block_floats]
  size_t size_bytes() const { return static_cast<size_t>(num_blocks_) * layout_.block_bytes(); }
  float* block(uint32_t id) const { return base_ + static_cast<size_t>(id) * layout_.block_floats(); }
  std::span<std::byte> block_bytes(uint32_t id) const {
    return {reinterpret_cast<std::byte*>(block(id)), layout_.block_bytes()};
  }

 private:
  KvPool(const KvLayout& layout, uint32_t num_blocks, float* base)
      : layout_(layout), num_blocks_(num_blocks), base_(base) {}
  KvLayout layout_;
  uint32_t num_blocks_;
  float* base_;
};

}  // namespace tandem::engine
