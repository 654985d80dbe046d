// The `cuda` compute backend: the Llama forward pass on one CUDA device with
// kernels/cuda and cuBLASLt. Weights live on the device in bf16 (q/k/v and
// gate/up fused), the KV cache in a device pool of bf16 blocks with the
// block order of the host pool (DESIGN.md section 4); activations are bf16,
// the residual stream f32, logits f32.
//
// The host KvPool the engine allocates is not where this backend's KV lives
// (Supports(kHostKvPool) is false, kDeviceKvPool true): a prefill or decode
// worker hands it the KV transport's device pool (CudaBackendOptions::kv_pool,
// kvtransfer/staging), so blocks move device to device (docs/cuda.md).
//
// Tensor parallel (issue 18, docs/parallelism.md "CUDA"): with
// CudaBackendOptions::shard of tp > 1 the backend holds one tensor rank's
// shard (one process and one device per rank) and joins the other ranks
// through NCCL; every rank runs Forward with the same batches and receives
// the whole logits. Pipeline parallel is not implemented on cuda.
//
// Thread-safety: as ComputeBackend. The backend owns one CUDA stream; create,
// use and destroy it on the engine thread (CUDA's current device is per
// thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/llama_forward.h"  // ShardSpec, ShardKvLayout

namespace tandem::engine {

struct CudaBackendOptions {
  int device = 0;
  // Fixed reduction orders whatever the batch or the chunking: attention of
  // decode steps runs in the prefill kernel, whose rows do not depend on
  // their neighbours, and GEMMs use one split-K-free algorithm per shape.
  bool batch_invariant = false;
  // The device KV pool, when the KV transport owns it (a prefill or decode
  // worker: the transport's pool is device memory, kvtransfer/staging):
  // at least num_blocks * block_floats bf16 elements, on `device`. Null:
  // the backend allocates its own (aggregated serving, `tandem generate`).
  void* kv_pool = nullptr;
  size_t kv_pool_bytes = 0;
  // Decode steps through CUDA graphs, one per batch bucket (engine/cuda_graphs.h).
  // The environment variable TANDEM_CUDA_GRAPHS=0 turns them off (for
  // comparison); padding to the bucket happens either way, so the switch
  // never changes a bit of the output.
  bool cuda_graphs = true;
  // The rank's shard (default: the whole model). layout.pp must be 1
  // (UNIMPLEMENTED otherwise); CheckLayout's rules apply. q/k/v and gate/up
  // are column slices, o/down row slices followed by an NCCL all-reduce,
  // the LM head the rank's vocabulary rows followed by an all-gather; the
  // embedding table is replicated. The pool has ShardKvLayout's geometry
  // (the rank's KV heads). With tp > 1 decode CUDA graphs are off.
  ShardSpec shard;
  // tp > 1: the tensor ranks' group, a name unique on the host and the same
  // on every rank (NCCL bootstraps over the shm group of that name; all
  // ranks on one host); `device` is this rank's device (normally tp_rank).
  // Creation blocks until every rank joined, at most tp_join_timeout_ms
  // (DEADLINE_EXCEEDED naming the missing ranks).
  std::string tp_group;
  int64_t tp_join_timeout_ms = 60000;
  // Tests only (tp > 1): makes the tensor ranks' communicator instead of
  // NCCL, given the backend's stream (a cudaStream_t). Its calls take device
  // buffers, must be ordered after the stream's work and return once done.
  // tests/gpu/cuda_tp_forward_test stages through the host over shm so that
  // two ranks can share one device (NCCL refuses two ranks on one device).
  std::function<Result<std::unique_ptr<parallel::Communicator>>(void* stream)> tp_comm_factory;
};

// FAILED_PRECONDITION with the runtime's reason when no CUDA device is
// usable; INVALID_ARGUMENT / UNIMPLEMENTED for weights or shapes it cannot
// run (head_dim other than 16, 32, 64 or 128, sliding windows); RESOURCE_EXHAUSTED
// when weights plus KV pool do not fit in device memory.
Result<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const model::ModelConfig& config,
                                                          const model::ModelWeights& weights,
                                                          KvPool* pool,
                                                          const CudaBackendOptions& options);

// CUDA graphs of decode steps (engine/cuda_graphs.h).
struct CudaGraphStats {
  bool enabled = false;
  uint64_t captures = 0;        // graphs captured and instantiated
  uint64_t replays = 0;         // steps run through a graph
  uint64_t eager_steps = 0;     // decode steps run eagerly (first sight, fallback or disabled)
  uint64_t failed_captures = 0; // keys that fell back to eager, reason logged
  uint64_t invalidations = 0;   // times every graph was dropped (buffers moved)
  std::string last_failure;     // CUDA's reason for the latest failed capture
};

// The graph counters of a backend made by CreateCudaBackend (zeros for any
// other backend): tests and benchmarks check that graphs really ran.
CudaGraphStats GetCudaGraphStats(const ComputeBackend& backend);

}  // namespace tandem::engine
