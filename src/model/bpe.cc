#include "model/bpe.h"

#include <nlohmann/json.hpp>

#include <queue>

#include "model/utf8.h"

namespace tandem::model::internal {
namespace {

uint64_t PairKey(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::Create(const nlohmann::json& m) {
  std::unique_ptr<BpeModel> bpe(new BpeModel());
  try {
    if (!m.is_object() || m.value("type", std::string("BPE")) != "BPE") {
      return UnimplementedError("model: only type 'BPE' is supported, got " +
                                (m.is_object() ? m.value("type", std::string("?")) : m.dump()));
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(key) && !m[key].is_null() && !m[key].get<std::string>().empty()) {
        return UnimplementedError(std::string("model: '") + key + "' is not supported");
      }
    }
    bpe->ignore_merges_ = m.value("ignore_merges", false);
    bpe->fuse_unk_ = m.value("fuse_unk", false);
    if (!m.contains("vocab") || !m["vocab"].is_object()) {
      return InvalidArgumentError("model: missing object 'vocab'");
    }
    for (const auto& [token, id_json] : m["vocab"].items()) {
      if (!id_json.is_number_unsigned() || id_json.get<uint64_t>() >= kMaxId) {
        return InvalidArgumentError("model.vocab: token '" + token + "' has a bad id " +
                                    id_json.dump());
      }
      const uint32_t id = id_json.get<uint32_t>();
      bpe->vocab_[token] = id;
      if (id >= bpe->id_to_token_.size()) bpe->id_to_token_.resize(id + 1);
      bpe->id_to_token_[id] = token;
      std::string raw;
      if (TryByteLevelDecode(token, &raw)) bpe->bytes_vocab_.emplace(std::move(raw), id);
    }
    for (uint32_t& id : bpe->byte_id_) id = kNoId;
    const auto& b2c = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      AppendUtf8(b2c[b], &ch);
      auto it = bpe->vocab_.find(ch);
      if (it != bpe->vocab_.end()) bpe->byte_id_[b] = it->second;
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = bpe->vocab_.find(m["unk_token"].get<std::string>());
      if (it != bpe->vocab_.end()) bpe->unk_id_ = it->second;
    }
    if (m.contains("merges")) {
      if (!m["merges"].is_array()) return InvalidArgumentError("model: 'merges' must be a list");
      uint32_t rank = 0;
      for (const auto& merge : m["merges"]) {
        std::string a, b;
        if (merge.is_string()) {
          // Legacy form "a b".
          const std::string s = merge.get<std::string>();
          const size_t sp = s.find(' ');
          if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
            return InvalidArgumentError("model.merges[" + std::to_string(rank) +
                                        "]: expected \"a b\", got " + merge.dump());
          }
          a = s.substr(0, sp);
          b = s.substr(sp + 1);
        } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
                   merge[1].is_string()) {
          a = merge[0].get<std::string>();
          b = merge[1].get<std::string>();
        } else {
          return InvalidArgumentError("model.merges[" + std::to_string(rank) +
                                      "]: expected \"a b\" or [a, b], got " + merge.dump());
        }
        auto ia = bpe->vocab_.find(a);
        auto ib = bpe->vocab_.find(b);
        auto inew = bpe->vocab_.find(a + b);
        if (ia == bpe->vocab_.end() || ib == bpe->vocab_.end() || inew == bpe->vocab_.end()) {
          return InvalidArgumentError("model.merges[" + std::to_string(rank) + "]: " +
                                      merge.dump() + " uses a token missing from the vocab");
        }
        // A repeated pair takes its last rank, as Hugging Face's map build does.
        bpe->merges_[PairKey(ia->second, ib->second)] = MergeInfo{rank, inew->second};
        ++rank;
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(std::string("model: ") + e.what());
  }
  return bpe;
}

std::optional<uint32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::Tokenize(std::string_view word, std::vector<uint32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = bytes_vocab_.find(std::string(word));
    if (it != bytes_vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::unique_lock lock(cache_mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        ids->insert(ids->end(), it->second.begin(), it->second.end());
        return;
      }
    }
  }
  const size_t first = ids->size();
  MergeWord(word, ids);
  if (cacheable) {
    std::unique_lock lock(cache_mu_, std::try_to_lock);
    if (lock.owns_lock() && cache_.size() < kCacheCapacity) {
      cache_.emplace(std::move(key), std::vector<uint32_t>(ids->begin() + first, ids->end()));
    }
  }
}

void BpeModel::MergeWord(std::string_view word, std::vector<uint32_t>* ids) const {
  // Symbols as a doubly linked list over the word's bytes.
  struct Symbol {
    uint32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (unsigned char c : word) {
    uint32_t id = byte_id_[c];
    if (id == kNoId) {
      // Not in the vocabulary: the unknown token if there is one (fused when
      // asked), otherwise dropped, as Hugging Face does.
      if (!unk_id_) continue;
      if (fuse_unk_ && !sym.empty() && sym.back().id == *unk_id_) continue;
      id = *unk_id_;
    }
    const int32_t n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, -1, true});
    if (n > 0) sym[n - 1].next = n;
  }
  // Lowest rank first, then leftmost position (Hugging Face's Merge order).
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    uint32_t new_id;
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  auto push = [&](int32_t pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    auto it = merges_.find(PairKey(sym[pos].id, sym[sym[pos].next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = sym[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[left.next];
    auto it = merges_.find(PairKey(left.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    push(left.prev);
    push(top.pos);
  }
  for (const Symbol& s : sym) {
    if (s.alive) ids->push_back(s.id);
  }
}

}  // namespace tandem::model::internal
