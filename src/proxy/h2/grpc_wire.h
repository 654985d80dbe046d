// The gRPC-over-HTTP/2 wire details the native front end needs
// (grpc/grpc doc/PROTOCOL-HTTP2.md): the grpc-timeout header, the
// percent-encoded grpc-message, and the 5-byte length prefix of messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace tandem::proxy::h2 {

// "grpc-timeout": 1 to 8 ASCII digits and a unit (H M S m u n); nullopt when
// malformed; nanoseconds::max() when longer than int64 nanoseconds hold
// (~292 years: gRPC reads it as no deadline).
std::optional<std::chrono::nanoseconds> ParseGrpcTimeout(std::string_view value);

// A call's deadline on the steady clock (time_point::max(): none) as the
// system-clock deadline the request carries to the workers, given both
// clocks' now. The steady clock counts from boot, the system clock from
// 1970: a deadline the first holds (a timeout up to ~292 years) may pass
// the second's range (from ~236 years in 2026), and is none then too.
std::chrono::system_clock::time_point SystemDeadlineOf(
    std::chrono::steady_clock::time_point deadline,
    std::chrono::steady_clock::time_point steady_now,
    std::chrono::system_clock::time_point system_now);

// "grpc-message": bytes outside 0x20-0x7E, and '%', as %XX.
std::string PercentEncode(std::string_view text);

// The 5-byte prefix of one uncompressed message of `length` bytes.
void AppendMessagePrefix(std::string& out, uint32_t length);

// Reads the 5-byte prefix: compressed flag and message length.
struct MessagePrefix {
  bool compressed = false;
  uint32_t length = 0;
};
MessagePrefix ReadMessagePrefix(const uint8_t prefix[5]);

// tandem.v1.GenerateResponse written straight into `out` as one framed
// gRPC message (prefix + bytes), the bytes exactly those protobuf's
// serializer writes for the message with these fields (fields in number
// order, proto3 defaults left out, token_ids packed): the token path's
// encoder, with no message object per token. `usage` null: no usage field.
struct UsageFields {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint32_t cached_prompt_tokens = 0;
};
void AppendGenerateResponse(std::string& out, std::string_view request_id,
                            std::span<const uint32_t> token_ids, std::string_view text,
                            int32_t finish_reason, const UsageFields* usage);

}  // namespace tandem::proxy::h2
