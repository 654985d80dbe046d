// End-to-end throughput of the `cuda` backend on a generated model with the
// Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim
// 128, intermediate 14336, vocab 128256, RoPE llama3) and random weights:
// prefill tokens/s (a step of `--prefill-seqs` fresh prompts of
// `--prompt` tokens) and decode tokens/s (`--batch` sequences at a context
// of `--prompt` tokens, one token each per step). Prints one JSON object.
// Without a device it prints {"error": ...} and exits 1.
//
//   bench_cuda_engine [--layers N] [--prompt 1024] [--batch 64] [--prefill-seqs 4] [--steps 20]
#include <cuda_runtime_api.h>

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

namespace {

using tandem::engine::SeqChunk;
using Clock = std::chrono::steady_clock;

void Fill(std::vector<float>& v, uint64_t seed, float amp) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = amp * (static_cast<float>(x >> 40) * (1.0f / 8388608.0f) - 1.0f);
  }
}

tandem::model::Matrix Mat(uint32_t rows, uint32_t cols) {
  tandem::model::Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data.resize(size_t{rows} * cols);
  return m;
}

int Arg(int argc, char** argv, const char* name, int def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  char why[256] = "";
  if (tandem::kernels::cuda::DeviceCount(why, sizeof(why)) == 0) {
    std::printf("{\"error\": \"no CUDA device: %s\"}\n", why);
    return 1;
  }
  const int layers = Arg(argc, argv, "--layers", 32);
  const int prompt = Arg(argc, argv, "--prompt", 1024);
  const int batch = Arg(argc, argv, "--batch", 64);
  const int prefill_seqs = Arg(argc, argv, "--prefill-seqs", 4);
  const int steps = Arg(argc, argv, "--steps", 20);

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

  // Random weights, filled in parallel (about 32 GB of f32 for 32 layers).
  const auto t_gen = Clock::now();
  tandem::model::ModelWeights w;
  w.embed_tokens = Mat(c.vocab_size, c.hidden_size);
  w.lm_head = Mat(c.vocab_size, c.hidden_size);
  w.norm.assign(c.hidden_size, 1.0f);
  w.layers.resize(layers);
  std::vector<std::thread> fill;
  fill.reserve(static_cast<size_t>(layers) + 2);
  fill.emplace_back([&] { Fill(w.embed_tokens.data, 1, 0.02f); });
  fill.emplace_back([&] { Fill(w.lm_head.data, 2, 0.02f); });
  for (int l = 0; l < layers; ++l) {
    auto& L = w.layers[l];
    L.input_layernorm.assign(c.hidden_size, 1.0f);
    L.post_attention_layernorm.assign(c.hidden_size, 1.0f);
    L.q_proj = Mat(4096, 4096);
    L.k_proj = Mat(1024, 4096);
    L.v_proj = Mat(1024, 4096);
    L.o_proj = Mat(4096, 4096);
    L.gate_proj = Mat(14336, 4096);
    L.up_proj = Mat(14336, 4096);
    L.down_proj = Mat(4096, 14336);
    fill.emplace_back([&L, l] {
      const float a = 0.02f;
      Fill(L.q_proj.data, 10 + 8 * l, a);
      Fill(L.k_proj.data, 11 + 8 * l, a);
      Fill(L.v_proj.data, 12 + 8 * l, a);
      Fill(L.o_proj.data, 13 + 8 * l, a);
      Fill(L.gate_proj.data, 14 + 8 * l, a);
      Fill(L.up_proj.data, 15 + 8 * l, a);
      Fill(L.down_proj.data, 16 + 8 * l, a);
    });
  }
  for (auto& t : fill) t.join();
  const double gen_s = std::chrono::duration<double>(Clock::now() - t_gen).count();

  const uint32_t bs = 16;
  const int blocks_per_seq = (prompt + steps + 1 + bs - 1) / bs;
  const int num_blocks = (batch + prefill_seqs) * blocks_per_seq;
  tandem::engine::KvLayout layout{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, bs};
  tandem::engine::AlignedKvPoolAllocator alloc;
  auto pool = tandem::engine::KvPool::Create(layout, static_cast<uint32_t>(num_blocks), alloc);
  if (!pool.ok()) {
    std::printf("{\"error\": \"%s\"}\n", pool.status().ToString().c_str());
    return 1;
  }
  const auto t_load = Clock::now();
  auto backend = tandem::engine::CreateCudaBackend(c, w, pool->get(), {});
  if (!backend.ok()) {
    std::printf("{\"error\": \"%s\"}\n", backend.status().ToString().c_str());
    return 1;
  }
  const double load_s = std::chrono::duration<double>(Clock::now() - t_load).count();
  w = {};  // the host copy is no longer needed
  auto& be = **backend;

  std::vector<std::vector<uint32_t>> tables(batch + prefill_seqs);
  for (int s = 0; s < batch + prefill_seqs; ++s) {
    for (int b = 0; b < blocks_per_seq; ++b) tables[s].push_back(static_cast<uint32_t>(s * blocks_per_seq + b));
  }
  std::vector<uint32_t> tokens(prompt);
  for (int i = 0; i < prompt; ++i) tokens[i] = 1000 + (i * 7919) % 100000;
  std::vector<float> logits(size_t(std::max(batch, prefill_seqs)) * c.vocab_size);

  auto step = [&](const std::vector<SeqChunk>& chunks) {
    const auto t = Clock::now();
    const auto st = be.Forward(chunks, logits);
    if (!st.ok()) {
      std::printf("{\"error\": \"%s\"}\n", st.ToString().c_str());
      std::exit(1);
    }
    return std::chrono::duration<double>(Clock::now() - t).count();
  };

  // Prefill: the decode batch's prompts (to fill their KV), one sequence a
  // step, then the timed steps of `prefill_seqs` prompts at once.
  for (int s = 0; s < batch; ++s) step({SeqChunk{tokens, 0, tables[s], 1}});
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
    if (i > 0) {  // the first step allocates the decode workspace
      decode_total += t;
      decode_best = std::min(decode_best, t);
    }
  }
  const double decode_mean = decode_total / std::max(1, steps - 1);
  std::printf(
      "{\"model\": \"Llama-3-8B shape, random weights, bf16\", \"layers\": %d, \"prompt_tokens\": %d, "
      "\"prefill_seqs\": %d, \"decode_batch\": %d, \"decode_steps\": %d, \"weight_gen_s\": %.1f, "
      "\"load_s\": %.1f, \"prefill_step_s\": %.4f, \"prefill_tokens_per_s\": %.0f, "
      "\"decode_step_mean_s\": %.5f, \"decode_step_best_s\": %.5f, \"decode_tokens_per_s\": %.0f, "
      "\"weight_bytes\": %zu}\n",
      layers, prompt, prefill_seqs, batch, steps, gen_s, load_s, prefill_best,
      prefill_seqs * prompt / prefill_best, decode_mean, decode_best, batch / decode_mean,
      be.weight_bytes());
  return 0;
}
