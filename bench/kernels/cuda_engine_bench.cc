// End-to-end throughput of the `cuda` backend on a model with the
// Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim
// 128, intermediate 14336, vocab 128256, RoPE llama3) and random weights:
// either a model directory written by tools/make_random_model.py (`--model
// DIR`: the real loader's bf16 path, WeightFormat::kBf16) or weights made
// in memory. For each mode — default kernels with CUDA graphs, default
// kernels eager, batch-invariant with graphs — it measures prefill tokens/s
// (steps of `--prefill-seqs` fresh prompts of `--prompt` tokens, best of 3)
// and decode tokens/s (`--batch` sequences at a context of `--prompt`
// tokens, one token each per step, mean over the steps after two warm-up
// steps: first sight and graph capture). Prints one JSON object.
// Without a device it prints {"error": ...} and exits 1.
//
//   bench_cuda_engine [--model DIR] [--layers N] [--prompt 1024] [--batch 64]
//                     [--prefill-seqs 4] [--steps 20]
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace {

using tandem::engine::SeqChunk;
using Clock = std::chrono::steady_clock;

void Fill(std::vector<uint16_t>& v, uint64_t seed, float amp) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = tandem::model::FloatToBfloat16(amp * (static_cast<float>(x >> 40) * (1.0f / 8388608.0f) - 1.0f));
  }
}

tandem::model::Matrix Mat(uint32_t rows, uint32_t cols) {
  tandem::model::Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.bf16.resize(size_t{rows} * cols);
  return m;
}

int Arg(int argc, char** argv, const char* name, int def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return def;
}

std::string StrArg(int argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return "";
}

std::string Escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += (ch == '\n') ? ' ' : ch;
  }
  return o;
}

int Fail(const std::string& what) {
  std::printf("{\"error\": \"%s\"}\n", Escape(what).c_str());
  return 1;
}

// The host pool's memory is never touched by the cuda backend (it keeps KV
// on the device): reserve it lazily instead of zeroing gigabytes.
class LazyPoolAllocator final : public tandem::engine::KvPoolAllocator {
 public:
  ~LazyPoolAllocator() override {
    if (p_ != nullptr) munmap(p_, bytes_);
  }
  tandem::Result<std::span<std::byte>> Allocate(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return tandem::ResourceExhaustedError("mmap of the host pool failed");
    p_ = p;
    bytes_ = bytes;
    return std::span<std::byte>(static_cast<std::byte*>(p), bytes);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

tandem::model::ModelConfig Llama3Shape(int layers) {
  tandem::model::ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = static_cast<uint32_t>(layers);
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope.theta = 500000.0;
  c.rope.type = "llama3";
  c.rope.factor = 8.0;
  c.rope.low_freq_factor = 1.0;
  c.rope.high_freq_factor = 4.0;
  c.rope.original_max_position_embeddings = 8192;
  return c;
}

// Random bf16 weights in memory, filled in parallel (16 GB for 32 layers).
tandem::model::ModelWeights RandomWeights(const tandem::model::ModelConfig& c) {
  const uint32_t h = c.hidden_size, inter = c.intermediate_size;
  const uint32_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  tandem::model::ModelWeights w;
  w.embed_tokens = Mat(c.vocab_size, h);
  w.lm_head = Mat(c.vocab_size, h);
  w.norm.assign(h, 1.0f);
  w.layers.resize(c.num_hidden_layers);
  std::vector<std::thread> fill;
  fill.reserve(size_t{c.num_hidden_layers} + 2);
  fill.emplace_back([&] { Fill(w.embed_tokens.bf16, 1, 0.02f); });
  fill.emplace_back([&] { Fill(w.lm_head.bf16, 2, 0.02f); });
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    auto& L = w.layers[l];
    L.input_layernorm.assign(h, 1.0f);
    L.post_attention_layernorm.assign(h, 1.0f);
    L.q_proj = Mat(q, h);
    L.k_proj = Mat(kv, h);
    L.v_proj = Mat(kv, h);
    L.o_proj = Mat(h, q);
    L.gate_proj = Mat(inter, h);
    L.up_proj = Mat(inter, h);
    L.down_proj = Mat(h, inter);
    fill.emplace_back([&L, l] {
      uint64_t s = 10 + 8 * uint64_t{l};
      for (auto* m : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.gate_proj, &L.up_proj, &L.down_proj}) {
        Fill(m->bf16, s++, 0.02f);
      }
    });
  }
  for (auto& t : fill) t.join();
  return w;
}

struct Mode {
  const char* name;
  bool batch_invariant;
  bool graphs;
};

}  // namespace

int main(int argc, char** argv) {
  char why[256] = "";
  if (tandem::kernels::cuda::DeviceCount(why, sizeof(why)) == 0) {
    return Fail(std::string("no CUDA device: ") + why);
  }
  const std::string model_dir = StrArg(argc, argv, "--model");
  const int prompt = Arg(argc, argv, "--prompt", 1024);
  const int batch = Arg(argc, argv, "--batch", 64);
  const int prefill_seqs = Arg(argc, argv, "--prefill-seqs", 4);
  const int steps = std::max(3, Arg(argc, argv, "--steps", 20));

  const auto t_gen = Clock::now();
  tandem::model::ModelConfig c;
  tandem::model::ModelWeights w;
  if (!model_dir.empty()) {
    auto cfg = tandem::model::LoadModelConfig(model_dir);
    if (!cfg.ok()) return Fail(cfg.status().ToString());
    c = *cfg;
    auto lw = tandem::model::LoadWeights(model_dir, c, tandem::model::WeightFormat::kBf16);
    if (!lw.ok()) return Fail(lw.status().ToString());
    w = std::move(*lw);
  } else {
    c = Llama3Shape(Arg(argc, argv, "--layers", 32));
    w = RandomWeights(c);
  }
  const double gen_s = std::chrono::duration<double>(Clock::now() - t_gen).count();

  const uint32_t bs = 16;
  const int blocks_per_seq = (prompt + steps + 1 + bs - 1) / bs;
  const int num_blocks = (batch + prefill_seqs) * blocks_per_seq;
  tandem::engine::KvLayout layout{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, bs};
  LazyPoolAllocator alloc;
  auto pool = tandem::engine::KvPool::Create(layout, static_cast<uint32_t>(num_blocks), alloc);
  if (!pool.ok()) return Fail(pool.status().ToString());

  std::vector<std::vector<uint32_t>> tables(batch + prefill_seqs);
  for (int s = 0; s < batch + prefill_seqs; ++s) {
    for (int b = 0; b < blocks_per_seq; ++b) tables[s].push_back(static_cast<uint32_t>(s * blocks_per_seq + b));
  }
  std::vector<uint32_t> tokens(prompt);
  for (int i = 0; i < prompt; ++i) tokens[i] = (1000 + (i * 7919) % 100000) % c.vocab_size;
  std::vector<float> logits(size_t(std::max(batch, prefill_seqs)) * c.vocab_size);

  const Mode modes[] = {{"default+graphs", false, true}, {"default+eager", false, false},
                        {"batch_invariant+graphs", true, true}};
  std::string runs;
  size_t weight_bytes = 0;
  for (const Mode& mode : modes) {
    const auto t_load = Clock::now();
    tandem::engine::CudaBackendOptions o;
    o.batch_invariant = mode.batch_invariant;
    o.cuda_graphs = mode.graphs;
    auto backend = tandem::engine::CreateCudaBackend(c, w, pool->get(), o);
    if (!backend.ok()) return Fail(std::string(mode.name) + ": " + backend.status().ToString());
    const double load_s = std::chrono::duration<double>(Clock::now() - t_load).count();
    auto& be = **backend;
    weight_bytes = be.weight_bytes();
    std::string error;
    auto step = [&](const std::vector<SeqChunk>& chunks) {
      const auto t = Clock::now();
      const auto st = be.Forward(chunks, logits);
      if (!st.ok() && error.empty()) error = st.ToString();
      return std::chrono::duration<double>(Clock::now() - t).count();
    };
    // The decode batch's prompts (their KV), 8 a step; then the timed
    // prefill steps of `prefill_seqs` prompts at once.
    for (int s = 0; s < batch; s += 8) {
      std::vector<SeqChunk> pre;
      for (int k = s; k < std::min(batch, s + 8); ++k) pre.push_back(SeqChunk{tokens, 0, tables[k], 1});
      step(pre);
    }
    std::vector<SeqChunk> pre;
    for (int s = 0; s < prefill_seqs; ++s) pre.push_back(SeqChunk{tokens, 0, tables[batch + s], 1});
    double prefill_best = 1e30;
    for (int r = 0; r < 3; ++r) prefill_best = std::min(prefill_best, step(pre));

    std::vector<uint32_t> next(batch, 7);
    double decode_total = 0, decode_best = 1e30;
    for (int i = 0; i < steps; ++i) {
      std::vector<SeqChunk> dec;
      for (int s = 0; s < batch; ++s) {
        dec.push_back(SeqChunk{std::span<const uint32_t>(&next[s], 1), static_cast<uint32_t>(prompt + i), tables[s], 1});
      }
      const double t = step(dec);
      if (i >= 2) {  // first sight (eager, buffers grow) and capture
        decode_total += t;
        decode_best = std::min(decode_best, t);
      }
    }
    if (!error.empty()) return Fail(std::string(mode.name) + ": " + error);
    const double decode_mean = decode_total / (steps - 2);
    const tandem::engine::CudaGraphStats gs = tandem::engine::GetCudaGraphStats(be);
    char buf[1024];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"mode\": \"%s\", \"load_s\": %.2f, \"prefill_step_s\": %.4f, "
                  "\"prefill_tokens_per_s\": %.0f, \"decode_step_mean_s\": %.5f, "
                  "\"decode_step_best_s\": %.5f, \"decode_tokens_per_s\": %.0f, "
                  "\"graph_captures\": %llu, \"graph_replays\": %llu, \"graph_failures\": %llu}",
                  runs.empty() ? "" : ", ", mode.name, load_s, prefill_best,
                  prefill_seqs * prompt / prefill_best, decode_mean, decode_best, batch / decode_mean,
                  static_cast<unsigned long long>(gs.captures), static_cast<unsigned long long>(gs.replays),
                  static_cast<unsigned long long>(gs.failed_captures));
    runs += buf;
  }
  std::printf(
      "{\"model\": \"%s\", \"layers\": %u, \"hidden\": %u, \"prompt_tokens\": %d, \"prefill_seqs\": %d, "
      "\"decode_batch\": %d, \"decode_steps\": %d, \"weights_load_or_gen_s\": %.1f, \"weight_bytes\": %zu, "
      "\"runs\": [%s]}\n",
      model_dir.empty() ? "Llama-3-8B shape, random bf16 weights in memory" : Escape(model_dir).c_str(),
      c.num_hidden_layers, c.hidden_size, prompt, prefill_seqs, batch, steps, gen_s, weight_bytes,
      runs.c_str());
  return 0;
}
