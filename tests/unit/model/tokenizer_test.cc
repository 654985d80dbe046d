#include "model/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <random>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/utf8.h"
#include "test_util.h"

namespace tandem::model {
namespace {

using testing::FixtureDir;
using testing::ReadAll;
using testing::ScratchDir;
using testing::WriteAll;

const nlohmann::json& Cases() {
  static const nlohmann::json cases =
      nlohmann::json::parse(ReadAll(FixtureDir() + "/tokenizers/cases.json"));
  return cases;
}

std::string TokenizerPath(const std::string& name) {
  const auto& entry = Cases()[name];
  if (entry.contains("path")) {
    return std::string(TANDEM_SOURCE_DIR) + "/" + entry["path"].get<std::string>();
  }
  return FixtureDir() + "/tokenizers/" + name + "/tokenizer.json";
}

std::string Fnv1a64(const std::string& data) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : data) h = (h ^ c) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string Show(const std::vector<uint32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

// The fixture stores decoded strings only where they differ from the text.
std::string DecodedOf(const nlohmann::json& c) {
  return c.value("decoded", c["text"].get<std::string>());
}
std::string DecodedSkipOf(const nlohmann::json& c) {
  return c.value("decoded_skip_special", DecodedOf(c));
}

// Encode/Decode equal Hugging Face tokenizers' on every fixture string.
void ExpectMatchesHuggingFace(const std::string& name) {
  const std::string path = TokenizerPath(name);
  const auto& entry = Cases()[name];
  if (entry.contains("fnv1a64")) {
    if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent";
    if (Fnv1a64(ReadAll(path)) != entry["fnv1a64"].get<std::string>()) {
      GTEST_SKIP() << path << " changed since the fixture was made; rerun "
                   << "tools/make_model_fixtures.py";
    }
  }
  auto tok = Tokenizer::Load(path);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), entry["vocab_size"].get<uint32_t>());
  size_t checked = 0;
  for (const auto& c : entry["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: \"" + text + "\"");
    const auto ids = c["ids"].get<std::vector<uint32_t>>();
    const auto got = (*tok)->Encode(text, false);
    EXPECT_EQ(got, ids) << "tandem " << Show(got) << "\nhf     " << Show(ids);
    EXPECT_EQ((*tok)->Encode(text, true), c["ids_with_special"].get<std::vector<uint32_t>>());
    EXPECT_EQ((*tok)->Decode(ids, false), DecodedOf(c));
    EXPECT_EQ((*tok)->Decode(ids, true), DecodedSkipOf(c));
    ++checked;
  }
  EXPECT_GE(checked, 60u);
}

TEST(Tokenizer, Gpt2StyleMatchesHuggingFace) { ExpectMatchesHuggingFace("gpt2_style"); }
TEST(Tokenizer, Llama3StyleMatchesHuggingFace) { ExpectMatchesHuggingFace("llama3_style"); }
TEST(Tokenizer, BundledModelMatchesHuggingFace) {
  if (!Cases().contains("tandem-kjv")) GTEST_SKIP() << "no bundled-model cases in the fixture";
  ExpectMatchesHuggingFace("tandem-kjv");
}

TEST(Tokenizer, SpecialTokensAndLookups) {
  auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/llama3_style");  // a directory
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const auto bos = (*tok)->TokenToId("<|begin_of_text|>");
  const auto eot = (*tok)->TokenToId("<|eot_id|>");
  ASSERT_TRUE(bos.has_value());
  ASSERT_TRUE(eot.has_value());
  EXPECT_TRUE((*tok)->IsSpecial(*eot));
  EXPECT_EQ((*tok)->TokenBytes(*eot), "<|eot_id|>");
  const auto hello = (*tok)->Encode("Hello", false);
  ASSERT_FALSE(hello.empty());
  EXPECT_FALSE((*tok)->IsSpecial(hello[0]));
  const auto with_bos = (*tok)->Encode("Hello", true);
  ASSERT_EQ(with_bos.size(), hello.size() + 1);
  EXPECT_EQ(with_bos[0], *bos);
  EXPECT_EQ((*tok)->Encode("a<|eot_id|>b", false).at(1), *eot);
  // ignore_merges: a whole word in the vocabulary that no merge reaches.
  const auto whole = (*tok)->TokenToId("Ġunreachable");
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ((*tok)->Encode(" unreachable", false), std::vector<uint32_t>{*whole});
  EXPECT_EQ((*tok)->TokenBytes(*whole), " unreachable");
  EXPECT_EQ((*tok)->TokenBytes(4000000), "");
  EXPECT_FALSE((*tok)->TokenToId("no such token").has_value());
}

TEST(Tokenizer, InvalidUtf8InputIsReplacedNotCrashing) {
  auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/gpt2_style/tokenizer.json");
  ASSERT_TRUE(tok.ok());
  const auto ids = (*tok)->Encode("ab\xff\xfe c\xe2\x82", false);
  EXPECT_EQ((*tok)->Decode(ids), "ab\xEF\xBF\xBD\xEF\xBF\xBD c\xEF\xBF\xBD");
}

TEST(Tokenizer, ConcurrentEncodeEqualsSerial) {
  auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/llama3_style/tokenizer.json");
  ASSERT_TRUE(tok.ok());
  std::vector<std::string> texts;
  for (const auto& c : Cases()["llama3_style"]["cases"]) texts.push_back(c["text"]);
  std::vector<std::vector<uint32_t>> serial;
  for (const auto& t : texts) serial.push_back((*tok)->Encode(t, false));
  std::vector<int> mismatches(4, 0);
  {
    std::vector<std::jthread> threads;
    for (int th = 0; th < 4; ++th) {
      threads.emplace_back([&, th] {
        for (int rep = 0; rep < 20; ++rep) {
          for (size_t i = 0; i < texts.size(); ++i) {
            mismatches[th] += (*tok)->Encode(texts[i], false) != serial[i];
          }
        }
      });
    }
  }
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(Tokenizer, LongInputIsNotQuadratic) {
  auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/llama3_style/tokenizer.json");
  ASSERT_TRUE(tok.ok());
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "The quick brown fox, 123 ";
  text += std::string(20000, 'a');  // one 20k-byte word
  const auto ids = (*tok)->Encode(text, false);
  EXPECT_EQ((*tok)->Decode(ids), text);
}

// Arbitrary bytes: Encode never fails, and decoding gives the input back with
// invalid sequences as U+FFFD (byte-level BPE loses nothing else).
TEST(Tokenizer, RandomBytesRoundTrip) {
  auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/llama3_style/tokenizer.json");
  ASSERT_TRUE(tok.ok());
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) {
      // Mostly ASCII and UTF-8 lead/continuation bytes.
      const uint32_t r = rng() % 4;
      c = static_cast<char>(r == 0 ? 0x80 + rng() % 0x40 : r == 1 ? 0xC2 + rng() % 0x33 : rng());
    }
    const auto ids = (*tok)->Encode(s, false);
    EXPECT_EQ((*tok)->Decode(ids), internal::SanitizeUtf8(s));
  }
}

// tokenizer.json variants that must be refused with a message.
std::string LoadError(const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(
      ReadAll(FixtureDir() + "/tokenizers/llama3_style/tokenizer.json"));
  edit(j);
  ScratchDir dir;
  WriteAll(dir / "tokenizer.json", j.dump());
  auto tok = Tokenizer::Load(dir.path());
  EXPECT_FALSE(tok.ok());
  return tok.ok() ? "" : tok.status().message();
}

TEST(Tokenizer, LoadErrors) {
  EXPECT_NE(LoadError([](auto& j) { j["model"]["type"] = "WordPiece"; }).find("WordPiece"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) { j["pre_tokenizer"] = nullptr; }).find("byte-level"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) {
              j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
            }).find("does not compile"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) { j["pre_tokenizer"]["type"] = "Whitespace"; })
                .find("Whitespace"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) {
              j["model"]["merges"][0] = nlohmann::json::array({"Ġ", "not-in-vocab"});
            }).find("merges[0]"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) { j["normalizer"] = {{"type", "Lowercase"}}; })
                .find("Lowercase"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) { j["model"]["vocab"]["Ġhuge"] = 4000000000u; }).find("bad id"),
            std::string::npos);
  EXPECT_NE(LoadError([](auto& j) { j["post_processor"] = {{"type", "Mystery"}}; }).find("Mystery"),
            std::string::npos);
  const std::string e = LoadError([](auto& j) { j["model"]["vocab"] = 5; });
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  ScratchDir dir;
  WriteAll(dir / "tokenizer.json", "[1, 2");
  EXPECT_FALSE(Tokenizer::Load(dir.path()).ok());
  EXPECT_FALSE(Tokenizer::Load(dir / "absent.json").ok());
}

}  // namespace
}  // namespace tandem::model
