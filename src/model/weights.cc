#include "model/weights.h"

#include <malloc.h>

#include <filesystem>
#include <map>
#include <memory>

#include "model/json_util.h"
#include "model/safetensors.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;

// Where each tensor lives: one file, or the shards named by the index.
class TensorSource {
 public:
  static Result<TensorSource> Open(const std::string& dir) {
    TensorSource src;
    const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
    const fs::path single_path = fs::path(dir) / "model.safetensors";
    std::error_code ec;
    if (fs::exists(index_path, ec)) {
      src.index_path_ = index_path.string();
      TANDEM_ASSIGN_OR_RETURN(nlohmann::json index, internal::ReadJsonFile(src.index_path_));
      auto map = index.is_object() ? index.find("weight_map") : index.end();
      if (map == index.end() || !map->is_object()) {
        return InvalidArgumentError(src.index_path_ + ": missing object 'weight_map'");
      }
      for (const auto& [name, file] : map->items()) {
        if (!file.is_string()) {
          return InvalidArgumentError(src.index_path_ + ": tensor '" + name +
                                      "' maps to a non-string " + file.dump());
        }
        const std::string shard = file.get<std::string>();
        // Shards live next to the index; refuse paths that leave the folder.
        if (shard.empty() || shard.find('/') != std::string::npos || shard == "..") {
          return InvalidArgumentError(src.index_path_ + ": tensor '" + name +
                                      "' maps to an invalid shard name '" + shard + "'");
        }
        if (!src.files_.count(shard)) {
          auto f = SafetensorsFile::Open((fs::path(dir) / shard).string());
          if (!f.ok()) return f.status();
          src.files_.emplace(shard, std::move(f).value());
        }
        src.where_.emplace(name, src.files_.at(shard).get());
      }
    } else if (fs::exists(single_path, ec)) {
      auto f = SafetensorsFile::Open(single_path.string());
      if (!f.ok()) return f.status();
      SafetensorsFile* file = f->get();
      src.files_.emplace("model.safetensors", std::move(f).value());
      for (const auto& [name, t] : file->tensors()) src.where_.emplace(name, file);
      src.single_ = file;
    } else {
      return NotFoundError(dir + ": neither model.safetensors nor model.safetensors.index.json");
    }
    return src;
  }

  bool Has(const std::string& name) const { return where_.count(name) != 0; }

  Result<const SafetensorsFile*> FileOf(const std::string& name) const {
    auto it = where_.find(name);
    if (it == where_.end()) {
      const std::string file = single_ != nullptr ? single_->path() : index_path_;
      return NotFoundError(file + ": missing tensor '" + name + "'");
    }
    return it->second;
  }

  Result<std::vector<float>> Read(const std::string& name,
                                  std::initializer_list<uint64_t> shape) const {
    TANDEM_ASSIGN_OR_RETURN(const SafetensorsFile* file, FileOf(name));
    const std::vector<uint64_t> want(shape);
    return file->ReadF32(name, want);
  }

  Result<Matrix> ReadMatrix(const std::string& name, uint32_t rows, uint32_t cols) const {
    Matrix m;
    if (format_ == WeightFormat::kBf16) {
      TANDEM_ASSIGN_OR_RETURN(const SafetensorsFile* file, FileOf(name));
      const std::vector<uint64_t> want = {rows, cols};
      TANDEM_ASSIGN_OR_RETURN(m.bf16, file->ReadBf16(name, want));
    } else {
      TANDEM_ASSIGN_OR_RETURN(m.data, Read(name, {rows, cols}));
    }
    m.rows = rows;
    m.cols = cols;
    return m;
  }

  void set_format(WeightFormat f) { format_ = f; }

 private:
  WeightFormat format_ = WeightFormat::kF32;
  std::string index_path_;
  SafetensorsFile* single_ = nullptr;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;  // by shard name
  std::map<std::string, SafetensorsFile*> where_;                   // tensor -> file
};

}  // namespace

Result<ModelWeights> LoadWeights(const std::string& dir, const ModelConfig& c,
                                 WeightFormat format) {
  TANDEM_ASSIGN_OR_RETURN(TensorSource src, TensorSource::Open(dir));
  src.set_format(format);
  const uint32_t hidden = c.hidden_size;
  const uint32_t q_dim = c.num_attention_heads * c.head_dim;
  const uint32_t kv_dim = c.num_key_value_heads * c.head_dim;
  const uint32_t inter = c.intermediate_size;

  ModelWeights w;
  TANDEM_ASSIGN_OR_RETURN(w.embed_tokens,
                          src.ReadMatrix("model.embed_tokens.weight", c.vocab_size, hidden));
  TANDEM_ASSIGN_OR_RETURN(w.norm, src.Read("model.norm.weight", {hidden}));
  if (!c.tie_word_embeddings) {
    TANDEM_ASSIGN_OR_RETURN(w.lm_head, src.ReadMatrix("lm_head.weight", c.vocab_size, hidden));
  }
  w.layers.resize(c.num_hidden_layers);
  for (uint32_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& l = w.layers[i];
    TANDEM_ASSIGN_OR_RETURN(l.input_layernorm, src.Read(p + "input_layernorm.weight", {hidden}));
    TANDEM_ASSIGN_OR_RETURN(l.post_attention_layernorm,
                            src.Read(p + "post_attention_layernorm.weight", {hidden}));
    TANDEM_ASSIGN_OR_RETURN(l.q_proj, src.ReadMatrix(p + "self_attn.q_proj.weight", q_dim, hidden));
    TANDEM_ASSIGN_OR_RETURN(l.k_proj,
                            src.ReadMatrix(p + "self_attn.k_proj.weight", kv_dim, hidden));
    TANDEM_ASSIGN_OR_RETURN(l.v_proj,
                            src.ReadMatrix(p + "self_attn.v_proj.weight", kv_dim, hidden));
    TANDEM_ASSIGN_OR_RETURN(l.o_proj, src.ReadMatrix(p + "self_attn.o_proj.weight", hidden, q_dim));
    if (c.attention_bias) {
      TANDEM_ASSIGN_OR_RETURN(l.q_bias, src.Read(p + "self_attn.q_proj.bias", {q_dim}));
      TANDEM_ASSIGN_OR_RETURN(l.k_bias, src.Read(p + "self_attn.k_proj.bias", {kv_dim}));
      TANDEM_ASSIGN_OR_RETURN(l.v_bias, src.Read(p + "self_attn.v_proj.bias", {kv_dim}));
      // Llama's attention_bias also puts a bias on o_proj; Qwen2's has none.
      if (c.architecture != "Qwen2ForCausalLM") {
        TANDEM_ASSIGN_OR_RETURN(l.o_bias, src.Read(p + "self_attn.o_proj.bias", {hidden}));
      }
    }
    TANDEM_ASSIGN_OR_RETURN(l.gate_proj, src.ReadMatrix(p + "mlp.gate_proj.weight", inter, hidden));
    TANDEM_ASSIGN_OR_RETURN(l.up_proj, src.ReadMatrix(p + "mlp.up_proj.weight", inter, hidden));
    TANDEM_ASSIGN_OR_RETURN(l.down_proj, src.ReadMatrix(p + "mlp.down_proj.weight", hidden, inter));
  }
  return w;
}

uint64_t HostBytes(const ModelWeights& w) {
  auto matrix = [](const Matrix& m) {
    return m.data.size() * sizeof(float) + m.bf16.size() * sizeof(uint16_t);
  };
  auto vec = [](const std::vector<float>& v) { return v.size() * sizeof(float); };
  uint64_t n = matrix(w.embed_tokens) + matrix(w.lm_head) + vec(w.norm);
  for (const LayerWeights& l : w.layers) {
    n += vec(l.input_layernorm) + vec(l.post_attention_layernorm) + vec(l.q_bias) + vec(l.k_bias) +
         vec(l.v_bias) + vec(l.o_bias);
    for (const Matrix* m :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj}) {
      n += matrix(*m);
    }
  }
  return n;
}

void ReleaseHostWeights(ModelWeights& w) {
  w = ModelWeights{};  // (assignment from a fresh object frees every vector)
  // Tensors below glibc's mmap threshold came from the heap; their pages
  // stay resident after free() unless trimmed.
  malloc_trim(0);
}

}  // namespace tandem::model
