// Cost of a KV push between different layouts (issue 18,
// docs/parallelism.md): one request's prompt blocks moved by every prefill
// rank's RankSlicePusher (each rank its slice-plan runs, concurrently, as
// separate rank processes would) into every decode rank's pool, over real
// UCX on this host, vs the same layouts equal (one whole-block run per
// block) and vs memcpy of the same bytes in the same run.
//
// The bundled model's KV (5 layers, 2 kv heads, head_dim 32, 16-token
// blocks: 40 KiB per block, 2 KiB per head plane), 64 blocks (1024 tokens),
// scattered slots so nothing coalesces across blocks.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kvtransfer/slice_push.h"
#include "kvtransfer/transport.h"

namespace tandem::kvtransfer {
namespace {

using parallel::KvDims;
using parallel::ParallelLayout;
using parallel::RankKvShapeOf;

constexpr KvDims kKjv{.num_layers = 5, .num_kv_heads = 2, .head_dim = 32, .block_size = 16};
constexpr uint32_t kBlocks = 64;

std::unique_ptr<Transport> MakeRank(const std::string& name, uint64_t block_bytes) {
  TransportOptions o;
  o.backend = "ucx";
  o.agent_name = name;
  o.block_bytes = block_bytes;
  o.num_blocks = 2 * kBlocks;
  auto t = CreateTransport(o);
  return t.ok() ? std::move(t).value() : nullptr;
}

void Push(benchmark::State& state, ParallelLayout p, ParallelLayout d) {
  static int n = 0;
  const std::string tag = fmt::format("{}-{}", getpid(), n++);
  std::vector<std::unique_ptr<Transport>> prefill, decode;
  for (uint32_t r = 0; r < p.world(); ++r) {
    prefill.push_back(MakeRank(fmt::format("spb-p{}-{}", r, tag), RankKvShapeOf(p, kKjv, r).block_bytes()));
  }
  for (uint32_t r = 0; r < d.world(); ++r) {
    decode.push_back(MakeRank(fmt::format("spb-d{}-{}", r, tag), RankKvShapeOf(d, kKjv, r).block_bytes()));
  }
  for (auto* v : {&prefill, &decode}) {
    for (auto& t : *v) {
      if (!t) {
        state.SkipWithError("transport");
        return;
      }
      std::memset(t->pool(), 1, t->pool_bytes());
    }
  }
  SlicePushSpec spec;
  spec.request_id = "bench";
  spec.prefill = p;
  spec.decode = d;
  spec.dims = kKjv;
  for (auto& t : decode) spec.decode_descriptors.push_back(t->LocalDescriptor());
  for (uint32_t b = 0; b < kBlocks; ++b) {
    spec.block_ids.push_back(b);
    spec.slots.push_back((b * 37) % (2 * kBlocks));  // scattered
  }
  std::vector<std::unique_ptr<RankSlicePusher>> pushers;
  for (uint32_t r = 0; r < p.world(); ++r) pushers.push_back(std::make_unique<RankSlicePusher>(*prefill[r], r));
  uint64_t bytes = 0, writes = 0;
  for (auto _ : state) {
    std::vector<RankSlicePusher::Outcome> out(p.world());
    {
      std::vector<std::jthread> ranks;
      for (uint32_t r = 0; r < p.world(); ++r) {
        ranks.emplace_back([&, r] { out[r] = pushers[r]->PushAndWait(spec); });
      }
    }
    bytes = writes = 0;
    for (const auto& o : out) {
      if (!o.status.ok()) {
        state.SkipWithError(o.status.ToString().c_str());
        return;
      }
      bytes += o.bytes;
      writes += o.writes;
    }
  }
  uint64_t puts = 0;
  for (auto& t : prefill) puts += t->stats().puts_posted;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["writes"] = static_cast<double>(writes);
  state.counters["puts_per_push"] = static_cast<double>(puts) / static_cast<double>(state.iterations());
}

// memcpy of the same 64 blocks (2.5 MiB) between two buffers, one thread.
void Memcpy(benchmark::State& state) {
  const size_t bytes = uint64_t{kBlocks} * RankKvShapeOf({1, 1}, kKjv, 0).block_bytes();
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

BENCHMARK(Memcpy)->UseRealTime();
BENCHMARK_CAPTURE(Push, tp1_to_tp1_whole_blocks, ParallelLayout{1, 1}, ParallelLayout{1, 1})->UseRealTime();
BENCHMARK_CAPTURE(Push, tp2_to_tp2_whole_rank_blocks, ParallelLayout{2, 1}, ParallelLayout{2, 1})->UseRealTime();
BENCHMARK_CAPTURE(Push, tp2_to_tp1_head_planes, ParallelLayout{2, 1}, ParallelLayout{1, 1})->UseRealTime();
BENCHMARK_CAPTURE(Push, tp1_to_pp2_layer_ranges, ParallelLayout{1, 1}, ParallelLayout{1, 2})->UseRealTime();
BENCHMARK_CAPTURE(Push, tp4_to_tp2_replicated, ParallelLayout{4, 1}, ParallelLayout{2, 1})->UseRealTime();

}  // namespace
}  // namespace tandem::kvtransfer

BENCHMARK_MAIN();
