// UTF-8 helpers shared by the tokenizer and the detokenizer, and the GPT-2
// byte-level alphabet (every byte <-> one printable code point).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::model::internal {

enum class Utf8Kind { kValid, kIncomplete, kInvalid };

struct Utf8Step {
  Utf8Kind kind;
  size_t len_bytes;  // kValid: the character; kIncomplete: the rest of `s`;
                     // kInvalid: the maximal invalid subpart (>= 1)
  uint32_t code_point;  // kValid only
};

// Classifies the sequence starting at s[i] (Unicode Table 3-7; invalid
// subparts as in "substitution of maximal subparts").
Utf8Step NextUtf8(std::string_view s, size_t i);

// `s` with every invalid subpart (and an incomplete tail) replaced by U+FFFD,
// as Rust's String::from_utf8_lossy does.
std::string SanitizeUtf8(std::string_view s);

void AppendUtf8(uint32_t code_point, std::string* out);

// Unicode White_Space (Rust's char::is_whitespace).
bool IsUnicodeWhitespace(uint32_t cp);

// GPT-2 byte-level alphabet: byte b is written as code point ByteToCodePoint()[b].
const std::array<uint32_t, 256>& ByteToCodePoint();
// Inverse: the byte a code point stands for, or -1.
int CodePointToByte(uint32_t cp);

// Byte-level decoding of a token string as Hugging Face's ByteLevel decoder
// does it: when every character is in the alphabet, the bytes they stand for;
// otherwise the token's own UTF-8 bytes.
std::string ByteLevelDecode(std::string_view token);
// The bytes when every character of `token` is in the alphabet; false otherwise.
bool TryByteLevelDecode(std::string_view token, std::string* bytes);

}  // namespace tandem::model::internal
