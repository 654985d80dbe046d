// GPU kernel benchmarks with their yardsticks measured in the same run:
// - BM_CudaCopy: device-to-device cudaMemcpyAsync of 1 GiB; bytes/s counts
//   what is read plus what is written (the memory traffic).
// - BM_CudaGemmBf16: cuBLASLt bf16 GEMM, f32 accumulation, square 8192.
// - BM_DecodeAttention: Llama-3-8B attention shapes (32 heads, 8 kv heads,
//   head_dim 128, blocks of 16); bytes/s counts the K and V bytes read.
// - BM_PrefillAttention: one fresh causal prompt of L tokens; flops
//   = 4 * head_dim * heads * L (L + 1) / 2 (QK^T and PV over the causal half).
// Times come from CUDA events around each iteration (manual time). Without
// a device every benchmark reports "no CUDA device" and measures nothing.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/reference/kv_cache_view.h"

namespace {

using tandem::kernels::cuda::bf16;
namespace kc = tandem::kernels::cuda;

bool HaveDevice(benchmark::State& state) {
  char why[256] = "";
  if (kc::DeviceCount(why, sizeof(why)) == 0) {
    state.SkipWithError((std::string("no CUDA device: ") + why).c_str());
    return false;
  }
  return true;
}

// Device allocation freed at scope exit; filled with small bf16 values.
struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
    else cudaMemset(p, 0x3c, bytes);  // bf16 0x3c3c ~ 0.0115: finite, small
  }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// Times fn() on the default stream with events, one sample per iteration.
template <typename Fn>
void TimeLoop(benchmark::State& state, Fn fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  fn();  // warm-up (and shared-memory opt-in, algorithm choice)
  if (cudaDeviceSynchronize() != cudaSuccess) {
    state.SkipWithError("kernel failed in warm-up");
    return;
  }
  for (auto _ : state) {
    cudaEventRecord(start);
    fn();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
  }
  if (cudaGetLastError() != cudaSuccess) state.SkipWithError("a kernel failed");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

void BM_CudaCopy(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const size_t bytes = size_t{1} << 30;
  DevMem a(bytes), b(bytes);
  TimeLoop(state, [&] { cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice); });
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * bytes);
}
BENCHMARK(BM_CudaCopy)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);

void BM_CudaGemmBf16(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const int n = static_cast<int>(state.range(0));
  DevMem x(size_t{2} * n * n), w(size_t{2} * n * n), y(size_t{2} * n * n), ws(32u << 20);
  std::unique_ptr<kc::GemmContext> ctx;
  if (!kc::GemmContext::Create(ws.p, 32u << 20, false, &ctx).ok()) {
    state.SkipWithError("cuBLASLt context");
    return;
  }
  TimeLoop(state, [&] {
    (void)ctx->Gemm(x.as<bf16>(), w.as<bf16>(), nullptr, y.p, kc::GemmOutType::kBf16, n, n, n, nullptr);
  });
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * n * n * n * state.iterations() / 1e12,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CudaGemmBf16)->Arg(8192)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);

constexpr int kHeads = 32, kKvHeads = 8, kHd = 128, kBs = 16;

// A one-layer cache of `blocks` blocks with shuffled tables, one per sequence.
struct Paged {
  size_t block_elems = tandem::kernels::KvBlockFloats(1, kKvHeads, kHd, kBs);
  std::unique_ptr<DevMem> pool, tables;
  int max_blocks = 0;
  Paged(int seqs, int ctx) {
    max_blocks = (ctx + kBs - 1) / kBs;
    const int blocks = seqs * max_blocks;
    pool = std::make_unique<DevMem>(block_elems * blocks * sizeof(bf16));
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
    tables = std::make_unique<DevMem>(ids.size() * sizeof(int32_t));
    cudaMemcpy(tables->p, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
  }
  kc::DeviceKvView View() const { return {pool->as<bf16>(), block_elems, 1, kKvHeads, kHd, kBs}; }
};

void BM_DecodeAttention(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const int batch = static_cast<int>(state.range(0));
  const int ctx = static_cast<int>(state.range(1));
  Paged cache(batch, ctx);
  DevMem q(size_t{2} * batch * kHeads * kHd), out(size_t{2} * batch * kHeads * kHd);
  std::vector<int32_t> lens(batch, ctx);
  DevMem dlens(batch * sizeof(int32_t));
  cudaMemcpy(dlens.p, lens.data(), batch * sizeof(int32_t), cudaMemcpyHostToDevice);
  const size_t ws_bytes = kc::DecodeAttentionWorkspaceBytes(batch, kHeads, kHd, ctx);
  DevMem ws(ws_bytes > 0 ? ws_bytes : 16);
  bool ok = true;
  TimeLoop(state, [&] {
    ok = ok && kc::PagedDecodeAttention(cache.View(), 0, q.as<bf16>(), out.as<bf16>(),
                                        cache.tables->as<int32_t>(), dlens.as<int32_t>(), batch,
                                        kHeads, kHeads * kHd, cache.max_blocks, ctx, 0.088f, ws.p,
                                        ws_bytes, nullptr)
                     .ok();
  });
  if (!ok) state.SkipWithError("PagedDecodeAttention refused the shape");
  const double kv_bytes = 2.0 * batch * ctx * kKvHeads * kHd * sizeof(bf16);
  state.SetBytesProcessed(static_cast<int64_t>(kv_bytes * state.iterations()));
}
BENCHMARK(BM_DecodeAttention)
    ->ArgsProduct({{1, 16, 64}, {1024, 8192}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2);

void BM_PrefillAttention(benchmark::State& state) {
  if (!HaveDevice(state)) return;
  const int len = static_cast<int>(state.range(0));
  Paged cache(1, len);
  DevMem q(size_t{2} * len * kHeads * kHd), out(size_t{2} * len * kHeads * kHd);
  const int32_t host[3] = {0, 0, len};  // q_starts[0], cu_q_lens[0..1]
  DevMem meta(sizeof(host));
  cudaMemcpy(meta.p, host, sizeof(host), cudaMemcpyHostToDevice);
  bool ok = true;
  TimeLoop(state, [&] {
    ok = ok && kc::PagedPrefillAttention(cache.View(), 0, q.as<bf16>(), out.as<bf16>(),
                                         cache.tables->as<int32_t>(), meta.as<int32_t>(),
                                         meta.as<int32_t>() + 1, 1, kHeads, kHeads * kHd,
                                         cache.max_blocks, len, 0.088f, nullptr)
                     .ok();
  });
  if (!ok) state.SkipWithError("PagedPrefillAttention refused the shape");
  const double flops = 4.0 * kHd * kHeads * (static_cast<double>(len) * (len + 1) / 2.0);
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops * state.iterations() / 1e12, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PrefillAttention)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(8192)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);

}  // namespace

BENCHMARK_MAIN();
