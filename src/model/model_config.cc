#include "model/model_config.h"

#include <filesystem>
#include <optional>

#include "model/json_util.h"

namespace tandem::model {
namespace {

using internal::OptBool;
using internal::OptDouble;
using internal::OptString;
using internal::OptUint;
using internal::RequiredPositiveU32;

constexpr const char* kSupportedArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM",
                                                   "Qwen2ForCausalLM"};

// Reads the rope type and its parameters from one object: transformers 4's
// `rope_scaling` or transformers 5's `rope_parameters`.
Status ReadRopeObject(const nlohmann::json& j, const std::string& where, RopeConfig* rope) {
  if (!j.is_object()) return InvalidArgumentError(where + " must be an object, got " + j.dump());
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> type, OptString(j, "rope_type", where));
  if (!type) {
    TANDEM_ASSIGN_OR_RETURN(type, OptString(j, "type", where));  // older spelling
  }
  rope->type = type.value_or("default");
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> theta, OptDouble(j, "rope_theta", where));
  if (theta) rope->theta = *theta;
  if (rope->type == "default") return Status::Ok();
  if (rope->type != "linear" && rope->type != "llama3") {
    return UnimplementedError(where + ": rope type '" + rope->type +
                              "' is not supported (supported: default, linear, llama3)");
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> factor, OptDouble(j, "factor", where));
  if (!factor || *factor <= 0) {
    return InvalidArgumentError(where + ": rope type '" + rope->type +
                                "' needs a positive 'factor'");
  }
  rope->factor = *factor;
  if (rope->type == "llama3") {
    TANDEM_ASSIGN_OR_RETURN(std::optional<double> low, OptDouble(j, "low_freq_factor", where));
    TANDEM_ASSIGN_OR_RETURN(std::optional<double> high, OptDouble(j, "high_freq_factor", where));
    TANDEM_ASSIGN_OR_RETURN(std::optional<uint64_t> orig,
                            OptUint(j, "original_max_position_embeddings", where));
    if (!low || !high || !orig) {
      return InvalidArgumentError(where +
                                  ": rope type 'llama3' needs 'low_freq_factor', "
                                  "'high_freq_factor' and 'original_max_position_embeddings'");
    }
    if (*high <= *low || *orig == 0 || *orig > UINT32_MAX) {
      return InvalidArgumentError(where + ": llama3 rope needs high_freq_factor (" +
                                  std::to_string(*high) + ") > low_freq_factor (" +
                                  std::to_string(*low) +
                                  ") and a positive original_max_position_embeddings");
    }
    rope->low_freq_factor = *low;
    rope->high_freq_factor = *high;
    rope->original_max_position_embeddings = static_cast<uint32_t>(*orig);
  }
  return Status::Ok();
}

// eos_token_id as written by transformers: an integer, a list of integers or null.
Result<std::vector<uint32_t>> ReadTokenIds(const nlohmann::json& j, const char* key,
                                           const std::string& file) {
  std::vector<uint32_t> ids;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return ids;
  auto one = [&](const nlohmann::json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > UINT32_MAX) {
      return InvalidArgumentError(file + ": '" + key +
                                  "' must be a token id or a list of them, got " + it->dump());
    }
    ids.push_back(static_cast<uint32_t>(v.get<int64_t>()));
    return Status::Ok();
  };
  if (it->is_array()) {
    for (const auto& v : *it) TANDEM_RETURN_IF_ERROR(one(v));
  } else {
    TANDEM_RETURN_IF_ERROR(one(*it));
  }
  return ids;
}

Status ParseConfig(const nlohmann::json& j, const std::string& file, ModelConfig* c) {
  if (!j.is_object()) return InvalidArgumentError(file + ": must hold a JSON object");
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return InvalidArgumentError(file + ": missing required key 'architectures' (a list of names)");
  }
  c->architecture = (*arch)[0].get<std::string>();
  bool supported = false;
  for (const char* a : kSupportedArchitectures) supported |= c->architecture == a;
  if (!supported) {
    return UnimplementedError(file + ": architecture '" + c->architecture +
                              "' is not supported (supported: LlamaForCausalLM, "
                              "MistralForCausalLM, Qwen2ForCausalLM)");
  }
  TANDEM_ASSIGN_OR_RETURN(c->vocab_size, RequiredPositiveU32(j, "vocab_size", file));
  TANDEM_ASSIGN_OR_RETURN(c->hidden_size, RequiredPositiveU32(j, "hidden_size", file));
  TANDEM_ASSIGN_OR_RETURN(c->intermediate_size, RequiredPositiveU32(j, "intermediate_size", file));
  TANDEM_ASSIGN_OR_RETURN(c->num_hidden_layers, RequiredPositiveU32(j, "num_hidden_layers", file));
  TANDEM_ASSIGN_OR_RETURN(c->num_attention_heads,
                          RequiredPositiveU32(j, "num_attention_heads", file));
  // transformers' default: multi-head attention (as many KV heads as heads).
  c->num_key_value_heads = c->num_attention_heads;
  if (j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()) {
    TANDEM_ASSIGN_OR_RETURN(c->num_key_value_heads,
                            RequiredPositiveU32(j, "num_key_value_heads", file));
  }
  if (c->num_attention_heads % c->num_key_value_heads != 0) {
    return InvalidArgumentError(file + ": 'num_key_value_heads' (" +
                                std::to_string(c->num_key_value_heads) +
                                ") must divide 'num_attention_heads' (" +
                                std::to_string(c->num_attention_heads) + ")");
  }
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    TANDEM_ASSIGN_OR_RETURN(c->head_dim, RequiredPositiveU32(j, "head_dim", file));
  } else {
    if (c->hidden_size % c->num_attention_heads != 0) {
      return InvalidArgumentError(file + ": 'num_attention_heads' (" +
                                  std::to_string(c->num_attention_heads) +
                                  ") must divide 'hidden_size' (" +
                                  std::to_string(c->hidden_size) + ") when 'head_dim' is absent");
    }
    c->head_dim = c->hidden_size / c->num_attention_heads;
  }
  if (c->head_dim % 2 != 0) {
    // RoPE rotates pairs of dimensions.
    return InvalidArgumentError(file + ": head dimension (" + std::to_string(c->head_dim) +
                                ") must be even for RoPE");
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<uint64_t> max_pos,
                          OptUint(j, "max_position_embeddings", file));
  c->max_position_embeddings = 2048;  // transformers' LlamaConfig default
  if (max_pos) {
    if (*max_pos == 0 || *max_pos > UINT32_MAX) {
      return InvalidArgumentError(file + ": 'max_position_embeddings' must be positive");
    }
    c->max_position_embeddings = static_cast<uint32_t>(*max_pos);
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> eps, OptDouble(j, "rms_norm_eps", file));
  if (eps) {
    if (*eps <= 0) return InvalidArgumentError(file + ": 'rms_norm_eps' must be positive");
    c->rms_norm_eps = *eps;
  }

  // RoPE: transformers 5 writes `rope_parameters`; transformers 4 writes
  // `rope_theta` at the top level and an optional `rope_scaling` object.
  auto params = j.find("rope_parameters");
  if (params != j.end() && !params->is_null()) {
    if (params->is_object() && !params->contains("rope_type") && !params->contains("rope_theta")) {
      return UnimplementedError(file +
                                ": 'rope_parameters' per layer type is not supported (expected "
                                "an object with 'rope_type' and 'rope_theta')");
    }
    TANDEM_RETURN_IF_ERROR(ReadRopeObject(*params, file + ": 'rope_parameters'", &c->rope));
  } else {
    TANDEM_ASSIGN_OR_RETURN(std::optional<double> theta, OptDouble(j, "rope_theta", file));
    if (theta) c->rope.theta = *theta;
    auto scaling = j.find("rope_scaling");
    if (scaling != j.end() && !scaling->is_null()) {
      RopeConfig scaled = c->rope;
      TANDEM_RETURN_IF_ERROR(ReadRopeObject(*scaling, file + ": 'rope_scaling'", &scaled));
      c->rope = scaled;
    }
  }
  if (c->rope.theta <= 0) return InvalidArgumentError(file + ": 'rope_theta' must be positive");

  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> tied, OptBool(j, "tie_word_embeddings", file));
  c->tie_word_embeddings = tied.value_or(false);
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> bias, OptBool(j, "attention_bias", file));
  c->attention_bias = c->architecture == "Qwen2ForCausalLM" ? true : bias.value_or(false);

  // LayerWeights has no MLP biases; refuse rather than silently drop them.
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> mlp_bias, OptBool(j, "mlp_bias", file));
  if (mlp_bias.value_or(false)) {
    return UnimplementedError(file + ": 'mlp_bias': true is not supported");
  }

  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> dtype, OptString(j, "torch_dtype", file));
  if (!dtype) {
    TANDEM_ASSIGN_OR_RETURN(dtype, OptString(j, "dtype", file));  // transformers 5
  }
  c->torch_dtype = dtype.value_or("float32");

  // Sliding window: Mistral uses it whenever set; Qwen2 only with use_sliding_window.
  TANDEM_ASSIGN_OR_RETURN(std::optional<uint64_t> window, OptUint(j, "sliding_window", file));
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> use_window, OptBool(j, "use_sliding_window", file));
  bool window_on = c->architecture == "MistralForCausalLM" ||
                   (c->architecture == "Qwen2ForCausalLM" && use_window.value_or(false));
  if (window_on && window && *window > 0 && *window < c->max_position_embeddings) {
    c->sliding_window = static_cast<uint32_t>(*window);
  }

  TANDEM_ASSIGN_OR_RETURN(c->eos_token_ids, ReadTokenIds(j, "eos_token_id", file));
  TANDEM_ASSIGN_OR_RETURN(std::vector<uint32_t> bos, ReadTokenIds(j, "bos_token_id", file));
  if (!bos.empty()) c->bos_token_id = bos[0];
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> LoadModelConfig(const std::string& dir) {
  namespace fs = std::filesystem;
  ModelConfig c;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  TANDEM_ASSIGN_OR_RETURN(nlohmann::json j, internal::ReadJsonFile(config_path));
  TANDEM_RETURN_IF_ERROR(ParseConfig(j, config_path, &c));

  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen_path, ec)) {
    TANDEM_ASSIGN_OR_RETURN(nlohmann::json g, internal::ReadJsonFile(gen_path));
    if (!g.is_object()) return InvalidArgumentError(gen_path + ": must hold a JSON object");
    TANDEM_ASSIGN_OR_RETURN(std::vector<uint32_t> eos, ReadTokenIds(g, "eos_token_id", gen_path));
    if (!eos.empty()) c.eos_token_ids = std::move(eos);
    TANDEM_ASSIGN_OR_RETURN(std::vector<uint32_t> bos, ReadTokenIds(g, "bos_token_id", gen_path));
    if (!bos.empty()) c.bos_token_id = bos[0];
  }
  for (uint32_t id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      return InvalidArgumentError(config_path + ": eos token id " + std::to_string(id) +
                                  " is outside the vocabulary (vocab_size " +
                                  std::to_string(c.vocab_size) + ")");
    }
  }
  return c;
}

}  // namespace tandem::model
