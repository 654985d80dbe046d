#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer.h"
#include "model/utf8.h"
#include "test_util.h"

namespace tandem::model {
namespace {

using testing::FixtureDir;
using testing::ReadAll;

TEST(Utf8, IsValidUtf8) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("\xC3\xA9\xE6\x97\xA5\xF0\x9F\x98\x80"));  // é 日 😀
  EXPECT_TRUE(IsValidUtf8("\xF4\x8F\xBF\xBF"));                      // U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xC3"));                                 // truncated
  EXPECT_FALSE(IsValidUtf8("\xF0\x9F\x98"));                         // truncated
  EXPECT_FALSE(IsValidUtf8("\x80"));                                 // lone continuation
  EXPECT_FALSE(IsValidUtf8("\xC0\xAF"));                             // overlong
  EXPECT_FALSE(IsValidUtf8("\xE0\x80\xAF"));                         // overlong
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));                         // surrogate
  EXPECT_FALSE(IsValidUtf8("\xF4\x90\x80\x80"));                     // > U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xFF"));
  EXPECT_FALSE(IsValidUtf8(std::string("a\0\xFF", 3)));
}

class Detokenizer : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto tok = Tokenizer::Load(FixtureDir() + "/tokenizers/" + GetParam() + "/tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tok_ = std::move(tok).value();
  }
  std::unique_ptr<Tokenizer> tok_;
};

// Streaming every fixture string token by token: each Push output is valid
// UTF-8, and all of them together equal Decode.
TEST_P(Detokenizer, StreamsOnlyWholeCharacters) {
  const auto cases = nlohmann::json::parse(ReadAll(FixtureDir() + "/tokenizers/cases.json"));
  size_t split_chars = 0;  // tokens that ended inside a character
  for (bool skip : {true, false}) {
    for (const auto& c : cases[GetParam()]["cases"]) {
      const std::string text = c["text"];
      SCOPED_TRACE(text);
      const auto ids = tok_->Encode(text, true);
      IncrementalDetokenizer detok(tok_.get(), skip);
      std::string streamed;
      for (uint32_t id : ids) {
        const std::string piece = detok.Push(id);
        EXPECT_TRUE(IsValidUtf8(piece)) << "token " << id;
        if (!IsValidUtf8(tok_->TokenBytes(id))) ++split_chars;
        streamed += piece;
      }
      const std::string tail = detok.Flush();
      EXPECT_EQ(tail, "");
      EXPECT_EQ(streamed + tail, tok_->Decode(ids, skip));
      // With skipping, what Hugging Face's decode(skip_special_tokens=True) gives.
      if (skip) {
        EXPECT_EQ(streamed, c.value("decoded_skip_special", c.value("decoded", text)));
      }
    }
  }
  // The fixture really splits multi-byte characters across tokens.
  EXPECT_GT(split_chars, 10u);
}

TEST_P(Detokenizer, HoldsPartialCharacterUntilComplete) {
  // "😀" is four bytes; encode it and feed the tokens one at a time.
  const auto ids = tok_->Encode("\xF0\x9F\x98\x80!", false);
  ASSERT_GE(ids.size(), 2u);
  IncrementalDetokenizer detok(tok_.get());
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = detok.Push(ids[i]);
    EXPECT_TRUE(IsValidUtf8(piece));
    out += piece;
    if (out.empty()) continue;
    EXPECT_EQ(out.substr(0, 4), "\xF0\x9F\x98\x80");  // whole or nothing
  }
  EXPECT_EQ(out, "\xF0\x9F\x98\x80!");
}

TEST_P(Detokenizer, InvalidBytesBecomeReplacementCharacters) {
  // Single-byte tokens: a lone continuation byte, then a truncated sequence.
  std::vector<uint32_t> ids;
  for (unsigned char b : std::string("a\x80" "b\xE6\x97")) {
    // The token whose bytes are exactly `b`.
    std::optional<uint32_t> id;
    for (uint32_t i = 0; i < tok_->vocab_size() && !id; ++i) {
      if (tok_->TokenBytes(i) == std::string(1, static_cast<char>(b))) id = i;
    }
    ASSERT_TRUE(id.has_value()) << int(b);
    ids.push_back(*id);
  }
  IncrementalDetokenizer detok(tok_.get());
  std::string out;
  for (uint32_t id : ids) {
    const std::string piece = detok.Push(id);
    EXPECT_TRUE(IsValidUtf8(piece));
    out += piece;
  }
  EXPECT_EQ(out, "a\xEF\xBF\xBD" "b");  // the incomplete 日 is held
  EXPECT_EQ(detok.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(detok.Flush(), "");
}

// The proxy's way (one growing string per message, PushTo per token), over
// every token of the bundled model's vocabulary, in order and then each
// followed by an ASCII token: the same text as one Push per token into a
// string of its own, and as the whole sequence's bytes decoded at once
// (invalid bytes as U+FFFD).
TEST(DetokenizerVocabulary, AppendingInPlaceGivesTheDecodedTextForEveryToken) {
  auto tok = Tokenizer::Load(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  if (!tok.ok()) GTEST_SKIP() << "bundled model missing: " << tok.status().ToString();
  const Tokenizer& t = **tok;
  std::optional<uint32_t> ascii;
  size_t not_utf8 = 0;  // tokens that are not whole characters on their own
  for (uint32_t id = 0; id < t.vocab_size(); ++id) {
    const std::string b = t.TokenBytes(id);
    if (!IsValidUtf8(b)) ++not_utf8;
    if (!ascii && !b.empty() && !t.IsSpecial(id) &&
        std::all_of(b.begin(), b.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; })) {
      ascii = id;
    }
  }
  ASSERT_TRUE(ascii.has_value());
  EXPECT_GT(not_utf8, 0u);
  std::vector<uint32_t> in_order, interleaved;
  for (uint32_t id = 0; id < t.vocab_size(); ++id) {
    in_order.push_back(id);
    interleaved.push_back(id);
    interleaved.push_back(*ascii);
  }
  for (const auto* ids : {&in_order, &interleaved}) {
    for (bool skip : {true, false}) {
      IncrementalDetokenizer in_place(&t, skip), per_token(&t, skip);
      std::string message = "prefix ", pieces = "prefix ";
      for (uint32_t id : *ids) {
        const size_t before = message.size();
        in_place.PushTo(id, &message);
        EXPECT_TRUE(IsValidUtf8(std::string_view(message).substr(before))) << id;
        pieces += per_token.Push(id);
      }
      message += in_place.Flush();
      pieces += per_token.Flush();
      EXPECT_EQ(message, pieces);
      EXPECT_EQ(message, "prefix " + internal::SanitizeUtf8(t.Decode(*ids, skip)));
    }
  }
}

// The flat table (TokenBytesTable, the detokenizer's per-token lookup)
// holds every id's bytes and flags as TokenBytes / IsSpecial give them.
TEST(DetokenizerVocabulary, TheTokenTableAgreesWithTokenBytesForEveryToken) {
  auto tok = Tokenizer::Load(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  if (!tok.ok()) GTEST_SKIP() << "bundled model missing: " << tok.status().ToString();
  const Tokenizer& t = **tok;
  const TokenBytesTable* table = t.token_table();
  ASSERT_NE(table, nullptr);
  ASSERT_EQ(table->entries.size(), t.vocab_size());
  size_t ascii = 0, special = 0;
  for (uint32_t id = 0; id < t.vocab_size(); ++id) {
    const TokenBytesTable::Entry& e = table->entries[id];
    const std::string b = t.TokenBytes(id);
    EXPECT_EQ(table->Bytes(e), b) << id;
    EXPECT_EQ(bool(e.special), t.IsSpecial(id)) << id;
    EXPECT_EQ(bool(e.ascii), std::all_of(b.begin(), b.end(), [](char c) {
                return static_cast<uint8_t>(c) < 0x80;
              })) << id;
    ascii += e.ascii;
    special += e.special;
  }
  EXPECT_GT(ascii, 0u);
  EXPECT_LT(ascii, t.vocab_size());  // the vocabulary has non-ASCII tokens too
  EXPECT_GT(special, 0u);
}

// The same tokenizer without its table (the general path: AppendTokenBytes
// through the interface), to check the table's fast path against.
class NoTableTokenizer final : public Tokenizer {
 public:
  explicit NoTableTokenizer(const Tokenizer& t) : t_(t) {}
  std::vector<uint32_t> Encode(std::string_view text, bool add_special) const override {
    return t_.Encode(text, add_special);
  }
  std::string Decode(std::span<const uint32_t> ids, bool skip) const override {
    return t_.Decode(ids, skip);
  }
  std::string TokenBytes(uint32_t id) const override { return t_.TokenBytes(id); }
  bool IsSpecial(uint32_t id) const override { return t_.IsSpecial(id); }
  uint32_t vocab_size() const override { return t_.vocab_size(); }
  std::optional<uint32_t> TokenToId(std::string_view token) const override {
    return t_.TokenToId(token);
  }

 private:
  const Tokenizer& t_;
};

// Every token, in order, each after an ASCII one and each after a
// non-ASCII one (a character left incomplete before it, sometimes), plus
// ids past the vocabulary: the table's path streams exactly the text of
// the general path, piece by piece.
TEST(DetokenizerVocabulary, TheTablePathStreamsWhatTheGeneralPathStreams) {
  auto tok = Tokenizer::Load(std::string(TANDEM_SOURCE_DIR) + "/models/tandem-kjv");
  if (!tok.ok()) GTEST_SKIP() << "bundled model missing: " << tok.status().ToString();
  const Tokenizer& t = **tok;
  const NoTableTokenizer general(t);
  ASSERT_EQ(general.token_table(), nullptr);
  std::optional<uint32_t> ascii, non_ascii;
  for (uint32_t id = 0; id < t.vocab_size(); ++id) {
    const TokenBytesTable::Entry& e = t.token_table()->entries[id];
    if (e.special || e.size == 0) continue;
    if (e.ascii && !ascii) ascii = id;
    if (!e.ascii && !non_ascii) non_ascii = id;
  }
  ASSERT_TRUE(ascii && non_ascii);
  std::vector<uint32_t> ids;
  for (uint32_t id = 0; id < t.vocab_size(); ++id) ids.push_back(id);
  for (uint32_t id = 0; id < t.vocab_size(); ++id) {
    ids.push_back(*ascii);
    ids.push_back(id);
    ids.push_back(*non_ascii);
    ids.push_back(id);
  }
  ids.push_back(t.vocab_size());
  ids.push_back(*ascii);
  ids.push_back(t.vocab_size() + 1000);
  for (bool skip : {true, false}) {
    IncrementalDetokenizer fast(&t, skip), slow(&general, skip);
    std::string fast_out = "x", slow_out = "x";
    for (size_t i = 0; i < ids.size(); ++i) {
      fast.PushTo(ids[i], &fast_out);
      slow.PushTo(ids[i], &slow_out);
      ASSERT_EQ(fast_out, slow_out) << "token " << i << " id " << ids[i] << " skip " << skip;
    }
    EXPECT_EQ(fast.Flush(), slow.Flush());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Detokenizer, ::testing::Values("gpt2_style", "llama3_style"));

}  // namespace
}  // namespace tandem::model
