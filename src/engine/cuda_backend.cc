#include "engine/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "engine/cuda_device_mem.h"
#include "engine/cuda_graphs.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/reference/ops.h"
#include "model/safetensors.h"

namespace tandem::engine {
namespace {

namespace kc = kernels::cuda;
using kc::bf16;

constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

Status FromCuda(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::Ok();
  return InternalError(fmt::format("backend cuda: {}: {}", what, cudaGetErrorString(err)));
}

Status FromKernel(const kc::KernelStatus& st, std::string_view what) {
  if (st.ok()) return Status::Ok();
  char buf[512];
  const std::string msg = fmt::format("backend cuda: {}: {}", what, kc::DescribeStatus(st, buf, sizeof(buf)));
  switch (st.code) {
    case kc::KernelCode::kInvalidArgument: return InvalidArgumentError(msg);
    case kc::KernelCode::kUnsupported: return UnimplementedError(msg);
    default: return InternalError(msg);
  }
}

#define TANDEM_CUDA_RETURN(expr, what) TANDEM_RETURN_IF_ERROR(FromCuda((expr), (what)))
#define TANDEM_KERNEL_RETURN(expr, what) TANDEM_RETURN_IF_ERROR(FromKernel((expr), (what)))

// Host f32 values -> device bf16 (model::FloatToBfloat16: round to nearest
// even, as the loader's WeightFormat::kBf16), in pieces of at most 16 Mi
// values so the temporary stays small.
Status UploadBf16(const float* src, size_t n, bf16* dst) {
  constexpr size_t kPiece = size_t{16} << 20;
  std::vector<uint16_t> tmp(std::min(n, kPiece));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t len = std::min(kPiece, n - at);
    for (size_t i = 0; i < len; ++i) tmp[i] = model::FloatToBfloat16(src[at + i]);
    TANDEM_RETURN_IF_ERROR(FromCuda(
        cudaMemcpy(dst + at, tmp.data(), len * sizeof(uint16_t), cudaMemcpyHostToDevice),
        "uploading weights"));
  }
  return Status::Ok();
}

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(const model::ModelConfig& config, KvPool* pool, const CudaBackendOptions& options)
      : config_(config), pool_(pool), options_(options), graphs_(options.cuda_graphs) {}
  ~CudaBackend() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    gemm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (host_meta_ != nullptr) cudaFreeHost(host_meta_);
  }

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

  Status Init(const model::ModelWeights& w);
  Status Forward(std::span<const SeqChunk> batch, std::span<float> logits) override;
  const CudaGraphStats& graph_stats() const { return graphs_.stats(); }

 private:
  struct Layer {
    DeviceMem input_norm, post_norm;  // [hidden] bf16
    DeviceMem qkv;                    // [(heads + 2 kv_heads) * hd][hidden] bf16
    DeviceMem qkv_bias;               // [(heads + 2 kv_heads) * hd] bf16 or empty
    DeviceMem o, o_bias;              // [hidden][heads * hd], [hidden] or empty
    DeviceMem gate_up;                // [2 * inter][hidden] bf16
    DeviceMem down;                   // [hidden][inter] bf16
  };
  Status Upload(const std::vector<const model::Matrix*>& parts, uint32_t cols, DeviceMem* dst,
                std::string_view what);
  Status UploadVec(const std::vector<const std::vector<float>*>& parts, DeviceMem* dst,
                   std::string_view what);
  // What a step's launches depend on; a decode step's is fixed by its
  // graph key (batch bucket, table bucket).
  struct StepShape {
    int T = 0, R = 0, S = 0;  // tokens, logit rows, sequences
    int max_blocks = 0, max_q = 0, max_ctx = 0;
    bool decode_kernel = false;
    size_t ws_bytes = 0;  // decode attention workspace
  };
  // Every launch of a step on stream_, from meta_ and the scratch buffers;
  // no allocation, copy or synchronization (it is what a graph captures).
  Status Enqueue(const StepShape& sh);
  // Reserve that counts reallocations (graphs hold the old pointers).
  Status Grow(DeviceMem& m, size_t bytes, std::string_view what);

  model::ModelConfig config_;
  KvPool* pool_;  // borrowed: only its geometry and block count are used
  CudaBackendOptions options_;
  size_t weight_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kc::GemmContext> gemm_;
  DeviceMem gemm_ws_;
  DeviceMem embed_, final_norm_, lm_head_, inv_freq_;  // lm_head_ empty when tied
  std::vector<Layer> layers_;
  DeviceMem kv_;  // [num_blocks][block elems] bf16
  kc::DeviceKvView view_;

  // Per-step scratch, grown as needed. T tokens, R logit rows, S sequences.
  DeviceMem x_;        // [T][hidden] f32 residual
  DeviceMem h_;        // [T][hidden] bf16 normed input
  DeviceMem qkv_act_;  // [T][qkv] bf16
  DeviceMem attn_;     // [T][heads * hd] bf16
  DeviceMem o_act_;    // [T][hidden] bf16
  DeviceMem gu_act_;   // [T][2 * inter] bf16
  DeviceMem act_;      // [T][inter] bf16
  DeviceMem rows_;     // [R][hidden] bf16
  DeviceMem logits_;   // [R][vocab] f32
  DeviceMem attn_ws_;  // decode split workspace
  DeviceMem meta_;     // int32 metadata, layout below
  int32_t* host_meta_ = nullptr;  // pinned mirror of meta_
  size_t host_meta_elems_ = 0;
  uint64_t scratch_generation_ = 0;  // bumped when a scratch buffer moves
  CudaGraphCache graphs_;
};

Status CudaBackend::Upload(const std::vector<const model::Matrix*>& parts, uint32_t cols,
                           DeviceMem* dst, std::string_view what) {
  size_t rows = 0;
  for (const model::Matrix* m : parts) {
    const size_t n = size_t{m->rows} * m->cols;
    // Either f32 (`data`) or bf16 bits (`bf16`, WeightFormat::kBf16).
    if (m->cols != cols || (m->data.size() != n && m->bf16.size() != n)) {
      return InvalidArgumentError(fmt::format("weights: {} is [{}][{}]; expected {} columns", what,
                                              m->rows, m->cols, cols));
    }
    rows += m->rows;
  }
  TANDEM_RETURN_IF_ERROR(dst->Allocate(rows * cols * sizeof(bf16), what));
  size_t at = 0;
  for (const model::Matrix* m : parts) {
    const size_t n = size_t{m->rows} * m->cols;
    if (m->bf16.size() == n) {  // already bf16: bit copy
      TANDEM_CUDA_RETURN(cudaMemcpy(dst->as<bf16>() + at, m->bf16.data(), n * sizeof(uint16_t),
                                    cudaMemcpyHostToDevice),
                         "uploading weights");
    } else {
      TANDEM_RETURN_IF_ERROR(UploadBf16(m->data.data(), n, dst->as<bf16>() + at));
    }
    at += n;
  }
  weight_bytes_ += rows * cols * sizeof(bf16);
  return Status::Ok();
}

Status CudaBackend::UploadVec(const std::vector<const std::vector<float>*>& parts, DeviceMem* dst,
                              std::string_view what) {
  size_t n = 0;
  for (const auto* p : parts) n += p->size();
  TANDEM_RETURN_IF_ERROR(dst->Allocate(n * sizeof(bf16), what));
  size_t at = 0;
  for (const auto* p : parts) {
    TANDEM_RETURN_IF_ERROR(UploadBf16(p->data(), p->size(), dst->as<bf16>() + at));
    at += p->size();
  }
  weight_bytes_ += n * sizeof(bf16);
  return Status::Ok();
}

Status CudaBackend::Init(const model::ModelWeights& w) {
  const auto& c = config_;
  const uint32_t hidden = c.hidden_size, hd = c.head_dim, heads = c.num_attention_heads;
  const uint32_t kvh = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  if (hidden == 0 || heads == 0 || kvh == 0 || heads % kvh != 0 || inter == 0 || vocab == 0) {
    return InvalidArgumentError("backend cuda: model config has a zero or inconsistent size");
  }
  if (hd != 16 && hd != 32 && hd != 64 && hd != 128) {
    return UnimplementedError(
        fmt::format("backend cuda: head_dim {} (kernels exist for 16, 32, 64 and 128)", hd));
  }
  if (c.sliding_window != 0) {
    return UnimplementedError("backend cuda: sliding-window attention is not implemented");
  }
  if (w.layers.size() != c.num_hidden_layers) {
    return InvalidArgumentError(fmt::format("weights: {} layers; config.json says {}",
                                            w.layers.size(), c.num_hidden_layers));
  }
  TANDEM_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  TANDEM_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  TANDEM_RETURN_IF_ERROR(gemm_ws_.Allocate(kGemmWorkspaceBytes, "the cuBLASLt workspace"));
  TANDEM_KERNEL_RETURN(kc::GemmContext::Create(gemm_ws_.as<void>(), kGemmWorkspaceBytes,
                                               options_.batch_invariant, &gemm_),
                       "cuBLASLt");

  if (w.embed_tokens.rows != vocab) {
    return InvalidArgumentError(fmt::format("weights: model.embed_tokens.weight has {} rows; vocab is {}",
                                            w.embed_tokens.rows, vocab));
  }
  TANDEM_RETURN_IF_ERROR(Upload({&w.embed_tokens}, hidden, &embed_, "model.embed_tokens.weight"));
  if (w.norm.size() != hidden) return InvalidArgumentError("weights: model.norm.weight size");
  TANDEM_RETURN_IF_ERROR(UploadVec({&w.norm}, &final_norm_, "model.norm.weight"));
  if (w.lm_head.rows != 0) {
    if (w.lm_head.rows != vocab) return InvalidArgumentError("weights: lm_head.weight rows != vocab");
    TANDEM_RETURN_IF_ERROR(Upload({&w.lm_head}, hidden, &lm_head_, "lm_head.weight"));
  }
  layers_.resize(c.num_hidden_layers);
  for (uint32_t i = 0; i < c.num_hidden_layers; ++i) {
    const model::LayerWeights& lw = w.layers[i];
    Layer& L = layers_[i];
    const std::string p = fmt::format("model.layers.{}.", i);
    if (lw.input_layernorm.size() != hidden || lw.post_attention_layernorm.size() != hidden ||
        lw.q_proj.rows != heads * hd || lw.k_proj.rows != kvh * hd || lw.v_proj.rows != kvh * hd ||
        lw.o_proj.rows != hidden || lw.gate_proj.rows != inter || lw.up_proj.rows != inter ||
        lw.down_proj.rows != hidden) {
      return InvalidArgumentError(fmt::format("weights: {}* do not match the config's shapes", p));
    }
    TANDEM_RETURN_IF_ERROR(UploadVec({&lw.input_layernorm}, &L.input_norm, p + "input_layernorm"));
    TANDEM_RETURN_IF_ERROR(UploadVec({&lw.post_attention_layernorm}, &L.post_norm, p + "post_attention_layernorm"));
    TANDEM_RETURN_IF_ERROR(Upload({&lw.q_proj, &lw.k_proj, &lw.v_proj}, hidden, &L.qkv, p + "self_attn.qkv"));
    if (!lw.q_bias.empty() || !lw.k_bias.empty() || !lw.v_bias.empty()) {
      if (lw.q_bias.size() != heads * hd || lw.k_bias.size() != kvh * hd || lw.v_bias.size() != kvh * hd) {
        return InvalidArgumentError(fmt::format("weights: {}self_attn q/k/v bias sizes", p));
      }
      TANDEM_RETURN_IF_ERROR(UploadVec({&lw.q_bias, &lw.k_bias, &lw.v_bias}, &L.qkv_bias, p + "qkv bias"));
    }
    TANDEM_RETURN_IF_ERROR(Upload({&lw.o_proj}, heads * hd, &L.o, p + "self_attn.o_proj"));
    if (!lw.o_bias.empty()) {
      if (lw.o_bias.size() != hidden) return InvalidArgumentError(fmt::format("weights: {}o_proj.bias size", p));
      TANDEM_RETURN_IF_ERROR(UploadVec({&lw.o_bias}, &L.o_bias, p + "o_proj bias"));
    }
    TANDEM_RETURN_IF_ERROR(Upload({&lw.gate_proj, &lw.up_proj}, hidden, &L.gate_up, p + "mlp.gate_up"));
    TANDEM_RETURN_IF_ERROR(Upload({&lw.down_proj}, inter, &L.down, p + "mlp.down_proj"));
  }

  std::vector<float> inv_freq(hd / 2);
  const auto& rope = c.rope;
  if (rope.type == "llama3") {
    kernels::RopeLlama3Scaling s;
    s.factor = static_cast<float>(rope.factor);
    s.low_freq_factor = static_cast<float>(rope.low_freq_factor);
    s.high_freq_factor = static_cast<float>(rope.high_freq_factor);
    s.original_max_position_embeddings = static_cast<int>(rope.original_max_position_embeddings);
    kernels::ref::RopeInvFreq(inv_freq.data(), static_cast<int>(hd), rope.theta, &s);
  } else if (rope.type == "linear") {
    kernels::ref::RopeInvFreq(inv_freq.data(), static_cast<int>(hd), rope.theta, nullptr,
                              static_cast<float>(rope.factor));
  } else if (rope.type == "default" || rope.type.empty()) {
    kernels::ref::RopeInvFreq(inv_freq.data(), static_cast<int>(hd), rope.theta);
  } else {
    return UnimplementedError(fmt::format("backend cuda: RoPE type '{}' is not supported", rope.type));
  }
  TANDEM_RETURN_IF_ERROR(inv_freq_.Allocate(inv_freq.size() * sizeof(float), "RoPE frequencies"));
  TANDEM_CUDA_RETURN(cudaMemcpy(inv_freq_.as<void>(), inv_freq.data(), inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice),
                     "uploading RoPE frequencies");

  // The device KV pool: as many blocks as the host pool, bf16, tight stride.
  const KvLayout& kl = pool_->layout();
  view_.num_layers = static_cast<int>(kl.num_layers);
  view_.kv_heads = static_cast<int>(kl.num_kv_heads);
  view_.head_dim = static_cast<int>(kl.head_dim);
  view_.block_size = static_cast<int>(kl.block_size);
  view_.block_stride = kl.block_floats();
  const size_t kv_bytes = view_.block_stride * pool_->num_blocks() * sizeof(bf16);
  if (options_.kv_pool != nullptr) {  // the transport's device pool (kvtransfer/staging)
    if (options_.kv_pool_bytes < kv_bytes) {
      return InvalidArgumentError(fmt::format(
          "backend cuda: the transport's device KV pool has {} bytes; {} blocks need {}",
          options_.kv_pool_bytes, pool_->num_blocks(), kv_bytes));
    }
    view_.pool = static_cast<bf16*>(options_.kv_pool);
  } else {
    TANDEM_RETURN_IF_ERROR(kv_.Allocate(kv_bytes, fmt::format("the KV pool ({} blocks)", pool_->num_blocks())));
    TANDEM_CUDA_RETURN(cudaMemset(kv_.as<void>(), 0, kv_.bytes()), "clearing the KV pool");
    view_.pool = kv_.as<bf16>();
  }
  return FromCuda(cudaDeviceSynchronize(), "initialization");
}

Status CudaBackend::Grow(DeviceMem& m, size_t bytes, std::string_view what) {
  const void* before = m.as<void>();
  TANDEM_RETURN_IF_ERROR(m.Reserve(bytes, what));
  if (m.as<void>() != before) ++scratch_generation_;  // captured graphs point at the old one
  return Status::Ok();
}

Status CudaBackend::Forward(std::span<const SeqChunk> batch, std::span<float> logits) {
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  const int heads = static_cast<int>(c.num_attention_heads);
  const int kvh = static_cast<int>(c.num_key_value_heads);
  const int inter = static_cast<int>(c.intermediate_size);
  const int vocab = static_cast<int>(c.vocab_size);
  const int bs = view_.block_size;
  const int qkv_dim = (heads + 2 * kvh) * hd;

  TANDEM_RETURN_IF_ERROR(CheckForwardBatch(batch, static_cast<size_t>(bs),
                                           c.max_position_embeddings, vocab, logits.size()));
  size_t total = 0, rows = 0, max_blocks = 0;
  int max_q = 0, max_ctx = 0;
  bool all_decode = true;  // one token per sequence: the decode kernel can run it
  bool graphable = true;   // ... and one logit row each: a decode step, padded
  for (const SeqChunk& s : batch) {
    const size_t end = size_t{s.start_pos} + s.tokens.size();
    total += s.tokens.size();
    rows += s.num_logits;
    max_blocks = std::max(max_blocks, s.block_table.size());
    max_q = std::max(max_q, static_cast<int>(s.tokens.size()));
    max_ctx = std::max(max_ctx, static_cast<int>(end));
    all_decode = all_decode && s.tokens.size() == 1;
    graphable = graphable && s.tokens.size() == 1 && s.num_logits == 1;
  }
  if (total == 0) return Status::Ok();
  if (max_blocks == 0) max_blocks = 1;
  const size_t real_rows = rows;
  // A decode step (one token and one logit row per sequence) is padded to
  // its batch bucket, and its block tables to their bucket, graphs or not:
  // the step's launches then depend on the key only, and turning graphs off
  // changes launch overhead, never bits (docs/cuda.md). Padding rows: token
  // 0 at position 0, no KV written (slot -1), attending to slot 0 of
  // block 0; their logits are dropped.
  const uint32_t bucket =
      graphable ? CudaGraphCache::BatchBucket(static_cast<uint32_t>(batch.size())) : 0;
  int S = static_cast<int>(batch.size());
  if (bucket != 0) {
    S = static_cast<int>(bucket);
    total = rows = bucket;
    max_blocks = CudaGraphCache::BlockBucket(static_cast<uint32_t>(max_blocks));
    max_ctx = static_cast<int>(max_blocks) * bs;
  }
  const int T = static_cast<int>(total), R = static_cast<int>(rows);
  TANDEM_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");

  // Metadata, one int32 array: tokens[T] positions[T] slots[T] rows[R]
  // q_starts[S] cu_q_lens[S+1] ctx_lens[S] tables[S][max_blocks].
  const size_t n_meta = 3 * size_t{total} + rows + 3 * size_t(S) + 1 + size_t(S) * max_blocks;
  if (host_meta_elems_ < n_meta) {
    if (host_meta_ != nullptr) cudaFreeHost(host_meta_);
    host_meta_ = nullptr;
    host_meta_elems_ = n_meta + n_meta / 2;
    TANDEM_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&host_meta_),
                                     host_meta_elems_ * sizeof(int32_t), cudaHostAllocDefault),
                       "pinned metadata buffer");
  }
  int32_t* tokens = host_meta_;
  int32_t* positions = tokens + total;
  int32_t* slots = positions + total;
  int32_t* row_ids = slots + total;
  int32_t* q_starts = row_ids + rows;
  int32_t* cu = q_starts + S;
  int32_t* ctx_lens = cu + S + 1;
  int32_t* tables = ctx_lens + S;
  size_t t = 0, r = 0;
  cu[0] = 0;
  for (int si = 0; si < S; ++si) {
    if (static_cast<size_t>(si) >= batch.size()) {  // padding row
      std::fill_n(tables + size_t(si) * max_blocks, max_blocks, 0);
      q_starts[si] = 0;
      cu[si + 1] = cu[si] + 1;
      ctx_lens[si] = 1;
      tokens[t] = 0;
      positions[t] = 0;
      slots[t] = -1;
      row_ids[r++] = static_cast<int32_t>(t++);
      continue;
    }
    const SeqChunk& s = batch[si];
    for (size_t b = 0; b < max_blocks; ++b) {
      if (b < s.block_table.size() && s.block_table[b] >= pool_->num_blocks()) {
        return InvalidArgumentError(fmt::format("forward: block id {} out of range (pool has {})",
                                                s.block_table[b], pool_->num_blocks()));
      }
      tables[size_t(si) * max_blocks + b] =
          b < s.block_table.size() ? static_cast<int32_t>(s.block_table[b]) : 0;
    }
    q_starts[si] = static_cast<int32_t>(s.start_pos);
    cu[si + 1] = cu[si] + static_cast<int32_t>(s.tokens.size());
    ctx_lens[si] = static_cast<int32_t>(s.start_pos + s.tokens.size());
    const size_t first_logit = t + s.tokens.size() - s.num_logits;
    for (size_t i = 0; i < s.tokens.size(); ++i, ++t) {
      if (s.tokens[i] >= c.vocab_size) {
        return InvalidArgumentError(fmt::format("token id {} is out of range (vocabulary of {})",
                                                s.tokens[i], c.vocab_size));
      }
      const uint32_t pos = s.start_pos + static_cast<uint32_t>(i);
      tokens[t] = static_cast<int32_t>(s.tokens[i]);
      positions[t] = static_cast<int32_t>(pos);
      slots[t] = static_cast<int32_t>(s.block_table[pos / bs]) * bs + static_cast<int32_t>(pos % bs);
    }
    for (size_t i = 0; i < s.num_logits; ++i) row_ids[r++] = static_cast<int32_t>(first_logit + i);
  }

  TANDEM_RETURN_IF_ERROR(Grow(meta_, n_meta * sizeof(int32_t), "step metadata"));
  TANDEM_RETURN_IF_ERROR(Grow(x_, size_t{total} * hidden * sizeof(float), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(h_, size_t{total} * hidden * sizeof(bf16), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(qkv_act_, size_t{total} * qkv_dim * sizeof(bf16), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(attn_, size_t{total} * heads * hd * sizeof(bf16), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(o_act_, size_t{total} * hidden * sizeof(bf16), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(gu_act_, size_t{total} * 2 * inter * sizeof(bf16), "activations"));
  TANDEM_RETURN_IF_ERROR(Grow(act_, size_t{total} * inter * sizeof(bf16), "activations"));
  StepShape sh;
  sh.T = T;
  sh.R = R;
  sh.S = S;
  sh.max_blocks = static_cast<int>(max_blocks);
  sh.max_q = max_q;
  sh.max_ctx = max_ctx;
  sh.decode_kernel = all_decode && !options_.batch_invariant;
  if (sh.decode_kernel) {
    sh.ws_bytes = kc::DecodeAttentionWorkspaceBytes(S, heads, hd, max_ctx);
    TANDEM_RETURN_IF_ERROR(Grow(attn_ws_, sh.ws_bytes, "attention workspace"));
  }
  if (R > 0) {
    TANDEM_RETURN_IF_ERROR(Grow(rows_, size_t(R) * hidden * sizeof(bf16), "logit rows"));
    TANDEM_RETURN_IF_ERROR(Grow(logits_, size_t(R) * vocab * sizeof(float), "logits"));
  }
  TANDEM_CUDA_RETURN(cudaMemcpyAsync(meta_.as<void>(), host_meta_, n_meta * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream_),
                     "uploading step metadata");
  if (bucket != 0) {
    TANDEM_RETURN_IF_ERROR(graphs_.Run({bucket, static_cast<uint32_t>(max_blocks)},
                                       scratch_generation_, stream_, [&] { return Enqueue(sh); }));
  } else {
    TANDEM_RETURN_IF_ERROR(Enqueue(sh));
  }
  if (real_rows > 0) {
    TANDEM_CUDA_RETURN(cudaMemcpyAsync(logits.data(), logits_.as<void>(),
                                       real_rows * vocab * sizeof(float), cudaMemcpyDeviceToHost,
                                       stream_),
                       "copying logits");
  }
  return FromCuda(cudaStreamSynchronize(stream_), "forward step");
}

Status CudaBackend::Enqueue(const StepShape& sh) {
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  const int heads = static_cast<int>(c.num_attention_heads);
  const int kvh = static_cast<int>(c.num_key_value_heads);
  const int inter = static_cast<int>(c.intermediate_size);
  const int vocab = static_cast<int>(c.vocab_size);
  const int qkv_dim = (heads + 2 * kvh) * hd;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int T = sh.T, R = sh.R, S = sh.S;
  const int32_t* d_meta = meta_.as<int32_t>();
  const int32_t* d_tokens = d_meta;
  const int32_t* d_positions = d_tokens + T;
  const int32_t* d_slots = d_positions + T;
  const int32_t* d_rows = d_slots + T;
  const int32_t* d_q_starts = d_rows + R;
  const int32_t* d_cu = d_q_starts + S;
  const int32_t* d_ctx = d_cu + S + 1;
  const int32_t* d_tables = d_ctx + S;

  float* x = x_.as<float>();
  bf16* h = h_.as<bf16>();
  bf16* qkv = qkv_act_.as<bf16>();
  bf16* attn = attn_.as<bf16>();
  bf16* o = o_act_.as<bf16>();
  bf16* gu = gu_act_.as<bf16>();
  bf16* act = act_.as<bf16>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto gemm = [&](const bf16* in, const DeviceMem& w, const DeviceMem& bias, void* out, int n, int k) {
    return FromKernel(gemm_->Gemm(in, w.as<bf16>(), bias.bytes() ? bias.as<bf16>() : nullptr, out,
                                  kc::GemmOutType::kBf16, T, n, k, stream_),
                      "GEMM");
  };

  // The residual stream x starts as the embeddings (bf16 -> f32).
  TANDEM_KERNEL_RETURN(kc::EmbeddingGather(embed_.as<bf16>(), d_tokens, h, T, hidden, vocab, stream_), "embedding");
  TANDEM_KERNEL_RETURN(kc::Bf16ToF32(h, x, size_t(T) * hidden, stream_), "embedding");
  const bf16* residual_in = nullptr;  // what AddRmsNorm adds to x first
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const int li = static_cast<int>(l);
    TANDEM_KERNEL_RETURN(kc::AddRmsNorm(x, residual_in, L.input_norm.as<bf16>(), eps, h, T, hidden, stream_), "norm");
    TANDEM_RETURN_IF_ERROR(gemm(h, L.qkv, L.qkv_bias, qkv, qkv_dim, hidden));
    bf16* q = qkv;
    bf16* k = qkv + heads * hd;
    bf16* v = k + kvh * hd;
    TANDEM_KERNEL_RETURN(kc::Rope(q, k, d_positions, inv_freq_.as<float>(), T, heads, kvh, hd, qkv_dim, qkv_dim, stream_), "RoPE");
    TANDEM_KERNEL_RETURN(kc::WriteKv(view_, li, k, v, d_slots, T, qkv_dim, stream_), "KV write");
    if (sh.decode_kernel) {
      TANDEM_KERNEL_RETURN(kc::PagedDecodeAttention(view_, li, q, attn, d_tables, d_ctx, S, heads, qkv_dim,
                                                    sh.max_blocks, sh.max_ctx, scale,
                                                    attn_ws_.as<void>(), sh.ws_bytes, stream_),
                           "decode attention");
    } else {
      TANDEM_KERNEL_RETURN(kc::PagedPrefillAttention(view_, li, q, attn, d_tables, d_q_starts, d_cu, S, heads,
                                                     qkv_dim, sh.max_blocks, sh.max_q, scale, stream_),
                           "prefill attention");
    }
    TANDEM_RETURN_IF_ERROR(gemm(attn, L.o, L.o_bias, o, hidden, heads * hd));
    TANDEM_KERNEL_RETURN(kc::AddRmsNorm(x, o, L.post_norm.as<bf16>(), eps, h, T, hidden, stream_), "norm");
    TANDEM_RETURN_IF_ERROR(gemm(h, L.gate_up, DeviceMem(), gu, 2 * inter, hidden));
    TANDEM_KERNEL_RETURN(kc::SiluMul(gu, gu + inter, act, T, inter, 2 * inter, stream_), "SwiGLU");
    TANDEM_RETURN_IF_ERROR(gemm(act, L.down, DeviceMem(), o, hidden, inter));
    residual_in = o;
  }
  // Final residual add and norm, then the logit rows only.
  TANDEM_KERNEL_RETURN(kc::AddRmsNorm(x, residual_in, final_norm_.as<bf16>(), eps, h, T, hidden, stream_), "final norm");
  if (R > 0) {
    TANDEM_KERNEL_RETURN(kc::EmbeddingGather(h, d_rows, rows_.as<bf16>(), R, hidden, T, stream_), "row gather");
    const DeviceMem& head = lm_head_.bytes() ? lm_head_ : embed_;
    TANDEM_KERNEL_RETURN(gemm_->Gemm(rows_.as<bf16>(), head.as<bf16>(), nullptr, logits_.as<void>(),
                                     kc::GemmOutType::kF32, R, vocab, hidden, stream_),
                         "LM head");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const model::ModelConfig& config,
                                                          const model::ModelWeights& weights,
                                                          KvPool* pool,
                                                          const CudaBackendOptions& options) {
  // The graph switch first: a bad value is a configuration error anywhere.
  CudaBackendOptions opts = options;
  if (const char* env = std::getenv("TANDEM_CUDA_GRAPHS"); env != nullptr) {
    const std::string_view v(env);
    if (v != "0" && v != "1") {
      return InvalidArgumentError(fmt::format(
          "backend cuda: TANDEM_CUDA_GRAPHS must be 0 (decode steps eager) or 1, got '{}'", v));
    }
    if (v == "0") opts.cuda_graphs = false;
  }
  char why[256] = "";
  const int n = kc::DeviceCount(why, sizeof(why));
  if (n == 0) {
    return FailedPreconditionError(fmt::format(
        "backend cuda: no usable CUDA device ({}); use model.backend: cpu on this machine", why));
  }
  if (opts.device < 0 || opts.device >= n) {
    return InvalidArgumentError(fmt::format("backend cuda: device {} does not exist ({} found)",
                                            options.device, n));
  }
  const KvLayout& kv = pool->layout();
  if (kv.num_layers != config.num_hidden_layers || kv.num_kv_heads != config.num_key_value_heads ||
      kv.head_dim != config.head_dim) {
    return InvalidArgumentError("backend cuda: KV pool geometry does not match the model");
  }
  auto backend = std::make_unique<CudaBackend>(config, pool, opts);
  TANDEM_RETURN_IF_ERROR(backend->Init(weights));
  spdlog::info("backend cuda: device {}, {:.2f} GiB of bf16 weights, batch_invariant {}, decode CUDA graphs {}",
               opts.device, backend->weight_bytes() / 1073741824.0, opts.batch_invariant,
               opts.cuda_graphs ? "on" : "off (TANDEM_CUDA_GRAPHS=0): decode steps run eagerly");
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

CudaGraphStats GetCudaGraphStats(const ComputeBackend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->graph_stats() : CudaGraphStats{};
}

}  // namespace tandem::engine
