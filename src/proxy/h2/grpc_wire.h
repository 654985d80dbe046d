// The gRPC-over-HTTP/2 wire details the native front end needs
// (grpc/grpc doc/PROTOCOL-HTTP2.md): the grpc-timeout header, the
// percent-encoded grpc-message, and the 5-byte length prefix of messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tandem::proxy::h2 {

// "grpc-timeout": 1 to 8 ASCII digits and a unit (H M S m u n); nullopt when
// malformed.
std::optional<std::chrono::nanoseconds> ParseGrpcTimeout(std::string_view value);

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

}  // namespace tandem::proxy::h2
