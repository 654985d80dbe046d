// Chat templates: family detection from real templates' markers, rendering of
// each family (compared with what the Jinja templates produce), errors, and
// the bundled model's template.
#include "model/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "model/tokenizer.h"

namespace tandem::model {
namespace {

const std::vector<ChatMessage> kConversation = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Who?"}};

TEST(ChatTemplate, DetectsFamilies) {
  EXPECT_EQ(*ChatTemplate::Detect("{{'<|im_start|>' + message['role']}}"), ChatTemplateKind::kChatML);
  EXPECT_EQ(*ChatTemplate::Detect("{{ '<|start_header_id|>' + message['role'] }}"),
            ChatTemplateKind::kLlama3);
  EXPECT_EQ(*ChatTemplate::Detect("{{ '[INST] ' + message['content'] + ' [/INST]' }}"),
            ChatTemplateKind::kMistral);
  auto unknown = ChatTemplate::Detect("{{ message['content'] }}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("proxy.chat_template"), std::string::npos);
}

TEST(ChatTemplate, ChatML) {
  auto t = ChatTemplate::FromName("chatml");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t->Render(kConversation),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(*t->Render({{"user", "x"}}, false), "<|im_start|>user\nx<|im_end|>\n");
}

TEST(ChatTemplate, Llama3) {
  auto t = ChatTemplate::FromName("llama3");
  ASSERT_TRUE(t.ok());
  // Llama 3's template trims every content.
  EXPECT_EQ(*t->Render({{"system", " Be brief. "}, {"user", "Hi\n"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, MistralFoldsSystemAndChecksAlternation) {
  auto t = ChatTemplate::FromName("mistral");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t->Render(kConversation),
            "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Who? [/INST]");
  auto bad = t->Render({{"user", "a"}, {"user", "b"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("messages[1].role"), std::string::npos)
      << bad.status().message();
}

TEST(ChatTemplate, RefusesUnknownRolesAndEmptyConversations) {
  auto t = ChatTemplate::FromName("chatml");
  auto bad = t->Render({{"user", "a"}, {"wizard", "b"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("messages[1].role is 'wizard'"), std::string::npos);
  EXPECT_FALSE(t->Render({}).ok());
  EXPECT_FALSE(ChatTemplate::FromName("jinja").ok());
  // developer (OpenAI's newer name for system) renders as system.
  EXPECT_EQ(*t->Render({{"developer", "d"}}, false), "<|im_start|>system\nd<|im_end|>\n");
}

TEST(ChatTemplate, LoadsFromTokenizerConfigAndNamesMissingTemplates) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem_chat_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "tokenizer_config.json")
        << R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": [{"name": "default", "template": "{{ '[INST] ' }}"}]})";
  }
  auto t = ChatTemplate::Load(dir.string(), "auto");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->name(), "mistral");
  EXPECT_EQ(t->origin(), "tokenizer_config.json");
  EXPECT_EQ(*t->Render({{"user", "q"}, {"assistant", "a"}}), "<s>[INST] q [/INST]a</s>");
  auto named = ChatTemplate::Load(dir.string(), "chatml");
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->origin(), "config");
  { std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": "<s>"})"; }
  auto none = ChatTemplate::Load(dir.string(), "auto");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no chat_template"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplate, BundledModelIsChatMLAndItsMarkersAreSingleTokens) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) GTEST_SKIP() << "bundled model missing";
  auto t = ChatTemplate::Load(dir, "auto");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->name(), "chatml");
  auto tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok());
  const auto ids = (*tok)->Encode(*t->Render({{"user", "Hi"}}), false);
  const auto start = (*tok)->TokenToId("<|im_start|>");
  const auto end = (*tok)->TokenToId("<|im_end|>");
  ASSERT_TRUE(start && end);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), *start);  // no BOS added: the template decides
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *start), 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *end), 1);
}

}  // namespace
}  // namespace tandem::model
