#include "engine/llama_forward.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "kernels/reference/ops.h"

namespace tandem::engine {
namespace kc = kernels::cpu;
namespace {

Status CheckMatrix(const model::Matrix& m, uint32_t rows, uint32_t cols, const std::string& name) {
  if (!m.bf16.empty()) {
    return InvalidArgumentError(fmt::format(
        "weights: {} was loaded as bf16, which only backend cuda takes (the cpu backend needs f32)",
        name));
  }
  if (m.rows != rows || m.cols != cols || m.data.size() != size_t{rows} * cols) {
    return InvalidArgumentError(fmt::format("weights: {} is [{}][{}] ({} floats); expected [{}][{}]",
                                            name, m.rows, m.cols, m.data.size(), rows, cols));
  }
  return Status::Ok();
}

Status CheckVector(const std::vector<float>& v, uint32_t n, const std::string& name) {
  if (v.size() != n) {
    return InvalidArgumentError(
        fmt::format("weights: {} has {} floats; expected {}", name, v.size(), n));
  }
  return Status::Ok();
}

template <class T>
void Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

Result<std::unique_ptr<LlamaForward>> LlamaForward::Create(const model::ModelConfig& config,
                                                           const model::ModelWeights& w) {
  const uint32_t hidden = config.hidden_size, hd = config.head_dim;
  const uint32_t heads = config.num_attention_heads, kvh = config.num_key_value_heads;
  const uint32_t inter = config.intermediate_size, vocab = config.vocab_size;
  if (hidden == 0 || hd == 0 || heads == 0 || kvh == 0 || heads % kvh != 0 || inter == 0 ||
      vocab == 0 || hd % 2 != 0) {
    return InvalidArgumentError(fmt::format(
        "model config: hidden {}, head_dim {} (even), heads {}, kv heads {} (dividing heads), "
        "intermediate {}, vocab {} must be positive",
        hidden, hd, heads, kvh, inter, vocab));
  }
  if (w.layers.size() != config.num_hidden_layers) {
    return InvalidArgumentError(fmt::format("weights: {} layers; config.json says {}",
                                            w.layers.size(), config.num_hidden_layers));
  }
  TANDEM_RETURN_IF_ERROR(CheckMatrix(w.embed_tokens, vocab, hidden, "model.embed_tokens.weight"));
  TANDEM_RETURN_IF_ERROR(CheckVector(w.norm, hidden, "model.norm.weight"));
  if (w.lm_head.rows != 0) {
    TANDEM_RETURN_IF_ERROR(CheckMatrix(w.lm_head, vocab, hidden, "lm_head.weight"));
  }
  std::unique_ptr<LlamaForward> f(new LlamaForward());
  f->config_ = config;
  f->embed_ = w.embed_tokens.data;
  f->final_norm_ = w.norm;
  auto pack = [&](const model::Matrix& m) {
    auto p = kc::PackWeights(m.data.data(), static_cast<int>(m.rows), static_cast<int>(m.cols));
    f->weight_bytes_ += p.bytes();
    return p;
  };
  for (uint32_t i = 0; i < config.num_hidden_layers; ++i) {
    const model::LayerWeights& lw = w.layers[i];
    const std::string p = fmt::format("model.layers.{}.", i);
    TANDEM_RETURN_IF_ERROR(CheckVector(lw.input_layernorm, hidden, p + "input_layernorm.weight"));
    TANDEM_RETURN_IF_ERROR(
        CheckVector(lw.post_attention_layernorm, hidden, p + "post_attention_layernorm.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.q_proj, heads * hd, hidden, p + "self_attn.q_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.k_proj, kvh * hd, hidden, p + "self_attn.k_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.v_proj, kvh * hd, hidden, p + "self_attn.v_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.o_proj, hidden, heads * hd, p + "self_attn.o_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.gate_proj, inter, hidden, p + "mlp.gate_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.up_proj, inter, hidden, p + "mlp.up_proj.weight"));
    TANDEM_RETURN_IF_ERROR(CheckMatrix(lw.down_proj, hidden, inter, p + "mlp.down_proj.weight"));
    if (!lw.q_bias.empty() || !lw.k_bias.empty() || !lw.v_bias.empty()) {
      TANDEM_RETURN_IF_ERROR(CheckVector(lw.q_bias, heads * hd, p + "self_attn.q_proj.bias"));
      TANDEM_RETURN_IF_ERROR(CheckVector(lw.k_bias, kvh * hd, p + "self_attn.k_proj.bias"));
      TANDEM_RETURN_IF_ERROR(CheckVector(lw.v_bias, kvh * hd, p + "self_attn.v_proj.bias"));
    }
    if (!lw.o_bias.empty()) {
      TANDEM_RETURN_IF_ERROR(CheckVector(lw.o_bias, hidden, p + "self_attn.o_proj.bias"));
    }
    Layer L;
    L.input_norm = lw.input_layernorm;
    L.post_norm = lw.post_attention_layernorm;
    L.q = pack(lw.q_proj);
    L.k = pack(lw.k_proj);
    L.v = pack(lw.v_proj);
    L.o = pack(lw.o_proj);
    L.gate = pack(lw.gate_proj);
    L.up = pack(lw.up_proj);
    L.down = pack(lw.down_proj);
    L.q_bias = lw.q_bias;
    L.k_bias = lw.k_bias;
    L.v_bias = lw.v_bias;
    L.o_bias = lw.o_bias;
    f->weight_bytes_ += (L.input_norm.size() + L.post_norm.size() + L.q_bias.size() +
                         L.k_bias.size() + L.v_bias.size() + L.o_bias.size()) * sizeof(float);
    f->layers_.push_back(std::move(L));
  }
  f->lm_head_ = pack(w.lm_head.rows != 0 ? w.lm_head : w.embed_tokens);
  f->weight_bytes_ += f->final_norm_.size() * sizeof(float);

  f->inv_freq_.resize(hd / 2);
  const auto& rope = config.rope;
  if (rope.type == "llama3") {
    kernels::RopeLlama3Scaling s;
    s.factor = static_cast<float>(rope.factor);
    s.low_freq_factor = static_cast<float>(rope.low_freq_factor);
    s.high_freq_factor = static_cast<float>(rope.high_freq_factor);
    s.original_max_position_embeddings = static_cast<int>(rope.original_max_position_embeddings);
    kernels::ref::RopeInvFreq(f->inv_freq_.data(), static_cast<int>(hd), rope.theta, &s);
  } else if (rope.type == "linear") {
    kernels::ref::RopeInvFreq(f->inv_freq_.data(), static_cast<int>(hd), rope.theta, nullptr,
                              static_cast<float>(rope.factor));
  } else if (rope.type == "default" || rope.type.empty()) {
    kernels::ref::RopeInvFreq(f->inv_freq_.data(), static_cast<int>(hd), rope.theta);
  } else {
    return UnimplementedError(fmt::format("RoPE type '{}' is not supported", rope.type));
  }
  return f;
}

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
  const auto& c = config_;
  const int hidden = static_cast<int>(c.hidden_size), hd = static_cast<int>(c.head_dim);
  const int heads = static_cast<int>(c.num_attention_heads);
  const int kvh = static_cast<int>(c.num_key_value_heads);
  const int inter = static_cast<int>(c.intermediate_size);
  const int vocab = static_cast<int>(c.vocab_size);
  const int bs = static_cast<int>(kv.layout().block_size);
  const float eps = static_cast<float>(c.rms_norm_eps);

  TANDEM_RETURN_IF_ERROR(
      CheckForwardBatch(batch, bs, c.max_position_embeddings, vocab, logits.size()));
  size_t total = 0, rows = 0, table_len = 0;
  for (const SeqChunk& s : batch) {
    total += s.tokens.size();
    rows += s.num_logits;
    table_len += s.block_table.size();
  }
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

  // Token rows, positions, slots and per-sequence attention descriptors.
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
      std::memcpy(&x_[t * hidden], &embed_[size_t{id} * hidden], sizeof(float) * hidden);
      const uint32_t pos = s.start_pos + static_cast<uint32_t>(i);
      positions_[t] = static_cast<int32_t>(pos);
      slots_[t] = tables_[tb + pos / bs] * bs + static_cast<int32_t>(pos % bs);
    }
    tb += s.block_table.size();
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
    kc::Gemm(attn_.data(), L.o, bias(L.o_bias), o_.data(), T, threads);  // [T][hidden]
    kc::AddRmsNorm(x_.data(), o_.data(), L.post_norm.data(), eps, h_.data(), T, hidden, threads);
    kc::Gemm(h_.data(), L.gate, nullptr, gate_.data(), T, threads);  // [T][inter]
    kc::Gemm(h_.data(), L.up, nullptr, up_.data(), T, threads);      // [T][inter]
    kc::SiluMul(gate_.data(), up_.data(), gate_.data(), T, inter, threads);
    kc::Gemm(gate_.data(), L.down, nullptr, o_.data(), T, threads);  // [T][hidden]
    const bool last = l + 1 == layers_.size();
    if (!last) {
      kc::AddRmsNorm(x_.data(), o_.data(), layers_[l + 1].input_norm.data(), eps, h_.data(), T,
                     hidden, threads);
    } else {
      // Final residual add; the final norm runs on the logit rows only.
      for (size_t i = 0; i < total * hidden; ++i) x_[i] += o_[i];
    }
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
  kc::Gemm(h_.data(), lm_head_, nullptr, logits.data(), R, threads);  // [R][vocab]
  return Status::Ok();
}

}  // namespace tandem::engine
