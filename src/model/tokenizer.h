// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (GPT-2 /
// Llama-3 / Qwen2 style): added and special tokens, the pre-tokenizer's
// split regex (PCRE2: Unicode classes and lookaheads), byte-level mapping,
// merges by rank. Encode/Decode match Hugging Face `tokenizers`.
//
// Supported tokenizer.json parts: normalizer null (or NFC, accepted but not
// applied: input is taken to be NFC already); pre_tokenizer Split / Digits /
// Sequence ending in ByteLevel; model BPE (merges as "a b" or [a, b],
// ignore_merges); post_processor TemplateProcessing / ByteLevel / Sequence /
// Roberta / Bert; decoder ByteLevel. Anything else (e.g. SentencePiece-style
// Metaspace tokenizers) is refused by Load with a message naming the part.
// Text that is not valid UTF-8 is encoded as if each invalid sequence were
// U+FFFD (Hugging Face only accepts valid strings).
//
// Thread-safety: a loaded Tokenizer is immutable (its word cache is
// internally synchronized); Encode/Decode may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::model {

// The bytes of every id in one flat table, for the streaming detokenizer's
// per-token lookup (issue 23, mux-deliver): one 8-byte entry and the bytes
// it points at, no virtual call, and a token that is all ASCII (most of
// them) known to be whole text without looking at its bytes.
struct TokenBytesTable {
  struct Entry {
    uint32_t offset = 0;     // into `bytes`
    uint32_t size : 30 = 0;  // bytes of the token
    uint32_t ascii : 1 = 0;  // every byte < 0x80 (true for an empty token)
    uint32_t special : 1 = 0;
  };
  std::vector<Entry> entries;  // [vocab_size]
  std::string bytes;           // every token's bytes, one after the other
  std::string_view Bytes(const Entry& e) const { return {bytes.data() + e.offset, e.size}; }
  // Appends the next id's entry; false (nothing added) when the token is
  // 2^30 bytes or more or the table would pass 4 GiB of bytes.
  bool Add(std::string_view token_bytes, bool special);
};

class Tokenizer {
 public:
  // `path` is a tokenizer.json file or a model directory holding one.
  static Result<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  virtual ~Tokenizer() = default;

  // Special tokens written in `text` (e.g. "<|endoftext|>") become their ids.
  // `add_special_tokens` applies the post-processor (e.g. a BOS token), as
  // `tokenizers`' encode(text, add_special_tokens=...) does.
  virtual std::vector<uint32_t> Encode(std::string_view text,
                                       bool add_special_tokens = false) const = 0;
  // Bytes of the ids joined; invalid UTF-8 at the end is kept as is (the
  // incremental detokenizer below is what streams text safely).
  virtual std::string Decode(std::span<const uint32_t> ids,
                             bool skip_special_tokens = false) const = 0;
  // Raw bytes of one token (byte-level decoded, as Hugging Face's ByteLevel
  // decoder does, added tokens included); empty for unknown ids.
  virtual std::string TokenBytes(uint32_t id) const = 0;
  virtual bool IsSpecial(uint32_t id) const = 0;
  // Appends TokenBytes(id) to *out, nothing when `skip_special` and the
  // token is special (the streaming detokenizer's per-token call: no
  // string is made for it where the tokenizer can append in place).
  virtual void AppendTokenBytes(uint32_t id, bool skip_special, std::string* out) const {
    if (!(skip_special && IsSpecial(id))) out->append(TokenBytes(id));
  }
  // The flat table of every id's bytes, when the tokenizer keeps one (the
  // byte-level BPE does; it lives as long as the tokenizer); null otherwise.
  virtual const TokenBytesTable* token_table() const { return nullptr; }
  // Largest id + 1, added tokens included (equals Hugging Face's
  // get_vocab_size(with_added_tokens=True) when ids are dense).
  virtual uint32_t vocab_size() const = 0;
  virtual std::optional<uint32_t> TokenToId(std::string_view token) const = 0;
};

// Turns a stream of token ids into text without ever emitting half a UTF-8
// character: bytes of an incomplete sequence are held until it completes.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens = true)
      : tokenizer_(tokenizer),
        table_(tokenizer != nullptr ? tokenizer->token_table() : nullptr),
        skip_special_(skip_special_tokens) {}
  // Text that became complete with `id` (may be empty).
  std::string Push(uint32_t id);
  // The same text, appended to *out (no allocation once warm).
  void PushTo(uint32_t id, std::string* out);
  // Whatever is held at the end of the stream (invalid bytes become U+FFFD).
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  const TokenBytesTable* table_;  // tokenizer_'s, or null
  bool skip_special_;
  std::string pending_;
};

// True when `s` is valid UTF-8.
bool IsValidUtf8(std::string_view s);

}  // namespace tandem::model
