#include "http/sse_encoder.h"

#include <fmt/format.h>

#include <cstdint>

namespace tandem::http {

void AppendChunk(std::string& out, std::string_view data) {
  fmt::format_to(std::back_inserter(out), "{:x}\r\n", data.size());
  out.append(data);
  out.append("\r\n");
}

std::string Chunk(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 12);
  AppendChunk(out, data);
  return out;
}

namespace {

// Length of the UTF-8 sequence starting at s[i] (RFC 3629: no overlongs, no
// surrogates, nothing past U+10FFFF); 0 when it is not a valid one.
size_t Utf8Length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  const size_t left = s.size() - i;
  const auto cont = [&](size_t k) { return (b(k) & 0xC0) == 0x80; };
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && cont(i + 1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || !cont(i + 1) || !cont(i + 2)) return 0;
    if (c == 0xE0 && b(i + 1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(i + 1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || !cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    if (c == 0xF0 && b(i + 1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(i + 1) >= 0x90) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

// A marker no delta text or metadata contains: the text slot of the frame.
constexpr std::string_view kMarker = "\x01tandem-sse-text\x02";

}  // namespace

bool AppendJsonEscaped(std::string& out, std::string_view text) {
  const size_t start = out.size();
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<uint8_t>(text[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(text, i);
      if (n == 0) {
        out.resize(start);
        return false;
      }
      out.append(text.substr(i, n));
      i += n;
      continue;
    }
    switch (c) {
      case '"':
        out.append("\\\"");
        break;
      case '\\':
        out.append("\\\\");
        break;
      case '\b':
        out.append("\\b");
        break;
      case '\f':
        out.append("\\f");
        break;
      case '\n':
        out.append("\\n");
        break;
      case '\r':
        out.append("\\r");
        break;
      case '\t':
        out.append("\\t");
        break;
      default:
        if (c < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", c);
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
    ++i;
  }
  return true;
}

SseEncoder::SseEncoder(const ResponseMeta& meta, bool include_usage)
    : meta_(meta), include_usage_(include_usage) {
  std::string marker;
  AppendJsonEscaped(marker, kMarker);
  ok_ = true;
  for (bool first : {true, false}) {
    const std::string ev = StreamDelta(meta, std::string(kMarker), first, include_usage);
    const size_t at = ev.find(marker);
    // Once exactly: nothing else of the event holds the marker.
    if (at == std::string::npos || ev.find(marker, at + 1) != std::string::npos) {
      ok_ = false;
      continue;
    }
    Frame& f = first ? first_ : later_;
    f.before = ev.substr(0, at);
    f.after = ev.substr(at + marker.size());
  }
}

void SseEncoder::AppendDelta(std::string& out, std::string_view text, bool first) {
  escaped_.clear();
  if (!ok_ || !AppendJsonEscaped(escaped_, text)) {
    AppendChunk(out, StreamDelta(meta_, std::string(text), first, include_usage_));
    return;
  }
  const Frame& f = first ? first_ : later_;
  fmt::format_to(std::back_inserter(out), "{:x}\r\n",
                 f.before.size() + escaped_.size() + f.after.size());
  out.append(f.before).append(escaped_).append(f.after).append("\r\n");
}

}  // namespace tandem::http
