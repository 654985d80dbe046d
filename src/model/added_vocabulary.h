// Added tokens of a tokenizer.json ("added_tokens"): split out of the text
// before pre-tokenization, leftmost-longest, with Hugging Face's single_word,
// lstrip and rstrip rules. Tokens with normalized = false are split first,
// then those with normalized = true in what remains.
//
// Thread-safety: immutable after Create.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "model/pre_tokenizer.h"

namespace tandem::model::internal {

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

class AddedVocabulary {
 public:
  static Result<std::unique_ptr<AddedVocabulary>> Create(const nlohmann::json& added_tokens);

  struct Piece {
    std::string_view text;
    std::optional<uint32_t> id;  // set: the piece is this added token
  };
  // Splits `text`; pieces point into `text`.
  void Split(std::string_view text, std::vector<Piece>* out) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }
  std::optional<uint32_t> FindByContent(std::string_view content) const;

 private:
  AddedVocabulary() = default;
  // Candidates by first byte, longest first.
  struct MatchSet {
    std::array<std::vector<const AddedToken*>, 256> by_first_byte;
    bool empty = true;
  };
  void SplitWith(const MatchSet& set, std::string_view text, std::vector<Piece>* out) const;

  std::vector<AddedToken> tokens_;
  std::unordered_map<std::string, uint32_t> by_content_;
  MatchSet raw_set_;         // normalized = false
  MatchSet normalized_set_;  // normalized = true
  std::unique_ptr<Pcre2Regex> word_char_;  // ^\w, for single_word
};

}  // namespace tandem::model::internal
