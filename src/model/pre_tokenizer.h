// The pre-tokenizer of a byte-level BPE tokenizer.json: Split (PCRE2 regex or
// literal, with Hugging Face's split behaviours), Digits, Sequence, and the
// final ByteLevel step (optional prefix space, optional GPT-2 regex). The
// byte-level character mapping itself is left to the BPE model, which works on
// raw bytes.
//
// Thread-safety: immutable after Create; Run may be called from any thread.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::model::internal {

// A compiled PCRE2 pattern in UTF + UCP mode (Unicode \s, \p{L}, lookaheads).
class Pcre2Regex {
 public:
  // `literal`: match `pattern` as a plain string.
  static Result<std::unique_ptr<Pcre2Regex>> Compile(const std::string& pattern, bool literal);
  ~Pcre2Regex();
  Pcre2Regex(const Pcre2Regex&) = delete;
  Pcre2Regex& operator=(const Pcre2Regex&) = delete;

  // Byte ranges [begin, end) of the non-overlapping, non-empty matches in `s`
  // (which must be valid UTF-8), left to right.
  void FindAll(std::string_view s, std::vector<std::pair<size_t, size_t>>* matches) const;

 private:
  Pcre2Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
};

class PreTokenizer {
 public:
  // `config` is tokenizer.json's "pre_tokenizer"; it must contain a ByteLevel
  // step, and nothing may follow it.
  static Result<std::unique_ptr<PreTokenizer>> Create(const nlohmann::json& config);
  ~PreTokenizer();

  // Splits `text` (valid UTF-8) into words for the BPE model, appended to `words`.
  void Run(std::string_view text, std::vector<std::string>* words) const;

  struct Step;

 private:
  PreTokenizer() = default;
  std::vector<std::unique_ptr<Step>> steps_;
};

}  // namespace tandem::model::internal
