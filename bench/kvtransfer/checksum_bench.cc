// Cost of the end-to-end KV checksums (transport.checksum,
// docs/failure-handling.md): XXH3-64 over KV blocks as the prefiller and the
// decoder compute them, next to memcpy of the same blocks in the same run
// (the physical yardstick: a push moves every byte at least once). The
// working set (256 MiB) is far beyond the caches, as a KV pool is.
// BM_KvChecksumBlocks is what the workers call (common/kv_checksum.h: the
// library's x86 dispatcher where it has one); BM_Xxh3Blocks the library's
// compiled-in XXH3_64bits, which the workers called before session 51.
#include <benchmark/benchmark.h>
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/kv_checksum.h"

namespace {

constexpr size_t kPoolBytes = size_t{256} << 20;

std::vector<char>& Pool() {
  static std::vector<char> pool = [] {
    std::vector<char> p(kPoolBytes);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < p.size(); i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(p.data() + i, &x, 8);
    }
    return p;
  }();
  return pool;
}

// One pass over the pool, block by block (arg: block bytes).
void BM_Xxh3Blocks(benchmark::State& state) {
  const size_t block = static_cast<size_t>(state.range(0));
  const std::vector<char>& pool = Pool();
  uint64_t acc = 0;
  for (auto _ : state) {
    for (size_t off = 0; off + block <= pool.size(); off += block) acc ^= XXH3_64bits(pool.data() + off, block);
    benchmark::DoNotOptimize(acc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(pool.size() / block * block));
}

void BM_KvChecksumBlocks(benchmark::State& state) {
  const size_t block = static_cast<size_t>(state.range(0));
  const std::vector<char>& pool = Pool();
  uint64_t acc = 0;
  for (auto _ : state) {
    for (size_t off = 0; off + block <= pool.size(); off += block)
      acc ^= tandem::KvChecksum(pool.data() + off, block);
    benchmark::DoNotOptimize(acc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(pool.size() / block * block));
  state.SetLabel(tandem::KvChecksumImplementation());
}

void BM_MemcpyBlocks(benchmark::State& state) {
  const size_t block = static_cast<size_t>(state.range(0));
  const std::vector<char>& pool = Pool();
  static std::vector<char> dst(kPoolBytes, 1);  // touched before timing
  for (auto _ : state) {
    for (size_t off = 0; off + block <= pool.size(); off += block) std::memcpy(dst.data() + off, pool.data() + off, block);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(pool.size() / block * block));
}

// Block sizes: 8 KiB (the sim fleet's Llama-3-8B blocks at kv_scale 256), 16
// and 64 KiB (small models), 2 MiB (Llama-3-8B: 16 tokens x 32 layers x K,V x
// 8 kv heads x 128 x bf16).
BENCHMARK(BM_Xxh3Blocks)->Arg(8 << 10)->Arg(16 << 10)->Arg(64 << 10)->Arg(2 << 20)->MinTime(0.5);
BENCHMARK(BM_KvChecksumBlocks)
    ->Arg(8 << 10)
    ->Arg(16 << 10)
    ->Arg(64 << 10)
    ->Arg(2 << 20)
    ->MinTime(0.5);
BENCHMARK(BM_MemcpyBlocks)->Arg(8 << 10)->Arg(16 << 10)->Arg(64 << 10)->Arg(2 << 20)->MinTime(0.5);

}  // namespace

BENCHMARK_MAIN();
