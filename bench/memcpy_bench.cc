// memcpy bandwidth: the physical yardstick other benchmarks are compared
// with in the same run (bytes copied per second; a copy reads and writes).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

static void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(16 << 20)->Arg(256 << 20)->UseRealTime();

BENCHMARK_MAIN();
