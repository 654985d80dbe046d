#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/pre_tokenizer.h"

#include <pcre2.h>

#include <algorithm>

#include <nlohmann/json.hpp>

namespace tandem::model::internal {
namespace {

// GPT-2's pattern, used by ByteLevel when use_regex is true (as in
// Hugging Face tokenizers' byte_level.rs).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Result<Behavior> ParseBehavior(const std::string& s) {
  if (s == "Removed") return Behavior::kRemoved;
  if (s == "Isolated") return Behavior::kIsolated;
  if (s == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::kMergedWithNext;
  if (s == "Contiguous") return Behavior::kContiguous;
  return InvalidArgumentError("unknown split behavior '" + s + "'");
}

struct Span {
  size_t begin, end;
  bool is_match;
};

// Hugging Face's NormalizedString::split: the pieces of `s` around and at the
// regex matches, combined according to `behavior`; empty pieces dropped.
void SplitPieces(std::string_view s, const Pcre2Regex& re, Behavior behavior, bool invert,
                 std::vector<std::string>* out) {
  std::vector<std::pair<size_t, size_t>> found;
  re.FindAll(s, &found);
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [b, e] : found) {
    if (prev != b) spans.push_back({prev, b, false});
    spans.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
  if (invert) {
    for (Span& sp : spans) sp.is_match = !sp.is_match;
  }
  std::vector<std::pair<size_t, size_t>> pieces;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const Span& sp : spans) {
        if (!sp.is_match) pieces.emplace_back(sp.begin, sp.end);
      }
      break;
    case Behavior::kIsolated:
      for (const Span& sp : spans) pieces.emplace_back(sp.begin, sp.end);
      break;
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.is_match && !previous_match && !pieces.empty()) {
          pieces.back().second = sp.end;
        } else {
          pieces.emplace_back(sp.begin, sp.end);
        }
        previous_match = sp.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !pieces.empty()) {
          pieces.back().first = it->begin;
        } else {
          pieces.emplace_back(it->begin, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.is_match == previous_match && !pieces.empty()) {
          pieces.back().second = sp.end;
        } else {
          pieces.emplace_back(sp.begin, sp.end);
        }
        previous_match = sp.is_match;
      }
      break;
    }
  }
  for (const auto& [b, e] : pieces) {
    if (e > b) out->emplace_back(s.substr(b, e - b));
  }
}

}  // namespace

// ---- Pcre2Regex ----

Result<std::unique_ptr<Pcre2Regex>> Pcre2Regex::Compile(const std::string& pattern, bool literal) {
  std::unique_ptr<Pcre2Regex> re(new Pcre2Regex());
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(error_code, buf, sizeof buf);
    return InvalidArgumentError("regex /" + pattern + "/ does not compile at offset " +
                                std::to_string(error_offset) + ": " +
                                reinterpret_cast<const char*>(buf));
  }
  // JIT is an optimisation only; the interpreter is used when it is unavailable.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  re->code_ = code;
  return re;
}

Pcre2Regex::~Pcre2Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Pcre2Regex::FindAll(std::string_view s,
                         std::vector<std::pair<size_t, size_t>>* matches) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  size_t start = 0;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (start <= s.size()) {
    // The caller validated the UTF-8 once; checking again at every call would
    // make a long text quadratic.
    const int rc = pcre2_match(code, subject, s.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      matches->emplace_back(b, e);
      start = e;
    } else {
      // Empty match: step over one character.
      if (b >= s.size()) break;
      size_t next = b + 1;
      while (next < s.size() && (static_cast<uint8_t>(s[next]) & 0xC0) == 0x80) ++next;
      start = next;
    }
  }
  pcre2_match_data_free(md);
}

// ---- PreTokenizer ----

struct PreTokenizer::Step {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  std::unique_ptr<Pcre2Regex> regex;  // kSplit; kByteLevel with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

PreTokenizer::~PreTokenizer() = default;

namespace {

Status AddSteps(const nlohmann::json& c, std::vector<std::unique_ptr<PreTokenizer::Step>>* steps) {
  if (!c.is_object() || !c.contains("type") || !c["type"].is_string()) {
    return InvalidArgumentError("pre_tokenizer entry without a 'type': " + c.dump());
  }
  const std::string type = c["type"].get<std::string>();
  if (type == "Sequence") {
    if (!c.contains("pretokenizers") || !c["pretokenizers"].is_array()) {
      return InvalidArgumentError("Sequence pre_tokenizer without 'pretokenizers'");
    }
    for (const auto& sub : c["pretokenizers"]) TANDEM_RETURN_IF_ERROR(AddSteps(sub, steps));
    return Status::Ok();
  }
  auto step = std::make_unique<PreTokenizer::Step>();
  if (type == "Split") {
    const auto& pattern = c.value("pattern", nlohmann::json());
    bool literal;
    std::string text;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      literal = false;
      text = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      literal = true;
      text = pattern["String"].get<std::string>();
    } else {
      return InvalidArgumentError("Split pre_tokenizer needs pattern.Regex or pattern.String");
    }
    auto re = Pcre2Regex::Compile(text, literal);
    if (!re.ok()) return re.status().WithContext("Split pre_tokenizer");
    step->regex = std::move(re).value();
    TANDEM_ASSIGN_OR_RETURN(step->behavior, ParseBehavior(c.value("behavior", "Isolated")));
    step->invert = c.value("invert", false);
  } else if (type == "Digits") {
    // Hugging Face: split on char::is_numeric, each digit alone or in runs.
    auto re = Pcre2Regex::Compile(R"(\p{N})", false);
    if (!re.ok()) return re.status();
    step->regex = std::move(re).value();
    step->behavior =
        c.value("individual_digits", false) ? Behavior::kIsolated : Behavior::kContiguous;
  } else if (type == "ByteLevel") {
    step->kind = PreTokenizer::Step::Kind::kByteLevel;
    step->add_prefix_space = c.value("add_prefix_space", false);
    if (c.value("use_regex", true)) {
      auto re = Pcre2Regex::Compile(kGpt2Pattern, false);
      if (!re.ok()) return re.status();
      step->regex = std::move(re).value();
    }
  } else {
    return UnimplementedError("pre_tokenizer type '" + type +
                              "' is not supported (Sequence, Split, Digits, ByteLevel)");
  }
  steps->push_back(std::move(step));
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::Create(const nlohmann::json& config) {
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  if (config.is_null()) {
    return UnimplementedError("tokenizer without a pre_tokenizer: only byte-level BPE is supported");
  }
  try {
    TANDEM_RETURN_IF_ERROR(AddSteps(config, &p->steps_));
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(std::string("pre_tokenizer: ") + e.what());
  }
  const bool byte_level_last =
      !p->steps_.empty() && p->steps_.back()->kind == Step::Kind::kByteLevel;
  size_t byte_level_count = 0;
  for (const auto& s : p->steps_) byte_level_count += s->kind == Step::Kind::kByteLevel;
  if (!byte_level_last || byte_level_count != 1) {
    return UnimplementedError(
        "pre_tokenizer must end with one ByteLevel step (only byte-level BPE is supported)");
  }
  return p;
}

void PreTokenizer::Run(std::string_view text, std::vector<std::string>* words) const {
  std::vector<std::string> cur;
  std::vector<std::string> next;
  if (!text.empty()) cur.emplace_back(text);
  for (const auto& step : steps_) {
    next.clear();
    for (std::string& piece : cur) {
      if (step->kind == Step::Kind::kByteLevel) {
        if (step->add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
        if (step->regex) {
          SplitPieces(piece, *step->regex, Behavior::kIsolated, false, &next);
        } else {
          next.push_back(std::move(piece));
        }
      } else {
        SplitPieces(piece, *step->regex, step->behavior, step->invert, &next);
      }
    }
    std::swap(cur, next);
  }
  for (std::string& w : cur) words->push_back(std::move(w));
}

}  // namespace tandem::model::internal
