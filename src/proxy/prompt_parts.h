// A worker request written in parts around its prompt (issue 23,
// docs/serving-workers.md "Prompt and hash encoding"): the framed Prefill
// request (prefill_tcp_client.h) and the decode stream's start
// (decode_mux_client.h) carry an 8k-token prompt in a packed field: the
// client's own varints (~20 kB) when the proxy kept them, else fixed32
// (32 kB). Built as a protobuf message, the prompt is copied into the
// message's repeated field and out of it again when the message is
// serialized. Written in parts, the message's other fields are serialized
// as usual (protobuf, from one field list: the Fill*Fields functions), the
// prompt field's tag and length are appended by hand, and the prompt's
// bytes go from where the proxy holds them (the client's request, or the
// ids' vector: little-endian uint32s are the packed fixed32 encoding)
// straight into the connection's output (FrameConn::SendParts). The receiver parses the frame with its protobuf parser as
// before: the bytes are a valid (for the decode start, the identical)
// serialization of the message the message way builds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "proxy/worker_client.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace tandem::proxy {

// The prompt's bytes for a packed field, and which field holds them.
struct PackedPrompt {
  std::string_view bytes;  // empty: the prompt is not sent in parts
  bool varints = false;    // prompt_token_ids (packed varints); else prompt_token_ids_fixed32
};

// The client's own packed varints (`varints`, session 14) when there are
// any: every worker reads that field, and they are about half of fixed32's
// bytes, with no encoding pass. Else the ids as the packed fixed32 field
// holds them, pointing into `ids`; empty when the prompt is not sent so:
// none, a worker that reads only the varint field (!fixed32), or a
// big-endian host.
PackedPrompt PromptForParts(const PromptIds& ids, std::string_view varints, bool fixed32);

// Appends a varint (protobuf's base-128 encoding).
void AppendVarint(uint64_t v, std::string* out);
// Appends a field's tag.
void AppendVarintFieldTag(int field, std::string* out);
void AppendLengthDelimitedTag(int field, std::string* out);

// Appends field `field` of an enclosing message holding `msg` (the
// message without its prompt: every field but `prompt_field` set) and then
// `prompt_field` with `prompt_bytes` bytes: the field's tag and length,
// `msg`'s serialization, and the prompt field's tag and length. The
// prompt's bytes follow, appended by the caller (or sent as a part of
// their own). Returns the bytes the whole field takes, the prompt's
// included.
size_t AppendPromptMessageField(int field, const google::protobuf::MessageLite& msg,
                                int prompt_field, size_t prompt_bytes, std::string* out);

}  // namespace tandem::proxy
