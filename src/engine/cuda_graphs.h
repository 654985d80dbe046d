// CUDA graphs for the cuda backend's decode steps (docs/cuda.md): one graph
// per (batch bucket, block-table bucket), captured from the same launches an
// eager step makes, replayed with cudaGraphLaunch afterwards.
//
// A step's launches depend on its shape only through the key: the backend
// pads a decode batch to its bucket (padding rows write no KV) and gives
// every launch fixed device buffers, so a graph replays any step of its key
// after the step's metadata was copied into those buffers. When the buffers
// move (they grew for a larger step), `generation` changes and every graph
// is dropped and captured again.
//
// A key runs eagerly the first time it is seen (lazy host-side set-up such
// as cuBLASLt's algorithm choice happens outside a capture) and is captured
// the second time. Capture or instantiation that fails is logged once per
// key with CUDA's reason, and the key then always runs eagerly: never a
// silent fallback, never a failed step because of graphs.
//
// Thread-safety: none; used by the backend on the engine thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "common/status.h"
#include "engine/cuda_backend.h"  // CudaGraphStats

namespace tandem::engine {

class CudaGraphCache {
 public:
  // Batch buckets: 1, 2, 4, ... kMaxBatch; larger decode batches run eagerly.
  static constexpr uint32_t kMaxBatch = 512;
  // The bucket of a batch of `n` sequences (the next power of two), or 0
  // when n > kMaxBatch.
  static uint32_t BatchBucket(uint32_t n);
  // Block-table bucket: the next power of two of `blocks`, at least 32.
  static uint32_t BlockBucket(uint32_t blocks);

  explicit CudaGraphCache(bool enabled) { stats_.enabled = enabled; }
  ~CudaGraphCache();
  CudaGraphCache(const CudaGraphCache&) = delete;
  CudaGraphCache& operator=(const CudaGraphCache&) = delete;

  // Runs `enqueue` (which launches the step's work on `stream` and returns
  // the first launch error) through the graph of `key`, capturing it when
  // due. Errors: those of `enqueue` run eagerly, or of cudaGraphLaunch.
  Status Run(std::pair<uint32_t, uint32_t> key, uint64_t generation, cudaStream_t stream,
             const std::function<Status()>& enqueue);

  const CudaGraphStats& stats() const { return stats_; }

 private:
  struct Entry {
    bool seen = false;         // ran eagerly once
    bool eager_only = false;   // capture failed: reason logged
    cudaGraphExec_t exec = nullptr;
  };
  void Clear();
  Status Capture(std::pair<uint32_t, uint32_t> key, Entry& e, cudaStream_t stream,
                 const std::function<Status()>& enqueue);

  std::map<std::pair<uint32_t, uint32_t>, Entry> entries_;
  uint64_t generation_ = 0;
  CudaGraphStats stats_;
};

}  // namespace tandem::engine
