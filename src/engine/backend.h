// The compute backend interface: one forward pass over a batch that mixes
// prefill chunks and decode tokens, reading and writing the paged KV pool.
// Backends: `cpu` (real math over kernels/cpu, batch-invariant); `cuda` and
// `sim` come later behind the same interface.
//
// Thread-safety: a backend is driven by one thread at a time (the engine
// thread); Forward must not run concurrently with itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "engine/kv_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace tandem::engine {

// One sequence's part of a step.
struct SeqChunk {
  std::span<const uint32_t> tokens;       // [n] tokens computed this step
  uint32_t start_pos = 0;                 // position of tokens[0]
  std::span<const uint32_t> block_table;  // blocks covering positions [0, start_pos + n)
  uint32_t num_logits = 0;                // logits wanted for the last num_logits tokens
  // Blocks of this sequence onboarded from the host / disk KV tier just
  // before this step (already in the pool; the sim backend charges their
  // modelled copy time, overlapped with the step's compute).
  uint32_t onboarded_host_blocks = 0;
  uint32_t onboarded_disk_blocks = 0;
};

// What every real-math backend checks before a forward pass: each chunk's
// num_logits fits its tokens, its block table covers its positions, no
// position passes `max_positions` (0: unchecked), and `logits_size` floats
// hold every wanted row of `vocab` logits. INVALID_ARGUMENT naming the limit.
Status CheckForwardBatch(std::span<const SeqChunk> batch, size_t block_size, size_t max_positions,
                         size_t vocab, size_t logits_size);

enum class BackendFeature {
  kRealMath,        // computes the model (sim does not)
  kBatchInvariant,  // a row's bits never depend on the batch or the chunking
  kHostKvPool,      // KV lives in the host pool's memory (transport reads it in place)
  kDeviceKvPool,    // KV lives in device memory: a transfer needs a transport whose pool is
                    // device memory (UCX with CUDA memory, or the staging path)
};
// "real_math", "batch_invariant", "host_kv_pool", "device_kv_pool".
std::string_view BackendFeatureName(BackendFeature feature);

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  virtual std::string_view name() const = 0;
  virtual bool Supports(BackendFeature feature) const = 0;
  virtual uint32_t vocab_size() const = 0;
  // Bytes of weights one forward step reads (every layer plus the LM head).
  virtual size_t weight_bytes() const = 0;

  // Computes the batch: writes every token's K/V into its slot of the pool
  // and fills `logits` [sum num_logits][vocab], rows in batch order. Every
  // block of every block table must be held by the caller.
  virtual Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) = 0;

  // One-hot backends (sim): every logits row Forward fills is -1e30 but for
  // a single 0 at the row's "hot" token. Such a backend returns true here,
  // accepts an empty `logits` span (it then fills no rows), and reports
  // each row's hot token after every Forward in hot_tokens() (rows in batch
  // order), so that the engine need not fill and scan full-vocabulary rows
  // when the sampling settings make the hot token the certain pick
  // (issue 23). Others: false / empty.
  virtual bool one_hot_logits() const { return false; }
  virtual std::span<const uint32_t> hot_tokens() const { return {}; }

  // Layer progress, for the streaming KV push (docs/kvtransfer.md): while
  // set, a backend that can calls `fn(layers_done)` from inside Forward (on
  // the engine thread) once layers [0, layers_done) of every token of the
  // batch are final in the pool. Optional: the engine reports every layer
  // itself once Forward returns, so a backend that never calls it (sim,
  // cuda) streams per chunk instead of per layer group.
  using LayerProgressFn = std::function<void(uint32_t layers_done)>;
  void set_layer_progress(LayerProgressFn fn) { layer_progress_ = std::move(fn); }

 protected:
  void ReportLayersDone(uint32_t layers_done) const {
    if (layer_progress_) layer_progress_(layers_done);
  }

 private:
  LayerProgressFn layer_progress_;
};

// Whether backend `name` can run `config` (architecture features, dtype);
// UNIMPLEMENTED with the reason when not.
Status BackendSupports(std::string_view name, const model::ModelConfig& config);

// Builds backend `name` ("cpu") for the model; weights are copied (packed)
// and may be dropped afterwards. `pool` is borrowed. `threads`: compute
// threads (1 = the engine thread only). `consume`: as LlamaForward::Create's.
Result<std::unique_ptr<ComputeBackend>> CreateBackend(std::string_view name,
                                                      const model::ModelConfig& config,
                                                      const model::ModelWeights& weights,
                                                      KvPool* pool, int threads,
                                                      model::ModelWeights* consume = nullptr);

}  // namespace tandem::engine
