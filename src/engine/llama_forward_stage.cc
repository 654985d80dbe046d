// LlamaForward's forward pass: one rank's shard of one step (ForwardStage),
// and the whole model in one process (Forward = ForwardStage on the 1 x 1
// layout). See llama_forward.h and docs/parallelism.md.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "engine/llama_forward.h"

namespace tandem::engine {
namespace kc = kernels::cpu;
namespace {

template <class T>
void Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

Status CheckForwardBatch(std::span<const SeqChunk> batch, size_t block_size, size_t max_positions,
                         size_t vocab, size_t logits_size) {
  size_t rows = 0;
  for (const SeqChunk& s : batch) {
    if (s.num_logits > s.tokens.size()) {
      return InvalidArgumentError("forward: num_logits exceeds the chunk's tokens");
    }
    const size_t end = size_t{s.start_pos} + s.tokens.size();
    if (s.block_table.size() * block_size < end) {
      return InvalidArgumentError(fmt::format(
          "forward: block table of {} blocks cannot hold {} positions", s.block_table.size(), end));
    }
    if (max_positions != 0 && end > max_positions) {
      return InvalidArgumentError(
          fmt::format("forward: position {} beyond the model's context {}", end - 1, max_positions));
    }
    rows += s.num_logits;
  }
  if (logits_size < rows * vocab) {
    return InvalidArgumentError(
        fmt::format("forward: logits buffer holds {} floats; {} needed", logits_size, rows * vocab));
  }
  return Status::Ok();
}

Status LlamaForward::Forward(std::span<const SeqChunk> batch, const KvPool& kv,
                             std::span<float> logits, kc::ThreadPool* threads,
                             const std::function<void(uint32_t)>& on_layer_done) {
  if (shard_.layout.world() != 1) {
    return FailedPreconditionError(fmt::format(
        "forward: this is rank {} of a {} layout; use ForwardStage", shard_.rank,
        parallel::ToString(shard_.layout)));
  }
  return ForwardStage(batch, kv, StageIo{{}, {}, logits}, nullptr, threads, on_layer_done);
}

Status LlamaForward::CheckStage(std::span<const SeqChunk> batch, const KvPool& kv,
                                const StageIo& io, parallel::Communicator* tp_comm,
                                size_t tokens) const {
  const auto& c = config_;
  const size_t hidden = c.hidden_size;
  // Logits are required where they land: the last stage's tensor rank 0.
  const bool want_logits = last_stage_ && tp_rank_ == 0;
  TANDEM_RETURN_IF_ERROR(CheckForwardBatch(batch, kv.layout().block_size,
                                           c.max_position_embeddings, c.vocab_size,
                                           want_logits ? io.logits.size() : SIZE_MAX / 2));
  const KvLayout& l = kv.layout();
  if (l.num_layers != layers_range_.size() || l.num_kv_heads != kv_heads_.size() ||
      l.head_dim != c.head_dim) {
    return InvalidArgumentError(fmt::format(
        "forward: KV pool geometry (layers {}, kv heads {}, head_dim {}) does not match rank {} "
        "of {} (layers {}, kv heads {}, head_dim {})",
        l.num_layers, l.num_kv_heads, l.head_dim, shard_.rank, parallel::ToString(shard_.layout),
        layers_range_.size(), kv_heads_.size(), c.head_dim));
  }
  if (!first_stage_ && io.hidden_in.size() < tokens * hidden) {
    return InvalidArgumentError(fmt::format(
        "forward: stage {} needs hidden_in of {} floats ({} tokens x hidden {}); got {}", stage_,
        tokens * hidden, tokens, hidden, io.hidden_in.size()));
  }
  if (!last_stage_ && io.hidden_out.size() < tokens * hidden) {
    return InvalidArgumentError(fmt::format(
        "forward: stage {} needs hidden_out of {} floats ({} tokens x hidden {}); got {}", stage_,
        tokens * hidden, tokens, hidden, io.hidden_out.size()));
  }
  const uint32_t tp = shard_.layout.tp;
  if (tp > 1 && (tp_comm == nullptr || tp_comm->size() != static_cast<int>(tp) ||
                 tp_comm->rank() != static_cast<int>(tp_rank_))) {
    return InvalidArgumentError(fmt::format(
        "forward: tensor_parallel {} needs a communicator of size {} with this rank as {} (got {})",
        tp, tp, tp_rank_,
        tp_comm == nullptr ? std::string("none")
                           : fmt::format("rank {} of {}", tp_comm->rank(), tp_comm->size())));
  }
  return Status::Ok();
}

Status LlamaForward::RowParallel(const float* x, const kc::PackedWeights& w,
                                 const std::vector<int>& k_bounds, const std::vector<float>& bias,
                                 float* out, int T, parallel::Communicator* tp_comm,
                                 kc::ThreadPool* threads) {
  const int shards = static_cast<int>(k_bounds.size()) - 1;
  const size_t n = static_cast<size_t>(w.n());
  Grow(split_, static_cast<size_t>(shards - 1) * T * n);
  kc::GemmSplitK(x, w, k_bounds.data(), shards, out, split_.data(), T, threads);
  if (shard_.layout.tp > 1) {
    TANDEM_RETURN_IF_ERROR(tp_comm->AllReduceSum(std::span<float>(out, T * n)));
  }
  if (!bias.empty()) {
    for (int i = 0; i < T; ++i) {
      float* row = out + static_cast<size_t>(i) * n;
      for (size_t j = 0; j < n; ++j) row[j] += bias[j];
    }
  }
  return Status::Ok();
}

Status LlamaForward::ForwardStage(std::span<const SeqChunk> batch, const KvPool& kv, StageIo io,
                                  parallel::Communicator* tp_comm, kc::ThreadPool* threads,
                                  const std::function<void(uint32_t)>& on_layer_done) {
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  const int heads = static_cast<int>(heads_.size());
  const int kvh = static_cast<int>(kv_heads_.size());
  const int inter = static_cast<int>(inter_);
  const int bs = static_cast<int>(kv.layout().block_size);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const uint32_t tp = shard_.layout.tp;

  size_t total = 0, rows = 0, table_len = 0;
  for (const SeqChunk& s : batch) {
    total += s.tokens.size();
    rows += s.num_logits;
    table_len += s.block_table.size();
  }
  TANDEM_RETURN_IF_ERROR(CheckStage(batch, kv, io, tp_comm, total));
  if (total == 0) return Status::Ok();
  const int T = static_cast<int>(total);

  Grow(x_, total * hidden);
  Grow(h_, total * hidden);
  Grow(q_, total * heads * hd);
  Grow(k_, total * kvh * hd);
  Grow(v_, total * kvh * hd);
  Grow(attn_, total * heads * hd);
  Grow(o_, total * hidden);
  Grow(gate_, total * inter);
  Grow(up_, total * inter);
  Grow(positions_, total);
  Grow(slots_, total);
  tables_.resize(table_len);
  seqs_.resize(batch.size());

  // Token rows (stage 0: this rank's vocabulary slice of the embedding,
  // zeros elsewhere), positions, slots and per-sequence attention
  // descriptors.
  size_t t = 0, tb = 0;
  for (size_t si = 0; si < batch.size(); ++si) {
    const SeqChunk& s = batch[si];
    for (size_t b = 0; b < s.block_table.size(); ++b) {
      if (s.block_table[b] >= kv.num_blocks()) {
        return InvalidArgumentError(fmt::format("forward: block id {} out of range (pool has {})",
                                                s.block_table[b], kv.num_blocks()));
      }
      tables_[tb + b] = static_cast<int32_t>(s.block_table[b]);
    }
    seqs_[si].block_table = tables_.data() + tb;
    seqs_[si].q_start = static_cast<int>(s.start_pos);
    seqs_[si].q_len = static_cast<int>(s.tokens.size());
    for (size_t i = 0; i < s.tokens.size(); ++i, ++t) {
      const uint32_t id = s.tokens[i];
      if (id >= c.vocab_size) {
        return InvalidArgumentError(
            fmt::format("token id {} is out of range (vocabulary of {})", id, c.vocab_size));
      }
      if (first_stage_) {
        float* row = &x_[t * hidden];
        if (id >= vocab_.begin && id < vocab_.end) {
          std::memcpy(row, &embed_[size_t{id - vocab_.begin} * hidden], sizeof(float) * hidden);
        } else {
          std::memset(row, 0, sizeof(float) * hidden);
        }
      }
      const uint32_t pos = s.start_pos + static_cast<uint32_t>(i);
      positions_[t] = static_cast<int32_t>(pos);
      slots_[t] = tables_[tb + pos / bs] * bs + static_cast<int32_t>(pos % bs);
    }
    tb += s.block_table.size();
  }
  if (first_stage_ && tp > 1) {
    // One rank holds each token's row, the others add exact zeros.
    TANDEM_RETURN_IF_ERROR(tp_comm->AllReduceSum(std::span<float>(x_.data(), total * hidden)));
  }
  if (!first_stage_) {
    std::memcpy(x_.data(), io.hidden_in.data(), sizeof(float) * total * hidden);
  }

  kernels::KvCacheView view;
  view.pool = kv.base();
  view.block_stride = kv.layout().block_floats();
  view.num_layers = static_cast<int>(kv.layout().num_layers);
  view.kv_heads = kvh;
  view.head_dim = hd;
  view.block_size = bs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto bias = [](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };

  // x_ is the residual stream [T][hidden]; h_ the normed input of a sublayer.
  kc::RmsNorm(x_.data(), layers_[0].input_norm.data(), eps, h_.data(), T, hidden, threads);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const int li = static_cast<int>(l);
    kc::Gemm(h_.data(), L.q, bias(L.q_bias), q_.data(), T, threads);  // [T][heads*hd]
    kc::Gemm(h_.data(), L.k, bias(L.k_bias), k_.data(), T, threads);  // [T][kvh*hd]
    kc::Gemm(h_.data(), L.v, bias(L.v_bias), v_.data(), T, threads);  // [T][kvh*hd]
    kc::Rope(q_.data(), k_.data(), positions_.data(), inv_freq_.data(), T, heads, kvh, hd, threads);
    kc::WriteKv(view, li, k_.data(), v_.data(), slots_.data(), T);
    if (on_layer_done) on_layer_done(static_cast<uint32_t>(l + 1));
    kc::PagedAttentionBatch(view, li, q_.data(), attn_.data(), seqs_.data(),
                            static_cast<int>(seqs_.size()), heads, scale, threads);
    TANDEM_RETURN_IF_ERROR(
        RowParallel(attn_.data(), L.o, o_bounds_, L.o_bias, o_.data(), T, tp_comm, threads));
    kc::AddRmsNorm(x_.data(), o_.data(), L.post_norm.data(), eps, h_.data(), T, hidden, threads);
    kc::Gemm(h_.data(), L.gate, nullptr, gate_.data(), T, threads);  // [T][inter]
    kc::Gemm(h_.data(), L.up, nullptr, up_.data(), T, threads);      // [T][inter]
    kc::SiluMul(gate_.data(), up_.data(), gate_.data(), T, inter, threads);
    static const std::vector<float> kNoBias;
    TANDEM_RETURN_IF_ERROR(
        RowParallel(gate_.data(), L.down, down_bounds_, kNoBias, o_.data(), T, tp_comm, threads));
    const bool last = l + 1 == layers_.size();
    if (!last) {
      kc::AddRmsNorm(x_.data(), o_.data(), layers_[l + 1].input_norm.data(), eps, h_.data(), T,
                     hidden, threads);
    } else {
      // Final residual add (the same f32 add AddRmsNorm does); the next
      // stage's first norm, or the final norm on the logit rows, follows.
      for (size_t i = 0; i < total * hidden; ++i) x_[i] += o_[i];
    }
  }
  if (!last_stage_) {
    std::memcpy(io.hidden_out.data(), x_.data(), sizeof(float) * total * hidden);
    return Status::Ok();
  }
  if (rows == 0) return Status::Ok();

  Grow(rows_, rows * hidden);
  Grow(h_, rows * hidden);
  size_t r = 0;
  t = 0;
  for (const SeqChunk& s : batch) {
    const size_t first = t + s.tokens.size() - s.num_logits;
    for (size_t i = 0; i < s.num_logits; ++i, ++r) {
      std::memcpy(&rows_[r * hidden], &x_[(first + i) * hidden], sizeof(float) * hidden);
    }
    t += s.tokens.size();
  }
  const int R = static_cast<int>(rows);
  kc::RmsNorm(rows_.data(), final_norm_.data(), eps, h_.data(), R, hidden, threads);
  if (tp == 1) {
    kc::Gemm(h_.data(), lm_head_, nullptr, io.logits.data(), R, threads);  // [R][vocab]
    return Status::Ok();
  }
  // Vocab-parallel LM head: this rank's columns, all-gathered in rank order
  // ([tp][R][vocab / tp]) and interleaved into [R][vocab].
  const size_t vl = vocab_.size(), vocab = c.vocab_size;
  Grow(part_logits_, rows * vl);
  Grow(gathered_, tp * rows * vl);
  kc::Gemm(h_.data(), lm_head_, nullptr, part_logits_.data(), R, threads);  // [R][vl]
  TANDEM_RETURN_IF_ERROR(tp_comm->AllGather(std::span<const float>(part_logits_.data(), rows * vl),
                                            std::span<float>(gathered_.data(), tp * rows * vl)));
  if (io.logits.size() >= rows * vocab) {
    for (size_t rr = 0; rr < rows; ++rr) {
      for (uint32_t p = 0; p < tp; ++p) {
        std::memcpy(&io.logits[rr * vocab + p * vl], &gathered_[(p * rows + rr) * vl],
                    sizeof(float) * vl);
      }
    }
  }
  return Status::Ok();
}

}  // namespace tandem::engine
