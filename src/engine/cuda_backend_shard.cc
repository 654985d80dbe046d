// The cuda backend's weights and tensor parallelism (issue 18,
// docs/parallelism.md "CUDA"): each tensor rank uploads only its shard --
// q/k/v and gate/up column slices (sliced first, then fused), o/down row
// slices (their input columns) followed by an NCCL all-reduce, its
// vocabulary rows of the LM head followed by an all-gather -- while the
// embedding table is replicated. At tp = 1 the slices are whole and nothing
// differs from the single-device backend.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_backend_impl.h"
#include "engine/llama_forward.h"
#include "kernels/cuda/tp_ops.h"
#include "kernels/reference/ops.h"
#include "model/safetensors.h"
#include "parallel/nccl_communicator.h"
#include "parallel/shm_communicator.h"

namespace tandem::engine::cuda_detail {
namespace {

constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;
// Host staging of an upload: at most this many values at a time.
constexpr size_t kUploadPiece = size_t{16} << 20;
// The NCCL bootstrap group carries one ncclUniqueId.
constexpr size_t kBootstrapBytes = 4096;

parallel::Range All(uint32_t n) { return {0, n}; }
parallel::Range Times(parallel::Range r, uint32_t k) { return {r.begin * k, r.end * k}; }

}  // namespace

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  tp_comm_.reset();  // enqueues on stream_: gone before the stream
  gemm_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (host_meta_ != nullptr) cudaFreeHost(host_meta_);
}

Status CudaBackend::Upload(const std::vector<Slice>& parts, uint32_t full_cols, DeviceMem* dst,
                           std::string_view what) {
  const uint32_t width = parts.empty() ? 0 : parts[0].cols.size();
  size_t rows = 0;
  for (const Slice& p : parts) {
    const model::Matrix* m = p.m;
    const size_t n = size_t{m->rows} * m->cols;
    // Either f32 (`data`) or bf16 bits (`bf16`, WeightFormat::kBf16).
    if (m->cols != full_cols || (m->data.size() != n && m->bf16.size() != n)) {
      return InvalidArgumentError(fmt::format("weights: {} is [{}][{}]; expected {} columns", what,
                                              m->rows, m->cols, full_cols));
    }
    if (p.rows.begin > p.rows.end || p.rows.end > m->rows || p.cols.begin > p.cols.end ||
        p.cols.end > m->cols || p.cols.size() != width) {
      return InternalError(fmt::format("backend cuda: {}: slice rows [{}, {}) cols [{}, {}) of [{}][{}]",
                                       what, p.rows.begin, p.rows.end, p.cols.begin, p.cols.end,
                                       m->rows, m->cols));
    }
    rows += p.rows.size();
  }
  TANDEM_RETURN_IF_ERROR(dst->Allocate(rows * width * sizeof(bf16), what));
  if (rows == 0 || width == 0) return Status::Ok();
  const size_t piece_rows = std::max<size_t>(1, kUploadPiece / width);
  std::vector<uint16_t> tmp(std::min(rows, piece_rows) * width);
  size_t at = 0;  // elements written
  for (const Slice& p : parts) {
    const model::Matrix& m = *p.m;
    const bool is_bf16 = m.bf16.size() == size_t{m.rows} * m.cols;  // bit copy, else round
    for (size_t r0 = p.rows.begin; r0 < p.rows.end; r0 += piece_rows) {
      const size_t nr = std::min<size_t>(piece_rows, p.rows.end - r0);
      for (size_t i = 0; i < nr; ++i) {
        const size_t src = (r0 + i) * m.cols + p.cols.begin;
        uint16_t* d = tmp.data() + i * width;
        if (is_bf16) {
          std::memcpy(d, m.bf16.data() + src, width * sizeof(uint16_t));
        } else {
          for (uint32_t j = 0; j < width; ++j) d[j] = model::FloatToBfloat16(m.data[src + j]);
        }
      }
      TANDEM_CUDA_RETURN(cudaMemcpy(dst->as<bf16>() + at, tmp.data(), nr * width * sizeof(uint16_t),
                                    cudaMemcpyHostToDevice),
                         "uploading weights");
      at += nr * width;
    }
  }
  weight_bytes_ += rows * width * sizeof(bf16);
  return Status::Ok();
}

Status CudaBackend::UploadVec(const std::vector<VecSlice>& parts, DeviceMem* dst,
                              std::string_view what) {
  size_t n = 0;
  for (const VecSlice& p : parts) {
    if (p.range.begin > p.range.end || p.range.end > p.v->size()) {
      return InternalError(fmt::format("backend cuda: {}: slice [{}, {}) of {} values", what,
                                       p.range.begin, p.range.end, p.v->size()));
    }
    n += p.range.size();
  }
  TANDEM_RETURN_IF_ERROR(dst->Allocate(n * sizeof(bf16), what));
  std::vector<uint16_t> tmp(n);
  size_t at = 0;
  for (const VecSlice& p : parts) {
    for (uint32_t i = p.range.begin; i < p.range.end; ++i) {
      tmp[at++] = model::FloatToBfloat16((*p.v)[i]);
    }
  }
  if (n > 0) {
    TANDEM_CUDA_RETURN(cudaMemcpy(dst->as<void>(), tmp.data(), n * sizeof(uint16_t),
                                  cudaMemcpyHostToDevice),
                       "uploading weights");
  }
  weight_bytes_ += n * sizeof(bf16);
  return Status::Ok();
}

Status CudaBackend::InitShard() {
  const auto& c = config_;
  const parallel::ParallelLayout& l = options_.shard.layout;  // checked by CreateCudaBackend
  shard_.layout = l;
  shard_.tp_rank = l.tp_rank_of(options_.shard.rank);
  shard_.heads = parallel::TpHeads(l, c.num_attention_heads, shard_.tp_rank);
  shard_.kv_heads = parallel::TpKvHeads(l, c.num_key_value_heads, shard_.tp_rank);
  shard_.inter = parallel::TpSlice(l, c.intermediate_size, shard_.tp_rank);
  shard_.vocab = parallel::TpSlice(l, c.vocab_size, shard_.tp_rank);
  if (l.tp == 1) return Status::Ok();
  const int tp = static_cast<int>(l.tp), rank = static_cast<int>(shard_.tp_rank);
  if (options_.tp_comm_factory) {  // tests: two ranks on one device
    auto made = options_.tp_comm_factory(stream_);
    if (!made.ok()) return made.status();
    tp_comm_ = std::move(made).value();
    if (tp_comm_ == nullptr || tp_comm_->size() != tp || tp_comm_->rank() != rank) {
      return InvalidArgumentError(fmt::format(
          "backend cuda: tp_comm_factory made no communicator of rank {} of {}", rank, tp));
    }
    return Status::Ok();
  }
  auto bootstrap = parallel::ShmCommunicator::Join(options_.tp_group, rank, tp,
                                                   options_.tp_join_timeout_ms, kBootstrapBytes);
  if (!bootstrap.ok()) {
    return Status(bootstrap.status().code(),
                  fmt::format("backend cuda: tensor rank {} of {} joining group '{}': {}", rank, tp,
                              options_.tp_group, bootstrap.status().message()));
  }
  // On stream_: the collectives are ordered after the step's kernels.
  auto comm = parallel::NcclCommunicator::Create(std::move(bootstrap).value(), options_.device,
                                                 stream_, options_.tp_join_timeout_ms);
  if (!comm.ok()) {
    return Status(comm.status().code(),
                  fmt::format("backend cuda: tensor rank {} of {} on device {}: {}", rank, tp,
                              options_.device, comm.status().message()));
  }
  tp_comm_ = std::move(comm).value();
  return Status::Ok();
}

Status CudaBackend::UploadLayer(const model::LayerWeights& lw, uint32_t i, Layer* layer) {
  const auto& c = config_;
  const uint32_t hidden = c.hidden_size, hd = c.head_dim, heads = c.num_attention_heads;
  const uint32_t kvh = c.num_key_value_heads, inter = c.intermediate_size;
  Layer& L = *layer;
  const std::string p = fmt::format("model.layers.{}.", i);
  if (lw.input_layernorm.size() != hidden || lw.post_attention_layernorm.size() != hidden ||
      lw.q_proj.rows != heads * hd || lw.k_proj.rows != kvh * hd || lw.v_proj.rows != kvh * hd ||
      lw.o_proj.rows != hidden || lw.gate_proj.rows != inter || lw.up_proj.rows != inter ||
      lw.down_proj.rows != hidden) {
    return InvalidArgumentError(fmt::format("weights: {}* do not match the config's shapes", p));
  }
  // The rank's q rows (its heads) and k/v rows (its KV heads), and its
  // intermediate rows of gate and up: sliced, then fused.
  const parallel::Range q_rows = Times(shard_.heads, hd), kv_rows = Times(shard_.kv_heads, hd);
  const parallel::Range H = All(hidden);
  TANDEM_RETURN_IF_ERROR(UploadVec({{&lw.input_layernorm, H}}, &L.input_norm, p + "input_layernorm"));
  TANDEM_RETURN_IF_ERROR(UploadVec({{&lw.post_attention_layernorm, H}}, &L.post_norm,
                                   p + "post_attention_layernorm"));
  TANDEM_RETURN_IF_ERROR(Upload({{&lw.q_proj, q_rows, H}, {&lw.k_proj, kv_rows, H},
                                 {&lw.v_proj, kv_rows, H}},
                                hidden, &L.qkv, p + "self_attn.qkv"));
  if (!lw.q_bias.empty() || !lw.k_bias.empty() || !lw.v_bias.empty()) {
    if (lw.q_bias.size() != heads * hd || lw.k_bias.size() != kvh * hd || lw.v_bias.size() != kvh * hd) {
      return InvalidArgumentError(fmt::format("weights: {}self_attn q/k/v bias sizes", p));
    }
    TANDEM_RETURN_IF_ERROR(UploadVec({{&lw.q_bias, q_rows}, {&lw.k_bias, kv_rows},
                                      {&lw.v_bias, kv_rows}},
                                     &L.qkv_bias, p + "qkv bias"));
  }
  // o_proj: every output row, the input columns of the rank's heads.
  TANDEM_RETURN_IF_ERROR(Upload({{&lw.o_proj, H, q_rows}}, heads * hd, &L.o, p + "self_attn.o_proj"));
  if (!lw.o_bias.empty()) {
    if (lw.o_bias.size() != hidden) return InvalidArgumentError(fmt::format("weights: {}o_proj.bias size", p));
    TANDEM_RETURN_IF_ERROR(UploadVec({{&lw.o_bias, H}}, &L.o_bias, p + "o_proj bias"));
  }
  TANDEM_RETURN_IF_ERROR(Upload({{&lw.gate_proj, shard_.inter, H}, {&lw.up_proj, shard_.inter, H}},
                                hidden, &L.gate_up, p + "mlp.gate_up"));
  // down_proj: every output row, the rank's intermediate columns.
  return Upload({{&lw.down_proj, H, shard_.inter}}, inter, &L.down, p + "mlp.down_proj");
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
  TANDEM_RETURN_IF_ERROR(InitShard());

  if (w.embed_tokens.rows != vocab) {
    return InvalidArgumentError(fmt::format("weights: model.embed_tokens.weight has {} rows; vocab is {}",
                                            w.embed_tokens.rows, vocab));
  }
  // Replicated on every tensor rank (a step gathers its tokens' rows; no
  // collective), and the tied LM head's rows.
  TANDEM_RETURN_IF_ERROR(Upload({{&w.embed_tokens, All(vocab), All(hidden)}}, hidden, &embed_,
                                "model.embed_tokens.weight"));
  if (w.norm.size() != hidden) return InvalidArgumentError("weights: model.norm.weight size");
  TANDEM_RETURN_IF_ERROR(UploadVec({{&w.norm, All(hidden)}}, &final_norm_, "model.norm.weight"));
  if (w.lm_head.rows != 0) {
    if (w.lm_head.rows != vocab) return InvalidArgumentError("weights: lm_head.weight rows != vocab");
    TANDEM_RETURN_IF_ERROR(Upload({{&w.lm_head, shard_.vocab, All(hidden)}}, hidden, &lm_head_,
                                  "lm_head.weight"));
  }
  layers_.resize(c.num_hidden_layers);
  for (uint32_t i = 0; i < c.num_hidden_layers; ++i) {
    TANDEM_RETURN_IF_ERROR(UploadLayer(w.layers[i], i, &layers_[i]));
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

  // The device KV pool: as many blocks as the host pool, bf16, tight
  // stride, the rank's KV heads (ShardKvLayout, checked at creation).
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

Status CudaBackend::RowParallel(const bf16* in, const DeviceMem& w, const DeviceMem& bias, bf16* out,
                                int T, int k) {
  const int hidden = static_cast<int>(config_.hidden_size);
  const bf16* b = bias.bytes() ? bias.as<bf16>() : nullptr;
  if (tp_comm_ == nullptr) {  // the whole K here: bias in the GEMM's epilogue
    return FromKernel(gemm_->Gemm(in, w.as<bf16>(), b, out, kc::GemmOutType::kBf16, T, hidden, k,
                                  stream_),
                      "GEMM");
  }
  // f32 partial sums over the rank's K columns, summed over the ranks
  // (NCCL, on stream_; returns once done), rounded to bf16 with the bias.
  float* sum = reduce_.as<float>();
  TANDEM_KERNEL_RETURN(gemm_->Gemm(in, w.as<bf16>(), nullptr, sum, kc::GemmOutType::kF32, T, hidden,
                                   k, stream_),
                       "GEMM");
  TANDEM_RETURN_IF_ERROR(tp_comm_->AllReduceSum({sum, size_t(T) * hidden}));
  TANDEM_KERNEL_RETURN(kc::ReducedToBf16(sum, b, out, T, hidden, stream_), "all-reduced sum");
  return Status::Ok();
}

Status CudaBackend::LmHead(int R) {
  const int hidden = static_cast<int>(config_.hidden_size);
  const int vocab_l = static_cast<int>(shard_.vocab.size());
  // The rank's vocabulary rows: its lm_head_ slice, or those rows of the
  // (replicated) embedding table when tied.
  const bf16* head = lm_head_.bytes() ? lm_head_.as<bf16>()
                                      : embed_.as<bf16>() + size_t{shard_.vocab.begin} * hidden;
  if (tp_comm_ == nullptr) {
    return FromKernel(gemm_->Gemm(rows_.as<bf16>(), head, nullptr, logits_.as<void>(),
                                  kc::GemmOutType::kF32, R, vocab_l, hidden, stream_),
                      "LM head");
  }
  TANDEM_KERNEL_RETURN(gemm_->Gemm(rows_.as<bf16>(), head, nullptr, part_logits_.as<void>(),
                                   kc::GemmOutType::kF32, R, vocab_l, hidden, stream_),
                       "LM head");
  const size_t n = size_t(R) * vocab_l;
  return tp_comm_->AllGather({part_logits_.as<float>(), n},
                             {logits_.as<float>(), n * shard_.layout.tp});
}

Status CudaBackend::CopyLogits(std::span<float> logits, size_t real_rows, int R) {
  const size_t vocab = config_.vocab_size;
  if (real_rows == 0) return Status::Ok();
  if (tp_comm_ == nullptr) {
    return FromCuda(cudaMemcpyAsync(logits.data(), logits_.as<void>(), real_rows * vocab * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_),
                    "copying logits");
  }
  // [tp][R][vocab / tp] on the device -> [rows][vocab]: rank r's slice of
  // each row lands at columns r * vocab / tp.
  const size_t vocab_l = shard_.vocab.size();
  for (uint32_t r = 0; r < shard_.layout.tp; ++r) {
    TANDEM_CUDA_RETURN(cudaMemcpy2DAsync(logits.data() + r * vocab_l, vocab * sizeof(float),
                                         logits_.as<float>() + size_t{r} * R * vocab_l,
                                         vocab_l * sizeof(float), vocab_l * sizeof(float),
                                         real_rows, cudaMemcpyDeviceToHost, stream_),
                       "copying logits");
  }
  return Status::Ok();
}

}  // namespace tandem::engine::cuda_detail
