#include "proxy/h2/grpc_wire.h"

namespace tandem::proxy::h2 {

std::optional<std::chrono::nanoseconds> ParseGrpcTimeout(std::string_view v) {
  if (v.size() < 2 || v.size() > 9) return std::nullopt;
  int64_t n = 0;
  for (char c : v.substr(0, v.size() - 1)) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + (c - '0');
  }
  using namespace std::chrono;
  switch (v.back()) {
    case 'H': return duration_cast<nanoseconds>(hours(n));
    case 'M': return duration_cast<nanoseconds>(minutes(n));
    case 'S': return duration_cast<nanoseconds>(seconds(n));
    case 'm': return duration_cast<nanoseconds>(milliseconds(n));
    case 'u': return duration_cast<nanoseconds>(microseconds(n));
    case 'n': return nanoseconds(n);
    default: return std::nullopt;
  }
}

std::string PercentEncode(std::string_view text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c >= 0x20 && c <= 0x7E && c != '%') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

void AppendMessagePrefix(std::string& out, uint32_t length) {
  const char p[5] = {0, static_cast<char>(length >> 24), static_cast<char>(length >> 16),
                     static_cast<char>(length >> 8), static_cast<char>(length)};
  out.append(p, 5);
}

MessagePrefix ReadMessagePrefix(const uint8_t p[5]) {
  MessagePrefix m;
  m.compressed = p[0] != 0;
  m.length = (uint32_t{p[1]} << 24) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 8) | p[4];
  return m;
}

}  // namespace tandem::proxy::h2
