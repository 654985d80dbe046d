// CPU kernels other than GEMM at the bundled model's shapes (hidden 256,
// 8 heads, 2 kv heads, head_dim 32, intermediate 688, vocab 4096) and a
// 100M model's attention (12 heads, 4 kv heads, head_dim 64).
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"

namespace {

using namespace tandem::kernels;

std::vector<float> Random(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Args: head_dim, heads, kv_heads, context, t (query rows: t == context is a
// full prefill, 1 a decode step at position context - 1), threads.
void BM_PagedAttention(benchmark::State& state) {
  const int hd = static_cast<int>(state.range(0)), heads = static_cast<int>(state.range(1));
  const int kvh = static_cast<int>(state.range(2)), ctx = static_cast<int>(state.range(3));
  const int t = static_cast<int>(state.range(4)), threads = static_cast<int>(state.range(5));
  const int bs = 16, blocks = (ctx + bs - 1) / bs;
  std::vector<float> pool = Random(static_cast<size_t>(blocks) * KvBlockFloats(1, kvh, hd, bs), 1);
  const KvCacheView view{pool.data(), KvBlockFloats(1, kvh, hd, bs), 1, kvh, hd, bs};
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int b = 0; b < blocks; ++b) table[static_cast<size_t>(b)] = blocks - 1 - b;
  const auto q = Random(static_cast<size_t>(t) * heads * hd, 2);
  std::vector<float> out(q.size());
  std::unique_ptr<cpu::ThreadPool> p = threads > 1 ? std::make_unique<cpu::ThreadPool>(threads) : nullptr;
  for (auto _ : state) {
    cpu::PagedAttention(view, 0, q.data(), out.data(), table.data(), ctx - t, t, heads,
                        0.125f, p.get());
    benchmark::DoNotOptimize(out.data());
  }
  // Scores computed (query rows x keys x heads).
  double scores = 0;
  for (int r = 0; r < t; ++r) scores += static_cast<double>(ctx - t + r + 1) * heads;
  state.counters["scores"] = benchmark::Counter(scores, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["KV_Bps"] = benchmark::Counter(
      t == 1 ? 2.0 * ctx * kvh * hd * 4 : 0.0, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PagedAttention)
    ->ArgNames({"hd", "heads", "kvh", "ctx", "t", "threads"})
    ->Args({32, 8, 2, 512, 512, 1})
    ->Args({32, 8, 2, 1024, 1, 1})
    ->Args({64, 12, 4, 512, 512, 1})
    ->Args({64, 12, 4, 1024, 1, 1})
    ->Args({32, 8, 2, 512, 512, 2})
    ->Args({64, 12, 4, 512, 512, 2})
    ->UseRealTime();

void BM_RmsNorm(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const auto x = Random(static_cast<size_t>(m) * d, 3), w = Random(d, 4);
  std::vector<float> out(x.size());
  for (auto _ : state) {
    cpu::RmsNorm(x.data(), w.data(), 1e-5f, out.data(), m, d);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(x.size()) * 8);
}
BENCHMARK(BM_RmsNorm)->Args({1, 256})->Args({256, 256})->Args({256, 768})->UseRealTime();

void BM_SiluMul(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  const auto g = Random(static_cast<size_t>(m) * n, 5), u = Random(g.size(), 6);
  std::vector<float> out(g.size());
  for (auto _ : state) {
    cpu::SiluMul(g.data(), u.data(), out.data(), m, n);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(g.size()));
}
BENCHMARK(BM_SiluMul)->Args({1, 688})->Args({256, 688})->Args({256, 2048})->UseRealTime();

void BM_LogSoftmax(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  const auto x = Random(static_cast<size_t>(m) * n, 7);
  std::vector<float> out(x.size());
  for (auto _ : state) {
    cpu::LogSoftmax(x.data(), out.data(), m, n);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(x.size()));
}
BENCHMARK(BM_LogSoftmax)->Args({1, 4096})->Args({8, 32000})->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
