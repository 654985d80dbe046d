// The BPE model of a byte-level tokenizer.json ("model": {"type": "BPE"}):
// vocabulary, merges by rank (stored as "a b" strings or as [a, b] pairs),
// ignore_merges. Works on raw bytes: the GPT-2 byte-to-character mapping is
// folded into the tables at load time.
//
// Thread-safety: Tokenize may be called from any thread (the word cache is
// guarded by a mutex that readers only try to take).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace tandem::model::internal {

class BpeModel {
 public:
  static Result<std::unique_ptr<BpeModel>> Create(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized word (raw bytes).
  void Tokenize(std::string_view word, std::vector<uint32_t>* ids) const;

  // Token strings as written in tokenizer.json (byte-level characters), by id;
  // empty where an id has no token.
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }
  std::optional<uint32_t> TokenToId(std::string_view token) const;

 private:
  BpeModel() = default;
  void MergeWord(std::string_view word, std::vector<uint32_t>* ids) const;

  struct MergeInfo {
    uint32_t rank;
    uint32_t new_id;
  };
  static constexpr uint32_t kNoId = UINT32_MAX;

 public:
  // Ids at or past this are refused at load (real vocabularies have < 300k
  // entries; a corrupt id must not size a table of billions).
  static constexpr uint32_t kMaxId = 1u << 24;

 private:

  std::unordered_map<std::string, uint32_t> vocab_;        // token string -> id
  std::unordered_map<std::string, uint32_t> bytes_vocab_;  // raw bytes -> id
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, MergeInfo> merges_;  // (left id << 32 | right id)
  uint32_t byte_id_[256];                           // id of each single byte, or kNoId
  std::optional<uint32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;

  // Word cache (Hugging Face keeps one of 10,000 words too).
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kCacheMaxWordBytes = 256;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>> cache_;
};

}  // namespace tandem::model::internal
