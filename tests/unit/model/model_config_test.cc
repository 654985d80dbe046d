#include "model/model_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace tandem::model {
namespace {

using testing::FixtureDir;
using testing::ScratchDir;
using testing::WriteAll;

std::string Models() { return FixtureDir() + "/models/"; }
std::string Configs() { return FixtureDir() + "/configs/"; }

TEST(ModelConfig, LlamaTransformers4WithLlama3RopeScaling) {
  auto c = LoadModelConfig(Models() + "llama_f32");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->vocab_size, 32u);
  EXPECT_EQ(c->hidden_size, 8u);
  EXPECT_EQ(c->intermediate_size, 12u);
  EXPECT_EQ(c->num_hidden_layers, 2u);
  EXPECT_EQ(c->num_attention_heads, 4u);
  EXPECT_EQ(c->num_key_value_heads, 2u);
  EXPECT_EQ(c->head_dim, 2u);  // hidden_size / num_attention_heads
  EXPECT_EQ(c->max_position_embeddings, 128u);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 64u);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->torch_dtype, "float32");
  // generation_config.json's list wins over config.json's single id.
  EXPECT_EQ(c->eos_token_ids, (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->sliding_window, 0u);
}

TEST(ModelConfig, LlamaTransformers5RopeParametersAndExplicitHeadDim) {
  auto c = LoadModelConfig(Models() + "llama_bf16_sharded");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 6u);  // explicit, not 8 / 4
  EXPECT_EQ(c->rope.type, "default");
  EXPECT_DOUBLE_EQ(c->rope.theta, 10000.0);
  EXPECT_EQ(c->torch_dtype, "bfloat16");  // transformers 5 writes "dtype"
  EXPECT_EQ(c->eos_token_ids, (std::vector<uint32_t>{2}));  // no generation_config.json

  auto l3 = LoadModelConfig(Configs() + "llama_tf5_llama3");
  ASSERT_TRUE(l3.ok()) << l3.status().ToString();
  EXPECT_EQ(l3->rope.type, "llama3");
  EXPECT_DOUBLE_EQ(l3->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(l3->rope.factor, 32.0);
  EXPECT_EQ(l3->rope.original_max_position_embeddings, 8192u);
}

TEST(ModelConfig, Qwen2HasBiasAndTiedEmbeddings) {
  auto c = LoadModelConfig(Models() + "qwen2_f16_tied");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c->rope.theta, 1000000.0);
  EXPECT_EQ(c->torch_dtype, "float16");
  EXPECT_EQ(c->sliding_window, 0u);  // use_sliding_window is false
}

TEST(ModelConfig, MistralAndOtherVariants) {
  auto m = LoadModelConfig(Models() + "mistral_f16_sharded");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->architecture, "MistralForCausalLM");
  EXPECT_EQ(m->sliding_window, 0u);  // null in the file

  auto lin = LoadModelConfig(Configs() + "llama_linear");
  ASSERT_TRUE(lin.ok()) << lin.status().ToString();
  EXPECT_EQ(lin->rope.type, "linear");  // older spelling "type"
  EXPECT_DOUBLE_EQ(lin->rope.factor, 2.0);

  auto mha = LoadModelConfig(Configs() + "llama_no_kv_heads");
  ASSERT_TRUE(mha.ok()) << mha.status().ToString();
  EXPECT_EQ(mha->num_key_value_heads, mha->num_attention_heads);
}

TEST(ModelConfig, UnsupportedRopeTypeIsAClearError) {
  auto c = LoadModelConfig(Configs() + "llama_yarn");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(c.status().message().find("'yarn'"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("config.json"), std::string::npos);
}

// Writes `j` as DIR/config.json and returns LoadModelConfig's error message.
std::string ErrorFor(const nlohmann::json& j) {
  ScratchDir dir;
  WriteAll(dir / "config.json", j.dump());
  auto c = LoadModelConfig(dir.path());
  EXPECT_FALSE(c.ok()) << j.dump();
  return c.ok() ? "" : c.status().message();
}

nlohmann::json Base() {
  return nlohmann::json::parse(testing::ReadAll(Models() + "llama_f32/config.json"));
}

TEST(ModelConfig, Errors) {
  {
    auto j = Base();
    j.erase("hidden_size");
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("config.json: missing required key 'hidden_size'"), std::string::npos) << e;
  }
  {
    auto j = Base();
    j["num_key_value_heads"] = 3;
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("'num_key_value_heads' (3) must divide 'num_attention_heads' (4)"),
              std::string::npos)
        << e;
  }
  {
    auto j = Base();
    j["architectures"] = {"GPT2LMHeadModel"};
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("architecture 'GPT2LMHeadModel' is not supported"), std::string::npos) << e;
  }
  {
    auto j = Base();
    j["num_attention_heads"] = 3;  // 8 % 3 != 0, no head_dim
    j["num_key_value_heads"] = 1;
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("must divide 'hidden_size'"), std::string::npos) << e;
  }
  {
    auto j = Base();
    j["vocab_size"] = "many";
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("'vocab_size' must be a non-negative integer"), std::string::npos) << e;
  }
  {
    auto j = Base();
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
    const std::string e = ErrorFor(j);
    EXPECT_NE(e.find("low_freq_factor"), std::string::npos) << e;
  }
  {
    auto j = Base();
    j["mlp_bias"] = true;
    EXPECT_NE(ErrorFor(j).find("'mlp_bias'"), std::string::npos);
  }
  {
    auto j = Base();
    j.erase("architectures");
    EXPECT_NE(ErrorFor(j).find("'architectures'"), std::string::npos);
  }
  {
    ScratchDir dir;
    WriteAll(dir / "config.json", "{ not json");
    auto c = LoadModelConfig(dir.path());
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("config.json: not valid JSON"), std::string::npos);
  }
  {
    ScratchDir dir;
    auto c = LoadModelConfig(dir.path());
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  }
  {
    ScratchDir dir;
    WriteAll(dir / "config.json", Base().dump());
    WriteAll(dir / "generation_config.json", R"({"eos_token_id": [2, 99]})");
    auto c = LoadModelConfig(dir.path());
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("eos token id 99"), std::string::npos);
  }
}

}  // namespace
}  // namespace tandem::model
