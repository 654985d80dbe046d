#include "proxy/h2/grpc_wire.h"

#include <limits>

namespace tandem::proxy::h2 {

std::optional<std::chrono::nanoseconds> ParseGrpcTimeout(std::string_view v) {
  if (v.size() < 2 || v.size() > 9) return std::nullopt;
  int64_t n = 0;
  for (char c : v.substr(0, v.size() - 1)) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + (c - '0');
  }
  int64_t unit_ns = 0;
  switch (v.back()) {
    case 'H': unit_ns = 3'600'000'000'000; break;
    case 'M': unit_ns = 60'000'000'000; break;
    case 'S': unit_ns = 1'000'000'000; break;
    case 'm': unit_ns = 1'000'000; break;
    case 'u': unit_ns = 1'000; break;
    case 'n': unit_ns = 1; break;
    default: return std::nullopt;
  }
  // Eight digits of hours pass int64 nanoseconds (from 2,562,048 H, ~292
  // years): the longest timeout, as gRPC reads such a value as infinite.
  if (n > std::numeric_limits<int64_t>::max() / unit_ns) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(n * unit_ns);
}

std::chrono::system_clock::time_point SystemDeadlineOf(
    std::chrono::steady_clock::time_point deadline,
    std::chrono::steady_clock::time_point steady_now,
    std::chrono::system_clock::time_point system_now) {
  using SystemClock = std::chrono::system_clock;
  if (deadline == std::chrono::steady_clock::time_point::max())
    return SystemClock::time_point::max();
  const auto left = std::chrono::duration_cast<SystemClock::duration>(deadline - steady_now);
  if (left > SystemClock::time_point::max() - system_now) return SystemClock::time_point::max();
  return system_now + left;
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

namespace {

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void PutVarint(std::string& out, uint64_t v) {
  char buf[10];
  size_t n = 0;
  while (v >= 0x80) {
    buf[n++] = static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  buf[n++] = static_cast<char>(v);
  out.append(buf, n);
}

// A length-delimited field's size: tag, length, bytes.
size_t LenFieldSize(size_t len) { return 1 + VarintSize(len) + len; }

// An int32 is written sign-extended to 64 bits (protobuf's int32/enum rule).
uint64_t Int32Wire(int32_t v) { return static_cast<uint64_t>(static_cast<int64_t>(v)); }

}  // namespace

void AppendGenerateResponse(std::string& out, std::string_view request_id,
                            std::span<const uint32_t> token_ids, std::string_view text,
                            int32_t finish_reason, const UsageFields* usage) {
  // Field tags: (number << 3) | wire type (0 varint, 2 length-delimited).
  constexpr char kRequestId = (1 << 3) | 2, kTokenIds = (2 << 3) | 2, kText = (3 << 3) | 2,
                 kFinish = (4 << 3) | 0, kUsage = (5 << 3) | 2;
  size_t ids_len = 0;
  for (uint32_t id : token_ids) ids_len += VarintSize(id);
  size_t usage_len = 0;
  if (usage != nullptr) {
    if (usage->prompt_tokens != 0) usage_len += 1 + VarintSize(usage->prompt_tokens);
    if (usage->completion_tokens != 0) usage_len += 1 + VarintSize(usage->completion_tokens);
    if (usage->cached_prompt_tokens != 0) usage_len += 1 + VarintSize(usage->cached_prompt_tokens);
  }
  size_t len = 0;
  if (!request_id.empty()) len += LenFieldSize(request_id.size());
  if (!token_ids.empty()) len += LenFieldSize(ids_len);
  if (!text.empty()) len += LenFieldSize(text.size());
  if (finish_reason != 0) len += 1 + VarintSize(Int32Wire(finish_reason));
  if (usage != nullptr) len += LenFieldSize(usage_len);

  out.reserve(out.size() + 5 + len);
  AppendMessagePrefix(out, static_cast<uint32_t>(len));
  if (!request_id.empty()) {
    out.push_back(kRequestId);
    PutVarint(out, request_id.size());
    out.append(request_id);
  }
  if (!token_ids.empty()) {
    out.push_back(kTokenIds);
    PutVarint(out, ids_len);
    for (uint32_t id : token_ids) PutVarint(out, id);
  }
  if (!text.empty()) {
    out.push_back(kText);
    PutVarint(out, text.size());
    out.append(text);
  }
  if (finish_reason != 0) {
    out.push_back(kFinish);
    PutVarint(out, Int32Wire(finish_reason));
  }
  if (usage != nullptr) {
    out.push_back(kUsage);
    PutVarint(out, usage_len);
    if (usage->prompt_tokens != 0) {
      out.push_back((1 << 3) | 0);
      PutVarint(out, usage->prompt_tokens);
    }
    if (usage->completion_tokens != 0) {
      out.push_back((2 << 3) | 0);
      PutVarint(out, usage->completion_tokens);
    }
    if (usage->cached_prompt_tokens != 0) {
      out.push_back((3 << 3) | 0);
      PutVarint(out, usage->cached_prompt_tokens);
    }
  }
}

MessagePrefix ReadMessagePrefix(const uint8_t p[5]) {
  MessagePrefix m;
  m.compressed = p[0] != 0;
  m.length = (uint32_t{p[1]} << 24) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 8) | p[4];
  return m;
}

}  // namespace tandem::proxy::h2
