// Engine throughput on the CPU backend: decode tokens/s at batch 1, 8 and
// 32, and prefill tokens/s, for the bundled model (models/tandem-kjv) and
// for a generated ~100M-parameter Llama config with random weights. The
// batch-1 decode figure is also reported against memory bandwidth: weight
// bytes read per step / step time, over memcpy bandwidth measured in the
// same run (bytes copied per second, 256 MiB, as bench_memcpy).
//
//   build/bench/engine/bench_engine [--benchmark_filter=...]
//   TANDEM_BENCH_THREADS=2 ...  (compute threads; default 1)
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>

#include <time.h>

#include "engine/engine.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::engine {
namespace {

struct BenchModel {
  model::ModelConfig config;
  model::ModelWeights weights;
  std::string error;
};

int Threads() {
  const char* t = std::getenv("TANDEM_BENCH_THREADS");
  return t ? std::max(1, std::atoi(t)) : 1;
}

model::Matrix RandomMatrix(uint32_t rows, uint32_t cols, std::mt19937& rng) {
  model::Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data.resize(size_t{rows} * cols);
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  for (float& x : m.data) x = d(rng);
  return m;
}

// ~100M parameters: hidden 768, 12 layers, 12 heads / 4 kv heads,
// intermediate 2048, vocab 32000, tied embeddings.
BenchModel Generated100M() {
  BenchModel b;
  auto& c = b.config;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 32000;
  c.hidden_size = 768;
  c.intermediate_size = 2048;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  std::mt19937 rng(1);
  auto& w = b.weights;
  w.embed_tokens = RandomMatrix(c.vocab_size, c.hidden_size, rng);
  w.norm.assign(c.hidden_size, 1.0f);
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    model::LayerWeights lw;
    lw.input_layernorm.assign(c.hidden_size, 1.0f);
    lw.post_attention_layernorm.assign(c.hidden_size, 1.0f);
    lw.q_proj = RandomMatrix(c.num_attention_heads * c.head_dim, c.hidden_size, rng);
    lw.k_proj = RandomMatrix(c.num_key_value_heads * c.head_dim, c.hidden_size, rng);
    lw.v_proj = RandomMatrix(c.num_key_value_heads * c.head_dim, c.hidden_size, rng);
    lw.o_proj = RandomMatrix(c.hidden_size, c.num_attention_heads * c.head_dim, rng);
    lw.gate_proj = RandomMatrix(c.intermediate_size, c.hidden_size, rng);
    lw.up_proj = RandomMatrix(c.intermediate_size, c.hidden_size, rng);
    lw.down_proj = RandomMatrix(c.hidden_size, c.intermediate_size, rng);
    w.layers.push_back(std::move(lw));
  }
  return b;
}

BenchModel Bundled() {
  BenchModel b;
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv";
  auto cfg = model::LoadModelConfig(dir);
  if (!cfg.ok()) {
    b.error = cfg.status().ToString();
    return b;
  }
  auto w = model::LoadWeights(dir, *cfg);
  if (!w.ok()) {
    b.error = w.status().ToString();
    return b;
  }
  b.config = *cfg;
  b.weights = std::move(*w);
  return b;
}

const BenchModel& GetModel(const std::string& name) {
  static std::map<std::string, std::unique_ptr<BenchModel>> cache;
  auto& slot = cache[name];
  if (!slot) slot = std::make_unique<BenchModel>(name == "kjv" ? Bundled() : Generated100M());
  return *slot;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// memcpy bandwidth (bytes copied per second, 256 MiB), measured once per
// process: best of 5 by wall time, and by this thread's CPU time (the
// figure that survives a machine shared with other jobs).
struct Bandwidth {
  double wall = 0;
  double cpu = 0;
};
Bandwidth MemcpyBytesPerSecond() {
  static const Bandwidth bw = [] {
    const size_t bytes = size_t{256} << 20;
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in
    Bandwidth best;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = ThreadCpuSeconds();
      std::memcpy(dst.data(), src.data(), bytes);
      benchmark::DoNotOptimize(dst.data());
      benchmark::ClobberMemory();
      const double c = ThreadCpuSeconds() - c0;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best.wall = std::max(best.wall, bytes / s);
      best.cpu = std::max(best.cpu, bytes / c);
    }
    return best;
  }();
  return bw;
}

std::vector<uint32_t> RandomPrompt(uint32_t n, uint32_t vocab, uint64_t salt) {
  std::mt19937_64 rng(salt);
  std::vector<uint32_t> p(n);
  for (auto& t : p) t = static_cast<uint32_t>(3 + rng() % (vocab - 3));
  return p;
}

std::unique_ptr<Engine> MakeEngine(const BenchModel& m, uint32_t num_blocks,
                                   uint32_t max_batched_tokens, uint32_t max_num_seqs) {
  EngineOptions o;
  o.num_blocks = num_blocks;
  o.threads = static_cast<uint32_t>(Threads());
  o.scheduler.max_batched_tokens = max_batched_tokens;
  o.scheduler.max_num_seqs = max_num_seqs;
  auto e = Engine::Create(m.config, m.weights, o);
  return e.ok() ? std::move(*e) : nullptr;
}

void BM_Decode(benchmark::State& state, const std::string& name) {
  const BenchModel& m = GetModel(name);
  if (!m.error.empty()) {
    state.SkipWithError(("model unavailable: " + m.error).c_str());
    return;
  }
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  constexpr uint32_t kPrompt = 32;
  const uint32_t ctx = std::min<uint32_t>(m.config.max_position_embeddings, 1024);
  const uint32_t max_tokens = ctx - kPrompt - 1;
  const uint32_t blocks_per_seq = (ctx + 15) / 16;
  auto engine = MakeEngine(m, batch * blocks_per_seq + 1, 2048, batch);
  if (!engine) {
    state.SkipWithError("engine creation failed");
    return;
  }
  for (uint32_t i = 0; i < batch; ++i) {
    GenerateRequest r;
    r.request_id = std::to_string(i);
    r.prompt_ids = RandomPrompt(kPrompt, m.config.vocab_size, i + 1);
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = max_tokens;
    if (!engine->Submit(std::move(r)).ok()) {
      state.SkipWithError("submit failed");
      return;
    }
  }
  engine->Step();  // the prompts (one step: 32 * batch <= 2048 tokens)
  uint64_t steps = 0;
  const double cpu0 = ThreadCpuSeconds();
  const auto wall0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (steps + 1 >= max_tokens) {
      state.SkipWithError("ran past max_tokens; lower the iteration count");
      break;
    }
    engine->Step();
    ++steps;
  }
  const double cpu_s = ThreadCpuSeconds() - cpu0;
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const double tokens = static_cast<double>(steps) * batch;
  state.counters["tokens_per_s"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  state.counters["batch"] = batch;
  if (batch == 1) {
    // Weight bytes per token / step time, over memcpy bandwidth.
    const double weight_bytes = static_cast<double>(engine->backend().weight_bytes());
    state.counters["weight_GBps"] =
        benchmark::Counter(weight_bytes * steps / 1e9, benchmark::Counter::kIsRate);
    const Bandwidth bw = MemcpyBytesPerSecond();
    state.counters["memcpy_GBps"] = bw.wall / 1e9;
    state.counters["frac_wall"] = weight_bytes * steps / wall_s / bw.wall;
    if (Threads() == 1) {  // the engine computes on this thread: its CPU time is the step time
      state.counters["weight_cpu_GBps"] = weight_bytes * steps / cpu_s / 1e9;
      state.counters["memcpy_cpu_GBps"] = bw.cpu / 1e9;
      state.counters["frac_cpu"] = weight_bytes * steps / cpu_s / bw.cpu;
    }
    state.counters["weight_MB"] = weight_bytes / 1e6;
  }
}

void BM_Prefill(benchmark::State& state, const std::string& name) {
  const BenchModel& m = GetModel(name);
  if (!m.error.empty()) {
    state.SkipWithError(("model unavailable: " + m.error).c_str());
    return;
  }
  const uint32_t prompt = static_cast<uint32_t>(state.range(0));
  auto engine = MakeEngine(m, (prompt + 15) / 16 + 2, prompt, 1);
  if (!engine) {
    state.SkipWithError("engine creation failed");
    return;
  }
  uint64_t n = 0;
  for (auto _ : state) {
    state.PauseTiming();
    GenerateRequest r;
    r.request_id = std::to_string(n);
    // A fresh prompt each time: no prefix-cache hits.
    r.prompt_ids = RandomPrompt(prompt, m.config.vocab_size, 1000 + n);
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 1;
    (void)engine->Submit(std::move(r));
    state.ResumeTiming();
    engine->RunUntilIdle();
    ++n;
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * prompt, benchmark::Counter::kIsRate);
}

void BM_MemcpyBandwidth(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(MemcpyBytesPerSecond());
  state.counters["memcpy_GBps"] = MemcpyBytesPerSecond().wall / 1e9;
  state.counters["memcpy_cpu_GBps"] = MemcpyBytesPerSecond().cpu / 1e9;
}

BENCHMARK(BM_MemcpyBandwidth)->Iterations(1);
BENCHMARK_CAPTURE(BM_Decode, kjv, std::string("kjv"))
    ->Arg(1)->Arg(8)->Arg(32)->Iterations(64)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, kjv, std::string("kjv"))
    ->Arg(512)->Iterations(4)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, llama100m, std::string("llama100m"))
    ->Arg(1)->Arg(8)->Arg(32)->Iterations(16)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, llama100m, std::string("llama100m"))
    ->Arg(512)->Iterations(2)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tandem::engine

BENCHMARK_MAIN();
