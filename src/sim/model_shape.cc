#include "sim/model_shape.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace tandem::sim {

namespace fs = std::filesystem;

uint64_t ModelShape::linear_params() const {
  const uint64_t q = hidden_size * num_heads * head_dim;
  const uint64_t kv = 2 * hidden_size * num_kv_heads * head_dim;
  const uint64_t o = num_heads * head_dim * hidden_size;
  const uint64_t mlp = 3 * hidden_size * intermediate_size;
  return num_layers * (q + kv + o + mlp);
}

double ModelShape::prefill_pair_cost() const {
  const uint64_t linear = linear_params();
  if (linear == 0) return 0;
  return 4.0 * static_cast<double>(num_layers * num_heads * head_dim) / (2.0 * static_cast<double>(linear));
}

uint64_t ModelShape::total_params() const {
  const uint64_t embed = vocab_size * hidden_size;
  const uint64_t norms = num_layers * 2 * hidden_size + hidden_size;
  return linear_params() + embed + (tie_word_embeddings ? 0 : embed) + norms;
}

uint64_t ModelShape::step_weight_bytes() const {
  return (linear_params() + vocab_size * hidden_size) * weight_dtype_bytes;
}

Result<ModelShape> ParseModelShape(const std::string& json_text, const std::string& name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    return InvalidArgumentError(fmt::format("{}: not valid JSON: {}", name, e.what()));
  }
  if (!j.is_object()) return InvalidArgumentError(fmt::format("{}: not a JSON object", name));
  ModelShape s;
  std::string err;
  auto get = [&](const char* key, uint64_t& out, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) err += fmt::format("{}: missing key '{}'\n", name, key);
      return;
    }
    if (!j[key].is_number_unsigned() || j[key].get<uint64_t>() == 0) {
      err += fmt::format("{}: key '{}' must be a positive integer, got {}\n", name, key,
                         j[key].dump());
      return;
    }
    out = j[key].get<uint64_t>();
  };
  get("hidden_size", s.hidden_size, true);
  get("intermediate_size", s.intermediate_size, true);
  get("num_hidden_layers", s.num_layers, true);
  get("num_attention_heads", s.num_heads, true);
  get("vocab_size", s.vocab_size, true);
  get("max_position_embeddings", s.max_position_embeddings, true);
  s.num_kv_heads = 0;
  get("num_key_value_heads", s.num_kv_heads, false);
  get("head_dim", s.head_dim, false);
  if (!err.empty()) {
    err.pop_back();
    return InvalidArgumentError(err);
  }
  if (s.num_kv_heads == 0) s.num_kv_heads = s.num_heads;
  if (s.head_dim == 0) s.head_dim = s.hidden_size / s.num_heads;
  if (s.num_heads % s.num_kv_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "{}: 'num_key_value_heads' ({}) must divide 'num_attention_heads' ({})", name,
        s.num_kv_heads, s.num_heads));
  }
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean()) {
    s.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  s.name = name;
  return s;
}

Result<ModelShape> LoadModelShape(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  if (!in) return NotFoundError(fmt::format("{}: cannot open the model shape", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  // The shape's name: the folder of config.json, or the file's stem.
  std::string name = p.filename() == "config.json" ? p.parent_path().filename().string()
                                                   : p.stem().string();
  auto shape = ParseModelShape(ss.str(), p.string());
  if (!shape.ok()) return shape.status();
  shape->name = name.empty() ? p.string() : name;
  return shape;
}

}  // namespace tandem::sim
