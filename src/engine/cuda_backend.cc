#include "engine/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "engine/cuda_backend_impl.h"
#include "engine/llama_forward.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace tandem::engine {
namespace cuda_detail {

Status CudaBackend::Grow(DeviceMem& m, size_t bytes, std::string_view what) {
  const void* before = m.as<void>();
  TANDEM_RETURN_IF_ERROR(m.Reserve(bytes, what));
  if (m.as<void>() != before) ++scratch_generation_;  // captured graphs point at the old one
  return Status::Ok();
}

Status CudaBackend::Forward(std::span<const SeqChunk> batch, std::span<float> logits) {
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  // The rank's heads, KV heads and intermediate columns (all of them at tp = 1).
  const int heads = static_cast<int>(shard_.heads.size());
  const int kvh = static_cast<int>(shard_.kv_heads.size());
  const int inter = static_cast<int>(shard_.inter.size());
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
  if (tp_comm_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(Grow(reduce_, size_t{total} * hidden * sizeof(float), "activations"));
  }
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
    if (tp_comm_ != nullptr) {
      TANDEM_RETURN_IF_ERROR(Grow(part_logits_, size_t(R) * shard_.vocab.size() * sizeof(float),
                                  "logits"));
    }
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
  TANDEM_RETURN_IF_ERROR(CopyLogits(logits, real_rows, R));
  return FromCuda(cudaStreamSynchronize(stream_), "forward step");
}

Status CudaBackend::Enqueue(const StepShape& sh) {
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  const int heads = static_cast<int>(shard_.heads.size());  // the rank's
  const int kvh = static_cast<int>(shard_.kv_heads.size());
  const int inter = static_cast<int>(shard_.inter.size());
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
    TANDEM_RETURN_IF_ERROR(RowParallel(attn, L.o, L.o_bias, o, T, heads * hd));
    TANDEM_KERNEL_RETURN(kc::AddRmsNorm(x, o, L.post_norm.as<bf16>(), eps, h, T, hidden, stream_), "norm");
    TANDEM_RETURN_IF_ERROR(gemm(h, L.gate_up, DeviceMem(), gu, 2 * inter, hidden));
    TANDEM_KERNEL_RETURN(kc::SiluMul(gu, gu + inter, act, T, inter, 2 * inter, stream_), "SwiGLU");
    TANDEM_RETURN_IF_ERROR(RowParallel(act, L.down, DeviceMem(), o, T, inter));
    residual_in = o;
  }
  // Final residual add and norm, then the logit rows only.
  TANDEM_KERNEL_RETURN(kc::AddRmsNorm(x, residual_in, final_norm_.as<bf16>(), eps, h, T, hidden, stream_), "final norm");
  if (R > 0) {
    TANDEM_KERNEL_RETURN(kc::EmbeddingGather(h, d_rows, rows_.as<bf16>(), R, hidden, T, stream_), "row gather");
    TANDEM_RETURN_IF_ERROR(LmHead(R));
  }
  return Status::Ok();
}

}  // namespace cuda_detail

using cuda_detail::CudaBackend;
namespace kc = kernels::cuda;

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
  // The shard next (before any CUDA call): a layout the backend cannot run
  // is a configuration error on any machine.
  const parallel::ParallelLayout& layout = opts.shard.layout;
  if (layout.pp != 1) {
    return UnimplementedError(fmt::format(
        "backend cuda: pipeline_parallel {} is not supported by the cuda backend (tensor "
        "parallel only; pipeline stages run on cpu ranks)",
        layout.pp));
  }
  TANDEM_RETURN_IF_ERROR(parallel::CheckLayout(layout, DimsOf(config)));
  if (opts.shard.rank >= layout.world()) {
    return InvalidArgumentError(fmt::format("backend cuda: rank {} of a {} group (ranks 0..{})",
                                            opts.shard.rank, parallel::ToString(layout),
                                            layout.world() - 1));
  }
  if (layout.tp > 1 && opts.tp_group.empty() && !opts.tp_comm_factory) {
    return InvalidArgumentError(fmt::format(
        "backend cuda: tensor_parallel {} needs the tensor ranks' group name "
        "(CudaBackendOptions::tp_group)",
        layout.tp));
  }
  if (layout.tp > 1) {
    // The collectives wait for the device between launches (NCCL calls are
    // not captured into graphs): decode steps run eagerly, padded as ever.
    opts.cuda_graphs = false;
  }
  const KvLayout& kv = pool->layout();
  const KvLayout want = ShardKvLayout(config, opts.shard, kv.block_size);
  if (kv.num_layers != want.num_layers || kv.num_kv_heads != want.num_kv_heads ||
      kv.head_dim != want.head_dim) {
    return InvalidArgumentError(fmt::format(
        "backend cuda: KV pool geometry ({} layers, {} KV heads, head_dim {}) does not match "
        "rank {} of {} ({} layers, {} KV heads, head_dim {})",
        kv.num_layers, kv.num_kv_heads, kv.head_dim, opts.shard.rank, parallel::ToString(layout),
        want.num_layers, want.num_kv_heads, want.head_dim));
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
  auto backend = std::make_unique<CudaBackend>(config, pool, opts);
  TANDEM_RETURN_IF_ERROR(backend->Init(weights));
  spdlog::info("backend cuda: device {}, rank {} of {}, {:.2f} GiB of bf16 weights, batch_invariant {}, "
               "decode CUDA graphs {}",
               opts.device, opts.shard.rank, parallel::ToString(layout),
               backend->weight_bytes() / 1073741824.0, opts.batch_invariant,
               opts.cuda_graphs ? "on"
               : layout.tp > 1
                   ? "off (tensor parallel: NCCL calls are not captured)"
                   : "off (TANDEM_CUDA_GRAPHS=0): decode steps run eagerly");
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

CudaGraphStats GetCudaGraphStats(const ComputeBackend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->graph_stats() : CudaGraphStats{};
}

}  // namespace tandem::engine
