// A worker committing an 8k-token prompt into a full KV pool (issue 23,
// session 51): per iteration `Allocate` of the prompt's 500 blocks, which
// evicts the 500 least recently used cached blocks (their hashes erased
// from the prefix cache), `Commit` of the 500 new hashes and `Release`, as
// the sim fleet's decoder and prefiller do once per prompt into a pool of
// 26,674 blocks. `cold`: before each iteration (not timed) 32 MiB are
// written, as the engine's other work and the KV bytes' traffic leave the
// caches between two prompts ~260 ms apart; `hot`: back to back.
//
//   build/bench/engine/bench_block_churn
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "common/splitmix.h"
#include "engine/block_manager.h"

namespace tandem::engine {
namespace {

constexpr uint32_t kBlockSize = 16;

void BM_CommitPromptIntoFullPool(benchmark::State& state) {
  const uint32_t pool_blocks = static_cast<uint32_t>(state.range(0));
  const uint32_t prompt_blocks = static_cast<uint32_t>(state.range(1));
  const bool cold = state.range(2) != 0;
  BlockManager bm(pool_blocks, kBlockSize, nullptr);
  std::vector<uint32_t> tokens(size_t{prompt_blocks} * kBlockSize);
  std::vector<uint64_t> hashes(prompt_blocks);
  uint64_t s = 7;
  auto commit_one = [&] {
    for (uint32_t& t : tokens) t = static_cast<uint32_t>(SplitMix64Next(s) % 128000);
    for (uint64_t& h : hashes) h = SplitMix64Next(s);
    auto blocks = bm.Allocate(prompt_blocks);
    if (!blocks.ok()) return false;
    bm.Commit(*blocks, hashes, tokens, 0, prompt_blocks, /*root_hash=*/1);
    bm.Release(*blocks);
    return true;
  };
  // Fill the pool with cached, evictable blocks.
  for (uint32_t i = 0; i + prompt_blocks <= pool_blocks; i += prompt_blocks) commit_one();
  std::vector<char> thrash(size_t{32} << 20);
  for (auto _ : state) {
    state.PauseTiming();
    if (cold) std::memset(thrash.data(), static_cast<int>(state.iterations()), thrash.size());
    for (uint32_t& t : tokens) t = static_cast<uint32_t>(SplitMix64Next(s) % 128000);
    for (uint64_t& h : hashes) h = SplitMix64Next(s);
    state.ResumeTiming();
    auto blocks = bm.Allocate(prompt_blocks);
    if (!blocks.ok()) {
      state.SkipWithError("allocation failed");
      break;
    }
    bm.Commit(*blocks, hashes, tokens, 0, prompt_blocks, /*root_hash=*/1);
    bm.Release(*blocks);
  }
  state.SetItemsProcessed(state.iterations() * prompt_blocks);
  state.counters["evictions_per_iter"] =
      static_cast<double>(bm.evictions(KvTier::kDevice)) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_CommitPromptIntoFullPool)
    ->Args({26674, 500, 1})
    ->Args({26674, 500, 0})
    ->ArgNames({"pool", "prompt_blocks", "cold"})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tandem::engine

BENCHMARK_MAIN();
