#include "model/utf8.h"

namespace tandem::model::internal {

Utf8Step NextUtf8(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) return {Utf8Kind::kValid, 1, b0};
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  uint32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return {Utf8Kind::kInvalid, 1, 0};
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return {Utf8Kind::kIncomplete, s.size() - i, 0};
    const uint8_t b = byte(i + k);
    const uint8_t l = k == 1 ? lo : 0x80;
    const uint8_t h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {Utf8Kind::kInvalid, k, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {Utf8Kind::kValid, need, cp};
}

std::string SanitizeUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Step st = NextUtf8(s, i);
    if (st.kind == Utf8Kind::kValid) {
      out.append(s.substr(i, st.len_bytes));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
    }
    i += st.len_bytes;
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsUnicodeWhitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

const std::array<uint32_t, 256>& ByteToCodePoint() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

int CodePointToByte(uint32_t cp) {
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> inv{};
    inv.fill(-1);
    const auto& fwd = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) inv[fwd[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

bool TryByteLevelDecode(std::string_view token, std::string* bytes) {
  bytes->clear();
  bytes->reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const Utf8Step st = NextUtf8(token, i);
    const int b = st.kind == Utf8Kind::kValid ? CodePointToByte(st.code_point) : -1;
    if (b < 0) return false;
    bytes->push_back(static_cast<char>(b));
    i += st.len_bytes;
  }
  return true;
}

std::string ByteLevelDecode(std::string_view token) {
  std::string out;
  if (!TryByteLevelDecode(token, &out)) out.assign(token);
  return out;
}

}  // namespace tandem::model::internal
