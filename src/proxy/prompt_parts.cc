#include "proxy/prompt_parts.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/message_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <bit>

namespace tandem::proxy {

namespace {

using WireFormat = google::protobuf::internal::WireFormatLite;
using Coded = google::protobuf::io::CodedOutputStream;

uint32_t LengthDelimitedTag(int field) {
  return WireFormat::MakeTag(field, WireFormat::WIRETYPE_LENGTH_DELIMITED);
}

}  // namespace

PackedPrompt PromptForParts(const PromptIds& ids, std::string_view varints, bool fixed32) {
  if (!varints.empty()) return {varints, true};
  if constexpr (std::endian::native != std::endian::little) return {};
  if (!fixed32 || !ids || ids->empty()) return {};
  return {{reinterpret_cast<const char*>(ids->data()), ids->size() * sizeof(uint32_t)}, false};
}

void AppendVarint(uint64_t v, std::string* out) {
  uint8_t buf[10];
  const uint8_t* end = Coded::WriteVarint64ToArray(v, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

void AppendVarintFieldTag(int field, std::string* out) {
  AppendVarint(WireFormat::MakeTag(field, WireFormat::WIRETYPE_VARINT), out);
}

void AppendLengthDelimitedTag(int field, std::string* out) {
  AppendVarint(LengthDelimitedTag(field), out);
}

size_t AppendPromptMessageField(int field, const google::protobuf::MessageLite& msg,
                                int prompt_field, size_t prompt_bytes, std::string* out) {
  const size_t msg_bytes = msg.ByteSizeLong() + Coded::VarintSize32(LengthDelimitedTag(prompt_field)) +
                           Coded::VarintSize64(prompt_bytes) + prompt_bytes;
  const size_t start = out->size();
  AppendLengthDelimitedTag(field, out);
  AppendVarint(msg_bytes, out);
  msg.AppendToString(out);
  AppendLengthDelimitedTag(prompt_field, out);
  AppendVarint(prompt_bytes, out);
  return out->size() - start + prompt_bytes;
}

}  // namespace tandem::proxy
