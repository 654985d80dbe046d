#include "model/weights.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "model/tokenizer.h"
#include "test_util.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;
using testing::FixtureDir;
using testing::ReadAll;
using testing::ScratchDir;
using testing::WriteAll;

std::string ModelDir(const std::string& name) { return FixtureDir() + "/models/" + name; }

// The loaded tensor called `name`, flattened, with its shape.
const std::vector<float>* Lookup(const ModelWeights& w, const std::string& name,
                                 std::vector<uint64_t>* shape) {
  auto mat = [&](const Matrix& m) {
    *shape = {m.rows, m.cols};
    return &m.data;
  };
  auto vec = [&](const std::vector<float>& v) {
    *shape = {v.size()};
    return &v;
  };
  if (name == "model.embed_tokens.weight") return mat(w.embed_tokens);
  if (name == "model.norm.weight") return vec(w.norm);
  if (name == "lm_head.weight") return mat(w.lm_head);
  const std::string p = "model.layers.";
  if (name.rfind(p, 0) != 0) return nullptr;
  const size_t dot = name.find('.', p.size());
  const size_t i = std::stoul(name.substr(p.size(), dot - p.size()));
  if (i >= w.layers.size()) return nullptr;
  const LayerWeights& l = w.layers[i];
  const std::string rest = name.substr(dot + 1);
  if (rest == "input_layernorm.weight") return vec(l.input_layernorm);
  if (rest == "post_attention_layernorm.weight") return vec(l.post_attention_layernorm);
  if (rest == "self_attn.q_proj.weight") return mat(l.q_proj);
  if (rest == "self_attn.k_proj.weight") return mat(l.k_proj);
  if (rest == "self_attn.v_proj.weight") return mat(l.v_proj);
  if (rest == "self_attn.o_proj.weight") return mat(l.o_proj);
  if (rest == "self_attn.q_proj.bias") return vec(l.q_bias);
  if (rest == "self_attn.k_proj.bias") return vec(l.k_bias);
  if (rest == "self_attn.v_proj.bias") return vec(l.v_bias);
  if (rest == "mlp.gate_proj.weight") return mat(l.gate_proj);
  if (rest == "mlp.up_proj.weight") return mat(l.up_proj);
  if (rest == "mlp.down_proj.weight") return mat(l.down_proj);
  return nullptr;
}

// Every tensor of expected.json (written by tools/make_model_fixtures.py from
// the stored dtype converted to f32) matches: shape, first/last elements
// exactly, sums to rounding.
void ExpectMatchesFixture(const std::string& name) {
  SCOPED_TRACE(name);
  auto config = LoadModelConfig(ModelDir(name));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto w = LoadWeights(ModelDir(name), *config);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const auto expected = nlohmann::json::parse(ReadAll(ModelDir(name) + "/expected.json"));
  ASSERT_GT(expected.size(), 10u);
  for (const auto& [tensor, e] : expected.items()) {
    SCOPED_TRACE(tensor);
    std::vector<uint64_t> shape;
    const std::vector<float>* v = Lookup(*w, tensor, &shape);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(shape, e["shape"].get<std::vector<uint64_t>>());
    ASSERT_FALSE(v->empty());
    const auto first = e["first"].get<std::vector<double>>();
    for (size_t k = 0; k < first.size(); ++k) EXPECT_EQ((*v)[k], static_cast<float>(first[k]));
    EXPECT_EQ(v->back(), static_cast<float>(e["last"].get<double>()));
    double sum = 0, abs_sum = 0;
    for (float x : *v) {
      sum += x;
      abs_sum += std::fabs(x);
    }
    EXPECT_NEAR(sum, e["sum"].get<double>(), 1e-9 * e["abs_sum"].get<double>() + 1e-12);
    EXPECT_NEAR(abs_sum, e["abs_sum"].get<double>(), 1e-9 * abs_sum + 1e-12);
  }
  if (config->tie_word_embeddings) {
    EXPECT_EQ(w->lm_head.rows, 0u);
  }
}

TEST(Weights, F32SingleFile) { ExpectMatchesFixture("llama_f32"); }
TEST(Weights, Bf16ThreeShards) { ExpectMatchesFixture("llama_bf16_sharded"); }
TEST(Weights, F16TiedWithBias) { ExpectMatchesFixture("qwen2_f16_tied"); }
TEST(Weights, F16TwoShards) { ExpectMatchesFixture("mistral_f16_sharded"); }

// The bundled model (models/tandem-kjv, when present): config, weights and
// tokenizer load and agree with one another.
TEST(Weights, BundledModelLoads) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv";
  if (!fs::exists(dir + "/config.json")) GTEST_SKIP() << dir << " is absent";
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto w = LoadWeights(dir, *config);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->layers.size(), config->num_hidden_layers);
  EXPECT_EQ(w->embed_tokens.rows, config->vocab_size);
  auto tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_LE((*tok)->vocab_size(), config->vocab_size);
  ASSERT_FALSE(config->eos_token_ids.empty());
  for (uint32_t eos : config->eos_token_ids) EXPECT_TRUE((*tok)->IsSpecial(eos)) << eos;
}

TEST(Weights, HalfAndBfloat16Conversion) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7C00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(Bfloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bfloat16ToFloat(0xC040), -3.0f);
}

// ---- corrupted files: every case is an error naming the file (and the tensor) ----

struct Parsed {
  nlohmann::json header;
  std::string data;  // the bytes after the header
};

Parsed Split(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}

std::string Join(const nlohmann::json& header, const std::string& data) {
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + h + data;
}

class CorruptWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::copy(ModelDir("llama_f32"), dir_.path(), fs::copy_options::recursive);
    file_ = dir_ / "model.safetensors";
    original_ = ReadAll(file_);
    auto c = LoadModelConfig(dir_.path());
    ASSERT_TRUE(c.ok());
    config_ = *c;
  }
  // Rewrites the header (data bytes unchanged) and returns LoadWeights' error.
  Status LoadWithHeader(const std::function<void(nlohmann::json&)>& edit) {
    Parsed p = Split(original_);
    edit(p.header);
    WriteAll(file_, Join(p.header, p.data));
    return Load();
  }
  Status Load() {
    auto w = LoadWeights(dir_.path(), config_);
    return w.ok() ? Status::Ok() : w.status();
  }
  // The tensor whose data comes last in the file.
  std::string LastTensor() {
    Parsed p = Split(original_);
    std::string last;
    uint64_t end = 0;
    for (const auto& [name, info] : p.header.items()) {
      if (name == "__metadata__") continue;
      if (info["data_offsets"][1].get<uint64_t>() > end) {
        end = info["data_offsets"][1].get<uint64_t>();
        last = name;
      }
    }
    return last;
  }
  static void ExpectNames(const Status& s, const std::string& file, const std::string& tensor) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
    if (!tensor.empty()) {
      EXPECT_NE(s.message().find("'" + tensor + "'"), std::string::npos) << s.message();
    }
  }

  ScratchDir dir_;
  std::string file_;
  std::string original_;
  ModelConfig config_;
};

TEST_F(CorruptWeights, IntactCopyLoads) { EXPECT_TRUE(Load().ok()); }

TEST_F(CorruptWeights, TruncatedBeforeHeaderLength) {
  WriteAll(file_, original_.substr(0, 5));
  const Status s = Load();
  ExpectNames(s, file_, "");
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
  WriteAll(file_, "");
  ExpectNames(Load(), file_, "");
}

TEST_F(CorruptWeights, HeaderLengthBeyondFile) {
  std::string bytes = original_;
  const uint64_t huge = original_.size();  // header "longer" than what follows
  std::memcpy(bytes.data(), &huge, 8);
  WriteAll(file_, bytes);
  const Status s = Load();
  ExpectNames(s, file_, "");
  EXPECT_NE(s.message().find("runs past the end of the file"), std::string::npos) << s.message();
  const uint64_t max = UINT64_MAX;
  std::memcpy(bytes.data(), &max, 8);
  WriteAll(file_, bytes);
  ExpectNames(Load(), file_, "");
}

TEST_F(CorruptWeights, TruncatedData) {
  const std::string last = LastTensor();
  WriteAll(file_, original_.substr(0, original_.size() - 10));
  const Status s = Load();
  ExpectNames(s, file_, last);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
  // Cut in the middle of the data too.
  WriteAll(file_, original_.substr(0, original_.size() / 2));
  ExpectNames(Load(), file_, "");
}

TEST_F(CorruptWeights, HeaderNotJson) {
  std::string bytes = original_;
  bytes[9] = '#';
  WriteAll(file_, bytes);
  ExpectNames(Load(), file_, "");
}

TEST_F(CorruptWeights, OutOfRangeOffsets) {
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const Status s = LoadWithHeader([&](nlohmann::json& h) {
    auto& off = h[name]["data_offsets"];
    const uint64_t len = off[1].get<uint64_t>() - off[0].get<uint64_t>();
    off = {1ull << 40, (1ull << 40) + len};
  });
  ExpectNames(s, file_, name);
  EXPECT_NE(s.message().find("run past the end"), std::string::npos) << s.message();
}

TEST_F(CorruptWeights, ReversedOffsets) {
  const std::string name = "model.norm.weight";
  const Status s = LoadWithHeader([&](nlohmann::json& h) {
    auto& off = h[name]["data_offsets"];
    off = {off[1], off[0]};
  });
  ExpectNames(s, file_, name);
}

TEST_F(CorruptWeights, OverlappingOffsets) {
  const std::string a = "model.layers.0.self_attn.k_proj.weight";
  const std::string b = "model.layers.0.self_attn.v_proj.weight";  // same shape as k_proj
  const Status s = LoadWithHeader([&](nlohmann::json& h) {
    auto off = h[a]["data_offsets"];
    const uint64_t shift = 4;  // one float into k_proj
    h[b]["data_offsets"] = {off[0].get<uint64_t>() + shift, off[1].get<uint64_t>() + shift};
  });
  ExpectNames(s, file_, "");
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s.message();
  EXPECT_TRUE(s.message().find("'" + a + "'") != std::string::npos ||
              s.message().find("'" + b + "'") != std::string::npos)
      << s.message();
}

TEST_F(CorruptWeights, DtypeDoesNotMatchByteSize) {
  const std::string name = "model.layers.1.mlp.up_proj.weight";
  const Status s = LoadWithHeader([&](nlohmann::json& h) { h[name]["dtype"] = "F16"; });
  ExpectNames(s, file_, name);
  EXPECT_NE(s.message().find("needs"), std::string::npos) << s.message();
}

TEST_F(CorruptWeights, UnsupportedDtype) {
  const std::string name = "model.norm.weight";
  const Status s = LoadWithHeader([&](nlohmann::json& h) { h[name]["dtype"] = "I32"; });
  ExpectNames(s, file_, name);
  EXPECT_NE(s.message().find("I32"), std::string::npos) << s.message();
}

TEST_F(CorruptWeights, ShapeMismatch) {
  const std::string name = "model.layers.1.self_attn.o_proj.weight";  // [8, 8]
  const Status s = LoadWithHeader([&](nlohmann::json& h) { h[name]["shape"] = {4, 16}; });
  ExpectNames(s, file_, name);
  EXPECT_NE(s.message().find("[4, 16]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[8, 8]"), std::string::npos) << s.message();
}

TEST_F(CorruptWeights, MissingTensor) {
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  const Status s = LoadWithHeader([&](nlohmann::json& h) { h.erase(name); });
  ExpectNames(s, file_, name);
  EXPECT_NE(s.message().find("missing tensor"), std::string::npos) << s.message();
}

TEST_F(CorruptWeights, MissingLmHeadWhenNotTied) {
  const Status s = LoadWithHeader([&](nlohmann::json& h) { h.erase("lm_head.weight"); });
  ExpectNames(s, file_, "lm_head.weight");
}

TEST_F(CorruptWeights, NoWeightFiles) {
  fs::remove(file_);
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
}

// Random byte flips in the length and header, and random truncations: every
// outcome is a clean load or an error naming the file (ASan/UBSan builds run
// this too).
TEST_F(CorruptWeights, RandomDamageNeverCrashes) {
  std::mt19937 rng(12345);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, original_.data(), 8);
  int errors = 0;
  for (int i = 0; i < 300; ++i) {
    std::string bytes = original_;
    if (i % 3 == 0) {
      bytes.resize(rng() % original_.size());
    } else {
      for (int k = 0; k < 1 + i % 4; ++k) {
        const size_t pos = rng() % (8 + header_bytes);
        bytes[pos] = static_cast<char>(rng() & 0xFF);
      }
    }
    WriteAll(file_, bytes);
    const Status s = Load();
    if (!s.ok()) {
      ++errors;
      EXPECT_NE(s.message().find(file_), std::string::npos) << s.message();
    }
  }
  EXPECT_GT(errors, 200);
}

class CorruptShards : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::copy(ModelDir("llama_bf16_sharded"), dir_.path(), fs::copy_options::recursive);
    auto c = LoadModelConfig(dir_.path());
    ASSERT_TRUE(c.ok());
    config_ = *c;
    index_ = nlohmann::json::parse(ReadAll(dir_ / "model.safetensors.index.json"));
  }
  Status Load() {
    auto w = LoadWeights(dir_.path(), config_);
    return w.ok() ? Status::Ok() : w.status();
  }
  ScratchDir dir_;
  ModelConfig config_;
  nlohmann::json index_;
};

TEST_F(CorruptShards, MissingShardFile) {
  fs::remove(dir_ / "model-00002-of-00003.safetensors");
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model-00002-of-00003.safetensors"), std::string::npos)
      << s.message();
}

TEST_F(CorruptShards, IndexPointsToWrongShard) {
  const std::string name = "model.layers.0.mlp.up_proj.weight";
  const std::string real = index_["weight_map"][name];
  const std::string other = real == "model-00001-of-00003.safetensors"
                                ? "model-00002-of-00003.safetensors"
                                : "model-00001-of-00003.safetensors";
  index_["weight_map"][name] = other;
  WriteAll(dir_ / "model.safetensors.index.json", index_.dump());
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(other), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
}

TEST_F(CorruptShards, TensorMissingFromIndex) {
  const std::string name = "model.norm.weight";
  index_["weight_map"].erase(name);
  WriteAll(dir_ / "model.safetensors.index.json", index_.dump());
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model.safetensors.index.json"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'" + name + "'"), std::string::npos) << s.message();
}

TEST_F(CorruptShards, ShardNameLeavingTheFolder) {
  index_["weight_map"]["model.norm.weight"] = "../../etc/passwd";
  WriteAll(dir_ / "model.safetensors.index.json", index_.dump());
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("invalid shard name"), std::string::npos) << s.message();
}

TEST_F(CorruptShards, TruncatedShard) {
  const std::string shard = dir_ / "model-00003-of-00003.safetensors";
  const std::string bytes = ReadAll(shard);
  WriteAll(shard, bytes.substr(0, bytes.size() - 3));
  const Status s = Load();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(shard), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tensor '"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace tandem::model
