// The prefix cache's hash -> block table under an engine's churn (session
// 29): a pool of `blocks` blocks, every one registered, and per new block a
// lookup of its hash (a prompt's prefix lookup: a miss), the eviction of
// the oldest block's hash and the new hash's registration, as a worker
// committing an 8k-token prompt's 500 blocks into a full pool does 500
// times.
//
//   build/bench/engine/bench_prefix_cache
#include <benchmark/benchmark.h>

#include <vector>

#include "common/splitmix.h"
#include "engine/prefix_cache.h"

namespace tandem::engine {
namespace {

void BM_PrefixCacheChurn(benchmark::State& state) {
  const uint32_t blocks = static_cast<uint32_t>(state.range(0));
  PrefixCache cache(blocks);
  std::vector<uint64_t> hash_of(blocks);  // [block]
  uint64_t s = 1;
  for (uint32_t b = 0; b < blocks; ++b) {
    hash_of[b] = SplitMix64Next(s);
    cache.Insert(hash_of[b], b);
  }
  uint32_t oldest = 0;
  for (auto _ : state) {
    const uint64_t h = SplitMix64Next(s);
    benchmark::DoNotOptimize(cache.Lookup(h));
    cache.Erase(hash_of[oldest]);
    cache.Insert(h, oldest);
    hash_of[oldest] = h;
    oldest = oldest + 1 == blocks ? 0 : oldest + 1;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PrefixCacheChurn)->Arg(16384)->Arg(262144)->ArgName("blocks");

}  // namespace
}  // namespace tandem::engine

BENCHMARK_MAIN();
