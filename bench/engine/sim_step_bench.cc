// CPU of one engine step on the sim backend with its sleep turned off: what
// a sim decoder's engine thread spends per step apart from the simulated GPU
// time and the delivery to the decode stream (issue 23, bench/results/
// proxy_cost.md "Session 5, dec-step"). `batch` greedy sequences of a
// 16-token prompt decode 1,000 tokens each (as `tandem bench proxy`'s
// `stream`); a finished one is replaced at once by a fresh request, so
// admission and finishing are included at the workload's rate. The output
// callback reads each delivery as the decoder's does.
//
// Args: batch, backlog, tenants. With a backlog (session 28) that many more
// requests wait behind a full batch (max_num_seqs = batch), spread over
// `tenants` tenants, as on a worker under overload: each step's scheduler
// then also weighs the waiting queue (fair-share pick) against the running.
//
//   build/bench/engine/bench_sim_step [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include <time.h>

#include "engine/engine.h"
#include "engine/sim_backend.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::engine {
namespace {

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

void BM_SimDecodeStep(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  const uint32_t backlog = static_cast<uint32_t>(state.range(1));
  const uint32_t tenants = static_cast<uint32_t>(state.range(2));
  auto tokenizer = model::LoadModelConfig(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  if (!tokenizer.ok()) {
    state.SkipWithError(tokenizer.status().ToString().c_str());
    return;
  }
  SimConfig sc;
  sc.present = true;
  sc.model_shape = std::string(TANDEM_SOURCE_DIR) + "/configs/sim/models/llama-3-8b/config.json";
  sc.kv_scale = 256;
  auto sim = PrepareSim(sc, *tokenizer, 16);
  if (!sim.ok()) {
    state.SkipWithError(sim.status().ToString().c_str());
    return;
  }
  EngineOptions o;
  o.backend = "sim";
  o.sim_timing = sim->timing.get();
  o.num_blocks = (batch + backlog) * 128;
  o.scheduler.max_waiting = backlog + batch;
  o.scheduler.max_num_seqs = batch;
  o.scheduler.max_batched_tokens = 2048;
  uint64_t step_observations = 0;
  o.on_step = [&](const StepStats&) { ++step_observations; };
  auto created = Engine::Create(sim->storage_config, model::ModelWeights{}, o);
  if (!created.ok()) {
    state.SkipWithError(created.status().ToString().c_str());
    return;
  }
  std::unique_ptr<Engine> engine = std::move(created).value();
  dynamic_cast<SimBackend&>(engine->backend()).set_sleep(false);

  uint64_t tokens = 0;
  uint64_t next_id = 0;
  const uint32_t slots = batch + backlog;
  std::vector<bool> finished(slots, false);
  auto submit = [&](uint32_t slot) {
    GenerateRequest r;
    // As long as the proxy's ids (a 36-character UUID and a suffix).
    r.request_id = "3f2b8c1e-5d4a-4b7e-9c21-0a1b2c3d4e5f-" + std::to_string(next_id++);
    r.prompt_ids.resize(16);
    for (uint32_t i = 0; i < 16; ++i) r.prompt_ids[i] = 100 + (next_id * 17 + i) % 1000;
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = 1000;
    r.tenant = "tenant-" + std::to_string(slot % tenants);
    r.on_output = [&, slot](const RequestOutput& out) {
      tokens += out.token_ids.size();
      benchmark::DoNotOptimize(out.completion_tokens);
      if (out.finished) finished[slot] = true;
    };
    return engine->Submit(std::move(r));
  };
  for (uint32_t i = 0; i < slots; ++i) {
    if (!submit(i).ok()) {
      state.SkipWithError("submit failed");
      return;
    }
  }
  engine->Step();  // the prompts
  tokens = 0;
  uint64_t steps = 0;
  const double cpu0 = ThreadCpuSeconds();
  for (auto _ : state) {
    engine->Step();
    ++steps;
    for (uint32_t i = 0; i < slots; ++i) {
      if (!finished[i]) continue;
      finished[i] = false;
      if (!submit(i).ok()) state.SkipWithError("resubmit failed");
    }
  }
  const double cpu = ThreadCpuSeconds() - cpu0;
  state.counters["cpu_us_per_step"] = steps > 0 ? cpu * 1e6 / static_cast<double>(steps) : 0;
  state.counters["cpu_us_per_token"] = tokens > 0 ? cpu * 1e6 / static_cast<double>(tokens) : 0;
  benchmark::DoNotOptimize(step_observations);
}
BENCHMARK(BM_SimDecodeStep)
    ->Args({16, 0, 1})
    ->Args({128, 0, 1})
    ->Args({128, 1024, 1})
    ->Args({128, 1024, 8})
    ->ArgNames({"batch", "backlog", "tenants"})
    ->MinTime(2.0);

}  // namespace
}  // namespace tandem::engine

BENCHMARK_MAIN();
