#include "model/added_vocabulary.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "model/bpe.h"
#include "model/tokenizer.h"
#include "model/utf8.h"

namespace tandem::model::internal {

Result<std::unique_ptr<AddedVocabulary>> AddedVocabulary::Create(const nlohmann::json& list) {
  std::unique_ptr<AddedVocabulary> v(new AddedVocabulary());
  auto re = Pcre2Regex::Compile(R"(^\w)", false);
  if (!re.ok()) return re.status();
  v->word_char_ = std::move(re).value();
  if (list.is_null()) return v;
  if (!list.is_array()) return InvalidArgumentError("'added_tokens' must be a list");
  try {
    for (const auto& t : list) {
      AddedToken a;
      if (!t.contains("id") || !t["id"].is_number_unsigned() || !t.contains("content") ||
          !t["content"].is_string() || t["id"].get<uint64_t>() >= BpeModel::kMaxId) {
        return InvalidArgumentError("added_tokens: entry needs 'id' and 'content': " + t.dump());
      }
      a.id = t["id"].get<uint32_t>();
      a.content = t["content"].get<std::string>();
      if (a.content.empty()) return InvalidArgumentError("added_tokens: empty content");
      if (!IsValidUtf8(a.content)) {
        return InvalidArgumentError("added_tokens: content of id " + std::to_string(a.id) +
                                    " is not valid UTF-8");
      }
      a.single_word = t.value("single_word", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.normalized = t.value("normalized", false);
      a.special = t.value("special", false);
      v->tokens_.push_back(std::move(a));
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(std::string("added_tokens: ") + e.what());
  }
  for (const AddedToken& a : v->tokens_) {
    v->by_content_[a.content] = a.id;
    MatchSet& set = a.normalized ? v->normalized_set_ : v->raw_set_;
    set.by_first_byte[static_cast<uint8_t>(a.content[0])].push_back(&a);
    set.empty = false;
  }
  for (MatchSet* set : {&v->raw_set_, &v->normalized_set_}) {
    for (auto& cands : set->by_first_byte) {
      std::stable_sort(cands.begin(), cands.end(), [](const AddedToken* x, const AddedToken* y) {
        return x->content.size() > y->content.size();
      });
    }
  }
  return v;
}

std::optional<uint32_t> AddedVocabulary::FindByContent(std::string_view content) const {
  auto it = by_content_.find(std::string(content));
  if (it == by_content_.end()) return std::nullopt;
  return it->second;
}

void AddedVocabulary::Split(std::string_view text, std::vector<Piece>* out) const {
  std::vector<Piece> first;
  SplitWith(raw_set_, text, &first);
  for (const Piece& p : first) {
    if (p.id) {
      out->push_back(p);
    } else {
      SplitWith(normalized_set_, p.text, out);
    }
  }
}

void AddedVocabulary::SplitWith(const MatchSet& set, std::string_view s,
                                std::vector<Piece>* out) const {
  if (set.empty) {
    if (!s.empty()) out->push_back({s, std::nullopt});
    return;
  }
  auto is_word_char = [&](std::string_view ch) {
    std::vector<std::pair<size_t, size_t>> m;
    word_char_->FindAll(ch, &m);
    return !m.empty();
  };
  size_t start_offset = 0;  // end of the last emitted piece
  size_t pos = 0;           // where the search resumes
  while (pos < s.size()) {
    const AddedToken* hit = nullptr;
    for (const AddedToken* cand : set.by_first_byte[static_cast<uint8_t>(s[pos])]) {
      if (s.compare(pos, cand->content.size(), cand->content) == 0) {
        hit = cand;  // longest first
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + hit->content.size();
    pos = stop;
    if (hit->single_word) {
      bool word_before = false;
      if (start > 0) {
        size_t b = start - 1;
        while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
        word_before = is_word_char(s.substr(b, start - b));
      }
      bool word_after = false;
      if (stop < s.size()) {
        const Utf8Step st = NextUtf8(s, stop);
        word_after = is_word_char(s.substr(stop, st.len_bytes));
      }
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      size_t b = start;
      while (b > start_offset) {
        size_t c = b - 1;
        while (c > 0 && (static_cast<uint8_t>(s[c]) & 0xC0) == 0x80) --c;
        const Utf8Step st = NextUtf8(s, c);
        if (st.kind != Utf8Kind::kValid || !IsUnicodeWhitespace(st.code_point)) break;
        b = c;
      }
      start = std::max(b, start_offset);
    }
    if (hit->rstrip) {
      while (stop < s.size()) {
        const Utf8Step st = NextUtf8(s, stop);
        if (st.kind != Utf8Kind::kValid || !IsUnicodeWhitespace(st.code_point)) break;
        stop += st.len_bytes;
      }
      pos = stop;
    }
    if (start_offset < start) out->push_back({s.substr(start_offset, start - start_offset), {}});
    out->push_back({s.substr(start, stop - start), hit->id});
    start_offset = stop;
  }
  if (start_offset < s.size()) out->push_back({s.substr(start_offset), std::nullopt});
}

}  // namespace tandem::model::internal
