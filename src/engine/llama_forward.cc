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

KvLayout ShardKvLayout(const model::ModelConfig& config, const ShardSpec& shard,
                       uint32_t block_size) {
  const auto& l = shard.layout;
  const parallel::Range layers =
      parallel::StageLayers(l, config.num_hidden_layers, l.stage_of(shard.rank));
  const parallel::Range kv =
      parallel::TpKvHeads(l, config.num_key_value_heads, l.tp_rank_of(shard.rank));
  return KvLayout{layers.size(), kv.size(), config.head_dim, block_size};
}

namespace {

// Rows [r.begin, r.end) of m (a column-parallel slice: output features).
kc::PackedWeights PackRows(const model::Matrix& m, parallel::Range r) {
  return kc::PackWeights(m.data.data() + size_t{r.begin} * m.cols, static_cast<int>(r.size()),
                         static_cast<int>(m.cols));
}

// Columns [c.begin, c.end) of m (a row-parallel slice: input features).
kc::PackedWeights PackCols(const model::Matrix& m, parallel::Range c) {
  if (c.begin == 0 && c.end == m.cols) {
    return kc::PackWeights(m.data.data(), static_cast<int>(m.rows), static_cast<int>(m.cols));
  }
  std::vector<float> tmp(size_t{m.rows} * c.size());
  for (uint32_t r = 0; r < m.rows; ++r) {
    std::memcpy(&tmp[size_t{r} * c.size()], &m.data[size_t{r} * m.cols + c.begin],
                sizeof(float) * c.size());
  }
  return kc::PackWeights(tmp.data(), static_cast<int>(m.rows), static_cast<int>(c.size()));
}

std::vector<float> Slice(const std::vector<float>& v, parallel::Range r) {
  if (v.empty()) return {};
  return std::vector<float>(v.begin() + r.begin, v.begin() + r.end);
}

// Local K bounds of a rank holding columns `cols` of a row-parallel K of
// `k`: the global kTpReduceShards bounds k * s / kTpReduceShards that fall
// in its range when tp divides kTpReduceShards, else the whole range.
std::vector<int> ShardBounds(uint32_t k, uint32_t tp, parallel::Range cols) {
  if (kTpReduceShards % tp != 0) return {0, static_cast<int>(cols.size())};
  std::vector<int> b;
  for (uint32_t s = 0; s <= kTpReduceShards; ++s) {
    const uint32_t g = static_cast<uint32_t>(uint64_t{k} * s / kTpReduceShards);
    if (g >= cols.begin && g <= cols.end) b.push_back(static_cast<int>(g - cols.begin));
  }
  return b;
}

}  // namespace

parallel::ModelDims DimsOf(const model::ModelConfig& c) {
  return {.num_layers = c.num_hidden_layers,
          .num_heads = c.num_attention_heads,
          .num_kv_heads = c.num_key_value_heads,
          .intermediate = c.intermediate_size,
          .vocab = c.vocab_size};
}

Result<std::unique_ptr<LlamaForward>> LlamaForward::Create(const model::ModelConfig& config,
                                                           const model::ModelWeights& w,
                                                           ShardSpec shard,
                                                           model::ModelWeights* consume) {
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
  const parallel::ParallelLayout& lay = shard.layout;
  TANDEM_RETURN_IF_ERROR(parallel::CheckLayout(lay, DimsOf(config)));
  if (shard.rank >= lay.world()) {
    return InvalidArgumentError(fmt::format("rank {} is outside the {} layout ({} ranks)",
                                            shard.rank, parallel::ToString(lay), lay.world()));
  }
  TANDEM_RETURN_IF_ERROR(CheckMatrix(w.embed_tokens, vocab, hidden, "model.embed_tokens.weight"));
  TANDEM_RETURN_IF_ERROR(CheckVector(w.norm, hidden, "model.norm.weight"));
  if (w.lm_head.rows != 0) {
    TANDEM_RETURN_IF_ERROR(CheckMatrix(w.lm_head, vocab, hidden, "lm_head.weight"));
  }
  std::unique_ptr<LlamaForward> f(new LlamaForward());
  f->config_ = config;
  f->shard_ = shard;
  f->tp_rank_ = lay.tp_rank_of(shard.rank);
  f->stage_ = lay.stage_of(shard.rank);
  f->first_stage_ = f->stage_ == 0;
  f->last_stage_ = f->stage_ + 1 == lay.pp;
  f->layers_range_ = parallel::StageLayers(lay, config.num_hidden_layers, f->stage_);
  f->heads_ = parallel::TpHeads(lay, heads, f->tp_rank_);
  f->kv_heads_ = parallel::TpKvHeads(lay, kvh, f->tp_rank_);
  f->vocab_ = parallel::TpSlice(lay, vocab, f->tp_rank_);
  const parallel::Range inter_cols = parallel::TpSlice(lay, inter, f->tp_rank_);
  f->inter_ = inter_cols.size();
  // GQA: local head i reads local KV head i / (local heads / local kv heads);
  // that must be the KV head model head heads_.begin + i reads.
  const uint32_t group = heads / kvh, local_group = f->heads_.size() / f->kv_heads_.size();
  for (uint32_t i = 0; i < f->heads_.size(); ++i) {
    if ((f->heads_.begin + i) / group != f->kv_heads_.begin + i / local_group) {
      return InvalidArgumentError(fmt::format(
          "{} rank {}: attention head {} does not map onto the rank's KV heads [{}, {})",
          parallel::ToString(lay), shard.rank, f->heads_.begin + i, f->kv_heads_.begin,
          f->kv_heads_.end));
    }
  }
  const parallel::Range q_rows{f->heads_.begin * hd, f->heads_.end * hd};
  const parallel::Range kv_rows{f->kv_heads_.begin * hd, f->kv_heads_.end * hd};
  f->o_bounds_ = ShardBounds(heads * hd, lay.tp, q_rows);
  f->down_bounds_ = ShardBounds(inter, lay.tp, inter_cols);

  auto count = [&](const kc::PackedWeights& p) { f->weight_bytes_ += p.bytes(); };
  if (f->first_stage_) {
    f->embed_.assign(w.embed_tokens.data.begin() + size_t{f->vocab_.begin} * hidden,
                     w.embed_tokens.data.begin() + size_t{f->vocab_.end} * hidden);
  }
  // `consume` (the same object as `w`): every tensor is freed as soon as
  // its copy is made, so loading peaks at about one copy of the model plus
  // one layer's packs, not two copies. An untied lm_head leaves the
  // embedding needed by nothing else.
  const bool tied = w.lm_head.rows == 0;
  if (consume != nullptr && !tied) consume->embed_tokens = {};
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
    if (i < f->layers_range_.begin || i >= f->layers_range_.end) {  // another stage's
      if (consume != nullptr) consume->layers[i] = model::LayerWeights{};
      continue;
    }
    Layer L;
    L.input_norm = lw.input_layernorm;
    L.post_norm = lw.post_attention_layernorm;
    L.q = PackRows(lw.q_proj, q_rows);
    L.k = PackRows(lw.k_proj, kv_rows);
    L.v = PackRows(lw.v_proj, kv_rows);
    L.o = PackCols(lw.o_proj, q_rows);
    L.gate = PackRows(lw.gate_proj, inter_cols);
    L.up = PackRows(lw.up_proj, inter_cols);
    L.down = PackCols(lw.down_proj, inter_cols);
    for (const auto* pw : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) count(*pw);
    L.q_bias = Slice(lw.q_bias, q_rows);
    L.k_bias = Slice(lw.k_bias, kv_rows);
    L.v_bias = Slice(lw.v_bias, kv_rows);
    L.o_bias = lw.o_bias;
    f->weight_bytes_ += (L.input_norm.size() + L.post_norm.size() + L.q_bias.size() +
                         L.k_bias.size() + L.v_bias.size() + L.o_bias.size()) * sizeof(float);
    f->layers_.push_back(std::move(L));
    if (consume != nullptr) consume->layers[i] = model::LayerWeights{};  // (`lw` with it)
  }
  if (f->last_stage_) {
    f->final_norm_ = w.norm;
    f->lm_head_ = PackRows(tied ? w.embed_tokens : w.lm_head, f->vocab_);
    count(f->lm_head_);
    f->weight_bytes_ += f->final_norm_.size() * sizeof(float);
  }
  if (consume != nullptr) {
    consume->lm_head = {};
    consume->embed_tokens = {};
    consume->norm = {};
  }

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

}  // namespace tandem::engine
