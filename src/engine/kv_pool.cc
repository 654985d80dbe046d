#include "engine/kv_pool.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
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

namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 (older headers lack it)
#endif

// One write per page of [begin, end), keeping each byte's value.
void TouchPages(std::byte* begin, std::byte* end, size_t page) {
  for (std::byte* p = begin; p < end; p += page) {
    volatile std::byte* v = p;
    *v = *v;
  }
}

}  // namespace

Status PrefaultMemory(std::span<std::byte> mem) {
  if (mem.empty()) return Status::Ok();
  const long sc = sysconf(_SC_PAGESIZE);
  const size_t page = sc > 0 ? static_cast<size_t>(sc) : 4096;
  std::byte* const begin = mem.data();
  std::byte* const end = begin + mem.size();
  // madvise wants a page-aligned start; the pages only partly in `mem` may
  // be shared with other memory, so they are touched by hand.
  auto* first = reinterpret_cast<std::byte*>(
      (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page);
  auto* last = reinterpret_cast<std::byte*>(reinterpret_cast<uintptr_t>(end) / page * page);
  if (first >= last) {
    TouchPages(begin, end, page);
    TouchPages(end - 1, end, page);
    return Status::Ok();
  }
  if (begin < first) TouchPages(begin, first, page);
  if (last < end) TouchPages(last, end, page);
  if (madvise(first, static_cast<size_t>(last - first), MADV_POPULATE_WRITE) == 0) {
    return Status::Ok();
  }
  const int err = errno;
  if (err == EINVAL) {  // a kernel before 5.14: touch every page instead
    TouchPages(first, last, page);
    return Status::Ok();
  }
  return ResourceExhaustedError(fmt::format(
      "KV pool: cannot make its {} bytes resident at start-up (cache.prefault): madvise: {}",
      mem.size(), std::strerror(err)));
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
