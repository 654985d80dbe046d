// tandem's batch-invariant GEMM vs OpenBLAS sgemm at model shapes.
//
// y[m][n] = x[m][k] * w[n][k]^T (HF Linear layout). Arguments: shape index
// (see kShapes), m, threads. OpenBLAS gets the same thread count through
// openblas_set_num_threads (run with OPENBLAS_NUM_THREADS=1 so that its pool
// starts no spinning threads beyond what is asked). Counters: FLOP/s and
// weight bytes/s (for m = 1, compare with bench_memcpy's bandwidth).
// bench/kernels/gemm_ratio.py turns the JSON output into the ratio table.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cpu/ops.h"

namespace {

using tandem::kernels::cpu::Gemm;
using tandem::kernels::cpu::PackedWeights;
using tandem::kernels::cpu::PackWeights;
using tandem::kernels::cpu::ThreadPool;

struct Shape {
  const char* name;
  int n, k;
};
// Bundled model (hidden 256, intermediate 688, vocab 4096) and a ~100M model
// (hidden 768, intermediate 2048, vocab 32000).
const Shape kShapes[] = {
    {"small.attn_256x256", 256, 256},   {"small.up_688x256", 688, 256},
    {"small.down_256x688", 256, 688},   {"small.lm_head_4096x256", 4096, 256},
    {"100m.attn_768x768", 768, 768},    {"100m.up_2048x768", 2048, 768},
    {"100m.down_768x2048", 768, 2048},  {"100m.lm_head_32000x768", 32000, 768},
};

std::vector<float> Random(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void SetCounters(benchmark::State& state, const Shape& s, int m) {
  const double flops = 2.0 * m * s.n * s.k;
  state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_Bps"] = benchmark::Counter(
      4.0 * s.n * s.k, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(s.name);
}

void BM_TandemGemm(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  const int m = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  const auto x = Random(static_cast<size_t>(m) * s.k, 1);
  const auto w = Random(static_cast<size_t>(s.n) * s.k, 2);
  const PackedWeights packed = PackWeights(w.data(), s.n, s.k);
  std::vector<float> y(static_cast<size_t>(m) * s.n);
  std::unique_ptr<ThreadPool> pool = threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr;
  for (auto _ : state) {
    Gemm(x.data(), packed, nullptr, y.data(), m, pool.get());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, s, m);
}

void BM_OpenBlasSgemm(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  const int m = static_cast<int>(state.range(1));
  openblas_set_num_threads(static_cast<int>(state.range(2)));
  const auto x = Random(static_cast<size_t>(m) * s.k, 1);
  const auto w = Random(static_cast<size_t>(s.n) * s.k, 2);
  std::vector<float> y(static_cast<size_t>(m) * s.n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, s.n, s.k, 1.0f, x.data(), s.k,
                w.data(), s.k, 0.0f, y.data(), s.n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  SetCounters(state, s, m);
}

void GemmArgs(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "m", "threads"});
  for (int threads : {1, 2}) {
    for (int shape = 0; shape < static_cast<int>(std::size(kShapes)); ++shape) {
      for (int m : {1, 8, 32, 256}) b->Args({shape, m, threads});
    }
  }
  b->UseRealTime();
  // With --benchmark_repetitions: the fastest repetition, the number least
  // disturbed by other load on a shared machine.
  b->ComputeStatistics("min", [](const std::vector<double>& v) {
    return *std::min_element(v.begin(), v.end());
  });
}
BENCHMARK(BM_TandemGemm)->Apply(GemmArgs);
BENCHMARK(BM_OpenBlasSgemm)->Apply(GemmArgs);

// The machine's single-core f32 FMA peak (AVX-512: 24 independent chains),
// the yardstick for the FLOPS counters above.
__attribute__((target("avx512f"))) void PeakLoop(int64_t iters, float* out) {
  __m512 acc[24];
#pragma GCC unroll 24
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  _mm512_storeu_ps(out, s);
}
void BM_PeakFmaAvx512(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512");
    return;
  }
  alignas(64) float out[16];
  const int64_t iters = 1 << 20;
  for (auto _ : state) {
    PeakLoop(iters, out);
    benchmark::DoNotOptimize(out);
  }
  state.counters["FLOPS"] = benchmark::Counter(2.0 * 16 * 24 * iters,
                                               benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_PeakFmaAvx512)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
