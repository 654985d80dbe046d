// IncrementalDetokenizer and IsValidUtf8.
#include "model/tokenizer.h"
#include "model/utf8.h"

namespace tandem::model {

using internal::NextUtf8;
using internal::Utf8Kind;

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path.
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const auto st = NextUtf8(s, i);
    if (st.kind != Utf8Kind::kValid) return false;
    i += st.len_bytes;
  }
  return true;
}

std::string IncrementalDetokenizer::Push(uint32_t id) {
  std::string out;
  PushTo(id, &out);
  return out;
}

void IncrementalDetokenizer::PushTo(uint32_t id, std::string* out) {
  if (table_ != nullptr && pending_.empty()) {
    // The usual case (issue 23, mux-deliver): nothing held and an ASCII
    // token, whole text as it is: one table entry, its bytes appended. An
    // unknown id has no bytes (as AppendTokenBytes).
    if (id >= table_->entries.size()) return;
    const TokenBytesTable::Entry& e = table_->entries[id];
    if (e.ascii) {
      if (!(skip_special_ && e.special)) out->append(table_->Bytes(e));
      return;
    }
  }
  if (pending_.empty()) {
    // Nothing held (the usual case): the token's bytes go straight to
    // `out`; only a token that is not all ASCII goes the long way, from
    // its first non-ASCII byte on.
    const size_t start = out->size();
    tokenizer_->AppendTokenBytes(id, skip_special_, out);
    size_t i = start;
    while (i < out->size() && static_cast<uint8_t>((*out)[i]) < 0x80) ++i;
    if (i == out->size()) return;
    pending_.assign(*out, i);
    out->resize(i);
  } else {
    tokenizer_->AppendTokenBytes(id, skip_special_, &pending_);
  }
  size_t i = 0;
  // ASCII (most tokens) is complete as it is.
  while (i < pending_.size() && static_cast<uint8_t>(pending_[i]) < 0x80) ++i;
  if (i == pending_.size()) {
    out->append(pending_);
    pending_.clear();  // keeps its capacity
    return;
  }
  out->append(pending_, 0, i);
  while (i < pending_.size()) {
    const auto st = NextUtf8(pending_, i);
    if (st.kind == Utf8Kind::kIncomplete) break;  // wait for the rest of the character
    if (st.kind == Utf8Kind::kValid) {
      out->append(pending_, i, st.len_bytes);
    } else {
      out->append("\xEF\xBF\xBD");  // bytes that can never complete: U+FFFD
    }
    i += st.len_bytes;
  }
  pending_.erase(0, i);
}

std::string IncrementalDetokenizer::Flush() {
  std::string out = internal::SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::model
