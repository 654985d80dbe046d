// Runs the compute backend directly on chunks of prompts (no scheduler), to
// read logits at every position: for the golden and batch-invariance tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "test_models.h"

namespace tandem::engine::testing {

class ForwardHarness {
 public:
  ForwardHarness(const LoadedModel& m, uint32_t num_blocks, uint32_t block_size = 16,
                 int threads = 1)
      : config_(m.config) {
    KvLayout l{m.config.num_hidden_layers, m.config.num_key_value_heads, m.config.head_dim,
               block_size};
    auto pool = KvPool::Create(l, num_blocks, alloc_);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    auto b = CreateBackend("cpu", m.config, m.weights, pool_.get(), threads);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(*b);
  }

  // Hands out `n` fresh blocks (never reused within one harness).
  std::vector<uint32_t> Blocks(uint32_t tokens) {
    const uint32_t bs = pool_->layout().block_size;
    std::vector<uint32_t> out;
    for (uint32_t i = 0; i < (tokens + bs - 1) / bs; ++i) out.push_back(next_block_++);
    EXPECT_LE(next_block_, pool_->num_blocks());
    return out;
  }

  // Logits [sum num_logits][vocab] of one step.
  std::vector<float> Run(const std::vector<SeqChunk>& batch) {
    size_t rows = 0;
    for (const auto& c : batch) rows += c.num_logits;
    std::vector<float> logits(rows * config_.vocab_size);
    Status st = backend_->Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return logits;
  }

  // A prompt computed in chunks of `chunk` tokens (0: one chunk); logits of
  // every position, [prompt][vocab].
  std::vector<float> PromptLogits(const std::vector<uint32_t>& prompt, uint32_t chunk = 0) {
    auto blocks = Blocks(static_cast<uint32_t>(prompt.size()));
    std::vector<float> all;
    const uint32_t n = static_cast<uint32_t>(prompt.size());
    if (chunk == 0) chunk = n;
    for (uint32_t start = 0; start < n; start += chunk) {
      SeqChunk c;
      const uint32_t len = std::min(chunk, n - start);
      c.tokens = std::span<const uint32_t>(prompt).subspan(start, len);
      c.start_pos = start;
      c.block_table = blocks;
      c.num_logits = len;
      auto l = Run({c});
      all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  }

  const ComputeBackend& backend() const { return *backend_; }
  uint32_t vocab() const { return config_.vocab_size; }

 private:
  model::ModelConfig config_;
  AlignedKvPoolAllocator alloc_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<ComputeBackend> backend_;
  uint32_t next_block_ = 0;
};

}  // namespace tandem::engine::testing
