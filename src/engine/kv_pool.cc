#include "engine/kv_pool.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace tandem::engine {

AlignedKvPoolAllocator::~AlignedKvPoolAllocator() { std::free(data_); }

Result<std::span<std::byte>> AlignedKvPoolAllocator::Allocate(size_t bytes) {
  if (data_ != nullptr) return FailedPreconditionError("AlignedKvPoolAllocator: allocated twice");
  const size_t rounded = (bytes + 63) / 64 * 64;
  data_ = static_cast<std::byte*>(std::aligned_alloc(64, rounded == 0 ? 64 : rounded));
  if (data_ == nullptr) {
    return ResourceExhaustedError(fmt::format("KV pool: cannot allocate {} bytes", bytes));
  }
  std::memset(data_, 0, rounded);
  return std::span<std::byte>(data_, bytes);
}

Result<std::unique_ptr<KvPool>> KvPool::Create(const KvLayout& layout, uint32_t num_blocks,
                                               KvPoolAllocator& allocator) {
  if (layout.num_layers == 0 || layout.num_kv_heads == 0 || layout.head_dim == 0 ||
      layout.block_size == 0 || num_blocks == 0) {
    return InvalidArgumentError(fmt::format(
        "KV pool: layers {}, kv heads {}, head_dim {}, block_size {}, num_blocks {} must all be > 0",
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, num_blocks));
  }
  const size_t bytes = static_cast<size_t>(num_blocks) * layout.block_bytes();
  TANDEM_ASSIGN_OR_RETURN(std::span<std::byte> mem, allocator.Allocate(bytes));
  if (mem.size() < bytes) {
    return InternalError(fmt::format("KV pool: allocator returned {} bytes, asked {}", mem.size(), bytes));
  }
  if (reinterpret_cast<uintptr_t>(mem.data()) % 64 != 0) {
    return InternalError("KV pool: allocator returned memory not 64-byte aligned");
  }
  return std::unique_ptr<KvPool>(new KvPool(layout, num_blocks, reinterpret_cast<float*>(mem.data())));
}

}  // namespace tandem::engine
