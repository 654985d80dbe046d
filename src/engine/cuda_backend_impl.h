// The cuda backend's class, shared by its two files (internal to
// src/engine): cuda_backend.cc runs steps (Forward, Enqueue, creation) and
// cuda_backend_shard.cc loads the rank's shard of the weights and holds the
// tensor-parallel collectives (issue 18, docs/parallelism.md "CUDA").
//
// Thread-safety: as engine/cuda_backend.h (the engine thread only).
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_device_mem.h"
#include "engine/cuda_graphs.h"
#include "kernels/cuda/common.h"
#include "kernels/cuda/gemm.h"
#include "parallel/communicator.h"
#include "parallel/parallel_layout.h"

namespace tandem::engine::cuda_detail {

namespace kc = kernels::cuda;
using kc::bf16;

inline Status FromCuda(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::Ok();
  return InternalError(fmt::format("backend cuda: {}: {}", what, cudaGetErrorString(err)));
}

inline Status FromKernel(const kc::KernelStatus& st, std::string_view what) {
  if (st.ok()) return Status::Ok();
  char buf[512];
  const std::string msg =
      fmt::format("backend cuda: {}: {}", what, kc::DescribeStatus(st, buf, sizeof(buf)));
  switch (st.code) {
    case kc::KernelCode::kInvalidArgument: return InvalidArgumentError(msg);
    case kc::KernelCode::kUnsupported: return UnimplementedError(msg);
    default: return InternalError(msg);
  }
}

#define TANDEM_CUDA_RETURN(expr, what) TANDEM_RETURN_IF_ERROR(FromCuda((expr), (what)))
#define TANDEM_KERNEL_RETURN(expr, what) TANDEM_RETURN_IF_ERROR(FromKernel((expr), (what)))

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(const model::ModelConfig& config, KvPool* pool, const CudaBackendOptions& options)
      : config_(config), pool_(pool), options_(options), graphs_(options.cuda_graphs) {}
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  bool Supports(BackendFeature feature) const override {
    switch (feature) {
      case BackendFeature::kRealMath: return true;
      case BackendFeature::kBatchInvariant: return options_.batch_invariant;
      case BackendFeature::kHostKvPool: return false;
      case BackendFeature::kDeviceKvPool: return true;
    }
    return false;
  }
  uint32_t vocab_size() const override { return config_.vocab_size; }
  size_t weight_bytes() const override { return weight_bytes_; }

  // Device, stream, cuBLASLt, the tensor ranks' NCCL communicator (tp > 1),
  // the rank's weights, RoPE table and device KV pool (cuda_backend_shard.cc).
  Status Init(const model::ModelWeights& w);
  Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) override;
  const CudaGraphStats& graph_stats() const { return graphs_.stats(); }

 private:
  struct Layer {
    DeviceMem input_norm, post_norm;  // [hidden] bf16
    DeviceMem qkv;       // [(heads + 2 kv_heads) * hd][hidden] bf16, the rank's heads
    DeviceMem qkv_bias;  // [(heads + 2 kv_heads) * hd] bf16 or empty
    DeviceMem o;         // [hidden][heads * hd]: the rank's input columns
    DeviceMem o_bias;    // [hidden] or empty; added once, after the all-reduce
    DeviceMem gate_up;   // [2 * inter][hidden] bf16, the rank's intermediate rows
    DeviceMem down;      // [hidden][inter] bf16: the rank's input columns
  };
  // What one tensor rank holds (whole model dimensions at tp = 1).
  struct Shard {
    parallel::ParallelLayout layout;  // pp == 1 on cuda
    uint32_t tp_rank = 0;
    parallel::Range heads, kv_heads, inter, vocab;  // model indices
  };
  // Rows `rows` and columns `cols` of a weight matrix (f32 or bf16 bits).
  struct Slice {
    const model::Matrix* m = nullptr;
    parallel::Range rows, cols;
  };
  struct VecSlice {
    const std::vector<float>* v = nullptr;
    parallel::Range range;
  };
  // The slices stacked row-wise into one bf16 device matrix; every matrix
  // must have `full_cols` columns and every slice the same width.
  Status Upload(const std::vector<Slice>& parts, uint32_t full_cols, DeviceMem* dst,
                std::string_view what);
  Status UploadVec(const std::vector<VecSlice>& parts, DeviceMem* dst, std::string_view what);
  Status UploadLayer(const model::LayerWeights& lw, uint32_t index, Layer* layer);
  // shard_ from options_.shard, and (tp > 1) the NCCL communicator on stream_.
  Status InitShard();
  // What a step's launches depend on; a decode step's is fixed by its
  // graph key (batch bucket, table bucket).
  struct StepShape {
    int T = 0, R = 0, S = 0;  // tokens, logit rows, sequences
    int max_blocks = 0, max_q = 0, max_ctx = 0;
    bool decode_kernel = false;
    size_t ws_bytes = 0;  // decode attention workspace
  };
  // Every launch of a step on stream_, from meta_ and the scratch buffers;
  // no allocation, copy or synchronization (it is what a graph captures) --
  // except the collectives of tp > 1, which wait for the device (graphs are
  // off then).
  Status Enqueue(const StepShape& sh);
  // out[T][hidden] (bf16) = in[T][k] · w^T summed over the tensor ranks,
  // plus bias once (a row-parallel GEMM: o_proj, down_proj).
  Status RowParallel(const bf16* in, const DeviceMem& w, const DeviceMem& bias, bf16* out, int T,
                     int k);
  // logits_ = the R rows' logits: [R][vocab] at tp = 1, [tp][R][vocab / tp]
  // (every rank's vocabulary slice, all-gathered) otherwise.
  Status LmHead(int R);
  // The first `real_rows` rows of logits_ into the caller's [rows][vocab].
  Status CopyLogits(std::span<float> logits, size_t real_rows, int R);
  // Reserve that counts reallocations (graphs hold the old pointers).
  Status Grow(DeviceMem& m, size_t bytes, std::string_view what);

  model::ModelConfig config_;
  KvPool* pool_;  // borrowed: only its geometry and block count are used
  CudaBackendOptions options_;
  Shard shard_;
  size_t weight_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kc::GemmContext> gemm_;
  // NCCL between the tensor ranks, enqueuing on stream_; null when tp == 1.
  std::unique_ptr<parallel::Communicator> tp_comm_;
  DeviceMem gemm_ws_;
  // The embedding table is whole on every rank (replicated); lm_head_ holds
  // the rank's vocabulary rows, empty when tied (the head is then the
  // embedding table's rows of the rank's vocabulary).
  DeviceMem embed_, final_norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
  DeviceMem kv_;  // [num_blocks][block elems] bf16, the rank's KV heads
  kc::DeviceKvView view_;

  // Per-step scratch, grown as needed. T tokens, R logit rows, S sequences;
  // heads, kv_heads, inter: the rank's.
  DeviceMem x_;        // [T][hidden] f32 residual
  DeviceMem h_;        // [T][hidden] bf16 normed input
  DeviceMem qkv_act_;  // [T][qkv] bf16
  DeviceMem attn_;     // [T][heads * hd] bf16
  DeviceMem o_act_;    // [T][hidden] bf16
  DeviceMem gu_act_;   // [T][2 * inter] bf16
  DeviceMem act_;      // [T][inter] bf16
  DeviceMem rows_;     // [R][hidden] bf16
  DeviceMem logits_;   // [R][vocab] f32 (layout: LmHead)
  DeviceMem reduce_;       // [T][hidden] f32, tp > 1: partial sums, all-reduced
  DeviceMem part_logits_;  // [R][vocab / tp] f32, tp > 1
  DeviceMem attn_ws_;  // decode split workspace
  DeviceMem meta_;     // int32 metadata, layout below
  int32_t* host_meta_ = nullptr;  // pinned mirror of meta_
  size_t host_meta_elems_ = 0;
  uint64_t scratch_generation_ = 0;  // bumped when a scratch buffer moves
  CudaGraphCache graphs_;
};

}  // namespace tandem::engine::cuda_detail
