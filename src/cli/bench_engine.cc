// `tandem bench engine`: prefill and decode throughput of the engine on one
// model, in-process (no network), at several thread counts and batch sizes,
// next to the machine's memory read bandwidth measured in the same run — the
// physical limit of a DRAM-bound batch-1 decode. Random token ids (no
// tokenizer), fresh prompts (no prefix-cache hits), greedy sampling,
// ignore_eos. Definitions and an example: docs/bench-engine.md.
//
//   tandem bench engine [--model DIR] [--threads 1,2] [--batch 1,8]
//       [--prompt-tokens 512] [--decode-tokens 128] [--decode-prompt 16]
//       [--reps 3] [--bandwidth-mib 1024] [--isa best|avx512|avx2|portable]
//       [--json FILE]
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <sstream>
#include <vector>

#include "cli/commands.h"
#include "engine/engine.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct EngineBenchArgs {
  std::string model = "models/tandem-kjv";
  std::string threads = "1,2";
  std::string batch = "1,8";
  uint32_t prompt_tokens = 512;
  uint32_t decode_tokens = 128;
  uint32_t decode_prompt = 16;
  uint32_t reps = 3;
  uint32_t bandwidth_mib = 1024;
  // The kernels' instruction set: "best" (what the engine picks by itself)
  // or a lower one, to measure the other vector paths on this CPU.
  std::string isa = "best";
  std::string json;
};

// --isa: the kernels' instruction set for this run. The results do not
// change with it (kernels/cpu/ops.h); only the speed does.
Result<kernels::cpu::Isa> ParseIsa(const std::string& text) {
  using kernels::cpu::Isa;
  const Isa best = kernels::cpu::BestIsa();
  if (text == "best") return best;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (text != kernels::cpu::IsaName(isa)) continue;
    if (static_cast<int>(isa) > static_cast<int>(best)) {
      return InvalidArgumentError(
          fmt::format("--isa {}: this CPU supports at most {}", text, kernels::cpu::IsaName(best)));
    }
    return isa;
  }
  return InvalidArgumentError(
      fmt::format("--isa: '{}' is not one of best, avx512, avx2, portable", text));
}

Result<std::vector<uint32_t>> ParseList(const std::string& flag, const std::string& text) {
  std::vector<uint32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v == 0 || v > 1024) {
      return InvalidArgumentError(
          fmt::format("{}: '{}' is not a number in 1..1024", flag, item));
    }
    out.push_back(static_cast<uint32_t>(v));
  }
  if (out.empty()) return InvalidArgumentError(fmt::format("{}: no value given", flag));
  return out;
}

struct Stats {
  double mean = 0, sd = 0;
  std::vector<double> values;
};
Stats Summarize(std::vector<double> v) {
  Stats s;
  s.values = v;
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  for (double x : v) s.sd += (x - s.mean) * (x - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0;
  return s;
}

// Read bandwidth: `threads` threads each sum their contiguous part of a
// buffer far larger than the caches (bytes read per second, best of 5),
// with the widest loads the CPU has and 8 independent sums, so the loop is
// limited by memory, not by instructions.
typedef uint64_t U64x8 __attribute__((vector_size(64)));
typedef uint64_t U64x4 __attribute__((vector_size(32)));
typedef uint64_t U64x2 __attribute__((vector_size(16)));
template <class V>
inline __attribute__((always_inline)) uint64_t SumBody(const uint64_t* p, size_t n) {
  constexpr size_t kBytes = sizeof(V);
  constexpr size_t kWords = kBytes / sizeof(uint64_t);
  V acc[8] = {};
  size_t i = 0;
  for (; i + 8 * kWords <= n; i += 8 * kWords) {
    for (int k = 0; k < 8; ++k) {
      V x;
      std::memcpy(&x, p + i + k * kWords, kBytes);
      acc[k] += x;
    }
  }
  V s = {};
  for (int k = 0; k < 8; ++k) s += acc[k];
  uint64_t total = 0;
  for (size_t l = 0; l < kWords; ++l) total += s[l];
  for (; i < n; ++i) total += p[i];
  return total;
}
__attribute__((target("avx512f"))) uint64_t SumAvx512(const uint64_t* p, size_t n) {
  return SumBody<U64x8>(p, n);
}
__attribute__((target("avx2"))) uint64_t SumAvx2(const uint64_t* p, size_t n) {
  return SumBody<U64x4>(p, n);
}
uint64_t SumRange(const uint64_t* p, size_t n) {
  static const auto fn = __builtin_cpu_supports("avx512f") ? &SumAvx512
                         : __builtin_cpu_supports("avx2")  ? &SumAvx2
                                                           : &SumBody<U64x2>;
  return fn(p, n);
}

// A probe buffer allocated as the packed weights are
// (kernels::cpu::AllocateStreamed: huge pages where the kernel has them), so
// the probe reads memory the way a decode reads its weights (on small pages,
// after a decode repetition, it read ~10 % less here than on huge pages:
// bench/results/cpu_vs_llamacpp/session-45.md). Null when out of memory.
struct FreeWords {
  void operator()(uint64_t* p) const { std::free(p); }
};
using Words = std::unique_ptr<uint64_t[], FreeWords>;
Words AllocateWords(size_t n) {
  return Words(static_cast<uint64_t*>(kernels::cpu::AllocateStreamed(n * sizeof(uint64_t))));
}

double ReadBandwidth(std::span<const uint64_t> buf, int threads) {
  kernels::cpu::ThreadPool pool(threads);
  kernels::cpu::ThreadPool::StepScope step(&pool);
  const int64_t chunks = threads;  // one contiguous part per thread
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::atomic<uint64_t> sink{0};
    const auto t0 = Clock::now();
    pool.ParallelFor(chunks, 1, [&](int64_t b, int64_t e) {
      const size_t n = buf.size();
      const size_t lo = n * static_cast<size_t>(b) / static_cast<size_t>(chunks);
      const size_t hi = n * static_cast<size_t>(e) / static_cast<size_t>(chunks);
      sink += SumRange(buf.data() + lo, hi - lo);
    });
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, static_cast<double>(buf.size() * sizeof(uint64_t)) / s);
  }
  return best;
}

double MemcpyBandwidth(std::span<const uint64_t> buf, std::span<uint64_t> dst) {
  std::memcpy(dst.data(), buf.data(), dst.size() * sizeof(uint64_t));  // fault in
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), buf.data() + dst.size(), dst.size() * sizeof(uint64_t));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, static_cast<double>(dst.size() * sizeof(uint64_t)) / s);
  }
  volatile uint64_t keep = dst[dst.size() / 3];
  (void)keep;
  return best;  // bytes copied per second (each byte read once, written once)
}

std::vector<uint32_t> RandomPrompt(uint32_t n, uint32_t vocab, uint64_t salt) {
  std::mt19937_64 rng(salt);
  std::vector<uint32_t> p(n);
  for (auto& t : p) t = static_cast<uint32_t>(3 + rng() % (vocab - 3));
  return p;
}

Result<std::unique_ptr<engine::Engine>> MakeEngine(const model::ModelConfig& config,
                                                   const model::ModelWeights& weights,
                                                   uint32_t threads, uint32_t tokens_per_seq,
                                                   uint32_t seqs, uint32_t max_batched) {
  engine::EngineOptions o;
  o.threads = threads;
  o.num_blocks = seqs * ((tokens_per_seq + o.block_size - 1) / o.block_size + 1);
  o.scheduler.max_batched_tokens = max_batched;
  o.scheduler.max_num_seqs = seqs;
  return engine::Engine::Create(config, weights, o);
}

// Seconds for one fresh prompt: Submit + RunUntilIdle (prefill and the
// first token), whole prompt in one step.
Result<double> PrefillOnce(engine::Engine& eng, const model::ModelConfig& config, uint32_t n,
                           uint64_t salt) {
  engine::GenerateRequest r;
  r.request_id = fmt::format("prefill-{}", salt);
  r.prompt_ids = RandomPrompt(n, config.vocab_size, salt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 1;
  r.sampling.ignore_eos = true;
  const auto t0 = Clock::now();
  TANDEM_RETURN_IF_ERROR(eng.Submit(std::move(r)));
  eng.RunUntilIdle();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds for `steps` decode steps of `batch` sequences (prompts prefilled
// first, untimed).
Result<double> DecodeOnce(engine::Engine& eng, const model::ModelConfig& config, uint32_t batch,
                          uint32_t prompt, uint32_t steps, uint64_t salt) {
  for (uint32_t i = 0; i < batch; ++i) {
    engine::GenerateRequest r;
    r.request_id = fmt::format("decode-{}-{}", salt, i);
    r.prompt_ids = RandomPrompt(prompt, config.vocab_size, salt * 1000 + i);
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    r.sampling.max_tokens = steps + 1;  // + the token the prefill samples
    TANDEM_RETURN_IF_ERROR(eng.Submit(std::move(r)));
  }
  eng.Step();  // all prompts in one step
  const auto t0 = Clock::now();
  for (uint32_t s = 0; s < steps; ++s) eng.Step();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  eng.RunUntilIdle();  // nothing left; frees the sequences
  return secs;
}

Status Run(const EngineBenchArgs& a) {
  TANDEM_ASSIGN_OR_RETURN(auto thread_list, ParseList("--threads", a.threads));
  TANDEM_ASSIGN_OR_RETURN(auto batch_list, ParseList("--batch", a.batch));
  TANDEM_ASSIGN_OR_RETURN(const kernels::cpu::Isa isa, ParseIsa(a.isa));
  if (a.reps == 0 || a.prompt_tokens == 0 || a.decode_tokens == 0 || a.decode_prompt == 0 ||
      a.bandwidth_mib == 0) {
    return InvalidArgumentError(
        "--reps, --prompt-tokens, --decode-tokens, --decode-prompt and --bandwidth-mib must be "
        ">= 1");
  }
  TANDEM_ASSIGN_OR_RETURN(model::ModelConfig config, model::LoadModelConfig(a.model));
  const uint32_t ctx = config.max_position_embeddings;
  if (ctx != 0 && (a.prompt_tokens + 1 > ctx || a.decode_prompt + a.decode_tokens + 1 > ctx)) {
    return InvalidArgumentError(fmt::format(
        "--prompt-tokens {} / --decode-prompt {} + --decode-tokens {} exceed the model's "
        "context of {} positions",
        a.prompt_tokens, a.decode_prompt, a.decode_tokens, ctx));
  }
  TANDEM_ASSIGN_OR_RETURN(model::ModelWeights weights,
                          model::LoadWeights(a.model, config, model::WeightFormat::kF32));

  nlohmann::ordered_json out;
  out["model"] = a.model;
  out["prompt_tokens"] = a.prompt_tokens;
  out["decode_tokens"] = a.decode_tokens;
  out["decode_prompt"] = a.decode_prompt;
  out["reps"] = a.reps;
  kernels::cpu::SetIsa(isa);
  out["isa"] = kernels::cpu::IsaName(isa);
  std::cout << fmt::format("kernels: {}\n", kernels::cpu::IsaName(isa));

  // The physical limit, measured first (before the model's pages are hot),
  // and again beside each batch-1 decode repetition (below).
  const size_t probe_words = size_t{a.bandwidth_mib} << 17;  // MiB / 8 bytes
  const Words probe = AllocateWords(probe_words);
  if (probe == nullptr) {
    return InvalidArgumentError(
        fmt::format("bench engine: --bandwidth-mib {}: cannot allocate the {} MiB probe buffer",
                    a.bandwidth_mib, a.bandwidth_mib));
  }
  const std::span<uint64_t> buf(probe.get(), probe_words);
  std::fill(buf.begin(), buf.end(), uint64_t{1});
  {
    const Words copy = AllocateWords(probe_words / 2);
    if (copy == nullptr) {
      return InvalidArgumentError(
          fmt::format("bench engine: --bandwidth-mib {}: cannot allocate the {} MiB memcpy target",
                      a.bandwidth_mib, a.bandwidth_mib / 2));
    }
    out["memcpy_GBps"] = MemcpyBandwidth(buf, {copy.get(), probe_words / 2}) / 1e9;
    std::cout << fmt::format("memcpy: {:.2f} GB/s (bytes copied per second, {} MiB)\n",
                             out["memcpy_GBps"].get<double>(), a.bandwidth_mib / 2);
    for (uint32_t t : thread_list) {
      const double bw = ReadBandwidth(buf, static_cast<int>(t)) / 1e9;
      out["read_GBps"][std::to_string(t)] = bw;
      std::cout << fmt::format("read bandwidth, {} thread(s): {:.2f} GB/s ({} MiB summed)\n", t,
                               bw, a.bandwidth_mib);
    }
  }

  double weight_bytes = 0;
  for (uint32_t t : thread_list) {
    nlohmann::ordered_json row;
    row["threads"] = t;
    {
      TANDEM_ASSIGN_OR_RETURN(auto eng, MakeEngine(config, weights, t, a.prompt_tokens + 1, 1,
                                                   a.prompt_tokens));
      weight_bytes = static_cast<double>(eng->backend().weight_bytes());
      TANDEM_ASSIGN_OR_RETURN(double warm, PrefillOnce(*eng, config, a.prompt_tokens, 1));
      (void)warm;
      std::vector<double> tps;
      for (uint32_t r = 0; r < a.reps; ++r) {
        TANDEM_ASSIGN_OR_RETURN(double s, PrefillOnce(*eng, config, a.prompt_tokens, 100 + r));
        tps.push_back(a.prompt_tokens / s);
      }
      const Stats st = Summarize(tps);
      row["prefill_tps"] = {{"mean", st.mean}, {"sd", st.sd}, {"values", st.values}};
      std::cout << fmt::format("threads {}  prefill {:>5} tokens: {:9.1f} ± {:.1f} tokens/s\n", t,
                               a.prompt_tokens, st.mean, st.sd);
    }
    for (uint32_t b : batch_list) {
      TANDEM_ASSIGN_OR_RETURN(auto eng,
                              MakeEngine(config, weights, t, a.decode_prompt + a.decode_tokens + 2,
                                         b, std::max(b * a.decode_prompt, 256u)));
      TANDEM_ASSIGN_OR_RETURN(double warm, DecodeOnce(*eng, config, b, a.decode_prompt, 8, 1));
      (void)warm;
      std::vector<double> tps;
      // Batch 1: the read probe right after each repetition, so that each
      // decode has the bandwidth of its own seconds beside it (this host's
      // bandwidth moves within a minute; bench/results/cpu_vs_llamacpp.md).
      // The next repetition's untimed prompt step reads every weight again
      // before its timed steps, so the probe leaves no cold cache in them.
      std::vector<double> paired_read, paired_fraction;
      for (uint32_t r = 0; r < a.reps; ++r) {
        TANDEM_ASSIGN_OR_RETURN(
            double s, DecodeOnce(*eng, config, b, a.decode_prompt, a.decode_tokens, 10 + r));
        tps.push_back(static_cast<double>(b) * a.decode_tokens / s);
        if (b == 1) {
          const double read = ReadBandwidth(buf, static_cast<int>(t)) / 1e9;
          paired_read.push_back(read);
          paired_fraction.push_back(tps.back() * weight_bytes / 1e9 / read);
        }
      }
      const Stats st = Summarize(tps);
      auto& d = row["decode_tps"][std::to_string(b)];
      d = {{"mean", st.mean}, {"sd", st.sd}, {"values", st.values}};
      std::string extra;
      if (b == 1) {
        // Every step reads all weights once: weight bytes per second.
        const double gbps = st.mean * weight_bytes / 1e9;
        d["weight_GBps"] = gbps;
        const Stats pr = Summarize(paired_read);
        const Stats pf = Summarize(paired_fraction);
        d["paired_read_GBps"] = {{"mean", pr.mean}, {"values", pr.values}};
        d["paired_fraction"] = {{"mean", pf.mean}, {"values", pf.values}};
        extra = fmt::format(
            "  (weights read at {:.2f} GB/s; {:.2f} of the read probe after "
            "each repetition, {:.2f} GB/s)",
            gbps, pf.mean, pr.mean);
      }
      std::cout << fmt::format("threads {}  decode batch {:>3}: {:9.1f} ± {:.1f} tokens/s{}\n", t,
                               b, st.mean, st.sd, extra);
    }
    out["runs"].push_back(row);
  }
  out["weight_bytes"] = weight_bytes;
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    f << out.dump(2) << "\n";
    if (!f) return InternalError(fmt::format("--json: cannot write {}", a.json));
  }
  return Status::Ok();
}

}  // namespace

void RegisterBenchEngine(CLI::App& bench, GlobalOptions& g) {
  auto a = std::make_shared<EngineBenchArgs>();
  auto* cmd = bench.add_subcommand(
      "engine", "Prefill and decode tokens/s of the cpu engine on a model, with memory bandwidth");
  cmd->add_option("--model", a->model, "Model folder (config.json + safetensors)");
  cmd->add_option("--threads", a->threads, "Compute thread counts, comma-separated");
  cmd->add_option("--batch", a->batch, "Decode batch sizes, comma-separated");
  cmd->add_option("--prompt-tokens", a->prompt_tokens, "Prefill prompt length (one step)");
  cmd->add_option("--decode-tokens", a->decode_tokens, "Timed decode steps per repetition");
  cmd->add_option("--decode-prompt", a->decode_prompt, "Prompt length before decoding");
  cmd->add_option("--reps", a->reps, "Repetitions (after one warm-up)");
  cmd->add_option("--bandwidth-mib", a->bandwidth_mib, "Buffer for the bandwidth measurement");
  cmd->add_option("--isa", a->isa,
                  "Kernels' instruction set: best (default), avx512, avx2 or portable");
  cmd->add_option("--json", a->json, "Also write the results as JSON to this file");
  cmd->callback([a, &g] {
    const Status st = Run(*a);
    if (!st.ok()) {
      std::cerr << "tandem bench engine: " << st.message() << "\n";
      g.exit_code = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
      return;
    }
    g.exit_code = 0;
  });
}

}  // namespace tandem::cli
