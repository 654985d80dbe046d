// Pipeline parallel on CPU ranks (issue 18, docs/parallelism.md "Pipeline
// parallel"): decode steps of a batch of sequences on the bundled model,
//   - one process (the cpu backend, 1 thread): the yardstick,
//   - pp = 2 with micro-batches in flight (2 per step, the default),
//   - pp = 2 with one micro-batch per step (no overlap),
// rank 0 in this process, rank 1 a `tandem rank` process. The bubble model
// bounds what the overlap can give: a step of m micro-batches over pp stages
// takes (m + pp - 1) / (m * pp) of the one-process step when every stage has
// a core of its own, so 3/4 for m = pp = 2 (1.33x) and 1 for m = 1.
//
//   build/bench/bench_pipeline [--benchmark_min_time=1] [--benchmark_repetitions=3]
//
// tokens/s = sequences * steps / second (one token per sequence per step).
#include <benchmark/benchmark.h>

#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "engine/llama_forward.h"
#include "engine/parallel_backend.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/rank_processes.h"

namespace {

using namespace tandem;

constexpr uint32_t kBlockSize = 16;
constexpr uint32_t kPrompt = 64;      // tokens prefilled per sequence before decoding
constexpr uint32_t kMaxSteps = 384;   // decode positions available per sequence
const std::string kModel = std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv";

struct Setup {
  model::ModelConfig config;
  model::ModelWeights weights;
};

// One backend with its pool and (for pp > 1) its follower process.
struct Runner {
  engine::AlignedKvPoolAllocator alloc;
  std::unique_ptr<engine::KvPool> pool;
  std::unique_ptr<parallel::RankProcesses> ranks;
  std::unique_ptr<engine::ComputeBackend> backend;
  std::vector<std::vector<uint32_t>> tables;
  std::vector<uint32_t> pos;
};

std::unique_ptr<Runner> MakeRunner(const Setup& s, uint32_t seqs, uint32_t pp, uint32_t mbs) {
  auto r = std::make_unique<Runner>();
  const uint32_t per_seq = (kPrompt + kMaxSteps + kBlockSize - 1) / kBlockSize;
  const uint32_t blocks = seqs * per_seq;
  const parallel::ParallelLayout layout{1, pp};
  auto pool = engine::KvPool::Create(
      engine::ShardKvLayout(s.config, engine::ShardSpec{layout, 0}, kBlockSize), blocks, r->alloc);
  if (!pool.ok()) return nullptr;
  r->pool = std::move(*pool);
  if (pp == 1) {
    auto b = engine::CreateBackend("cpu", s.config, s.weights, r->pool.get(), 1);
    if (!b.ok()) return nullptr;
    r->backend = std::move(*b);
  } else {
    const std::string group = fmt::format("tandem-benchpp-{}-{}", getpid(), mbs);
    auto ranks = parallel::RankProcesses::Start(layout.world(), [&](uint32_t rank) {
      return std::vector<std::string>{std::string(TANDEM_BINARY_DIR) + "/tandem",
                                      "rank",
                                      "--model",
                                      kModel,
                                      "--pipeline-parallel",
                                      std::to_string(pp),
                                      "--rank",
                                      std::to_string(rank),
                                      "--group",
                                      group,
                                      "--num-blocks",
                                      std::to_string(blocks)};
    });
    if (!ranks.ok()) return nullptr;
    r->ranks = std::move(*ranks);
    engine::ParallelBackendOptions o;
    o.layout = layout;
    o.group = group;
    o.max_micro_batches = mbs;
    auto b = engine::CreateParallelBackend(s.config, s.weights, r->pool.get(), o);
    if (!b.ok()) {
      std::fprintf(stderr, "%s\n", b.status().ToString().c_str());
      return nullptr;
    }
    r->backend = std::move(*b);
  }
  // Prefill every sequence (untimed).
  std::vector<std::vector<uint32_t>> prompts(seqs);
  std::vector<engine::SeqChunk> batch;
  for (uint32_t i = 0; i < seqs; ++i) {
    std::vector<uint32_t> table;
    for (uint32_t b = 0; b < per_seq; ++b) table.push_back(i * per_seq + b);
    r->tables.push_back(std::move(table));
    for (uint32_t t = 0; t < kPrompt; ++t) prompts[i].push_back(3 + (i * 131 + t * 17) % 4000);
  }
  for (uint32_t i = 0; i < seqs; ++i) batch.push_back({prompts[i], 0, r->tables[i], 1});
  std::vector<float> logits(size_t{seqs} * s.config.vocab_size);
  if (!r->backend->Forward(batch, logits).ok()) return nullptr;
  r->pos.assign(seqs, kPrompt);
  return r;
}

void DecodeSteps(benchmark::State& state, const Setup& s, uint32_t pp, uint32_t mbs) {
  const auto seqs = static_cast<uint32_t>(state.range(0));
  auto r = MakeRunner(s, seqs, pp, mbs);
  if (r == nullptr) {
    state.SkipWithError("setup failed");
    return;
  }
  std::vector<uint32_t> tokens(seqs, 42);
  std::vector<engine::SeqChunk> batch(seqs);
  std::vector<float> logits(size_t{seqs} * s.config.vocab_size);
  uint64_t steps = 0;
  for (auto _ : state) {
    if (r->pos[0] >= kPrompt + kMaxSteps) {
      state.PauseTiming();
      r->pos.assign(seqs, kPrompt);  // rewrite the same positions again
      state.ResumeTiming();
    }
    for (uint32_t i = 0; i < seqs; ++i) {
      batch[i] = {std::span<const uint32_t>(&tokens[i], 1), r->pos[i]++, r->tables[i], 1};
    }
    if (!r->backend->Forward(batch, logits).ok()) {
      state.SkipWithError("forward failed");
      return;
    }
    ++steps;
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(steps) * seqs, benchmark::Counter::kIsRate);
  r->backend.reset();  // the shutdown plan
  if (r->ranks) (void)r->ranks->WaitAll(10000);
}

}  // namespace

int main(int argc, char** argv) {
  static Setup setup;
  auto cfg = model::LoadModelConfig(kModel);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 1;
  }
  setup.config = *cfg;
  auto w = model::LoadWeights(kModel, setup.config);
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    return 1;
  }
  setup.weights = std::move(*w);
  for (int64_t seqs : {8, 32}) {
    benchmark::RegisterBenchmark("one_process", [](benchmark::State& st) {
      DecodeSteps(st, setup, 1, 0);
    })->Arg(seqs)->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("pp2_two_micro_batches", [](benchmark::State& st) {
      DecodeSteps(st, setup, 2, 2);
    })->Arg(seqs)->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("pp2_one_micro_batch", [](benchmark::State& st) {
      DecodeSteps(st, setup, 2, 1);
    })->Arg(seqs)->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
