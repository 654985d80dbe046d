// The body of a public gRPC Generate call as the native front end reads it
// (h2/grpc_calls.cc): the prompt's packed token ids taken apart by hand,
// everything else left to protobuf. Apart from generate_convert.h so that
// the parser links alone (tests/fuzz/fuzz_grpc_request.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "proxy/request.h"
#include "tandem/v1/wire/generation_wire.pb.h"

namespace tandem::proxy {

// A GenerateRequest as the native front end parses it (ParseGenerateRequest):
// the prompt's token ids apart, in the vector the request keeps.
struct GenerateRequestParts {
  v1::wire::GenerateRequestBytes rest;  // every other field (and ids it could not take apart)
  std::vector<uint32_t> prompt_token_ids;
  // prompt_token_ids' bytes in the body (which it then owns) when the
  // workers can be sent them as they came: one packed field whose every
  // varint is in its shortest form (request.h). Empty otherwise.
  PromptVarints prompt_varints;
};

// Parses `body` as a tandem.v1.GenerateRequest, exactly as protobuf would,
// but decodes prompt_token_ids' packed varints straight into
// `out.prompt_token_ids` (issue 23: protobuf's packed-varint parse into a
// RepeatedField, then a copy into the request's vector, cost ~40 us of an
// 8k prompt), and keeps the body for their forwarding
// (`out.prompt_varints`). Any other encoding of that field (unpacked,
// wrong wire type), a group or a malformed field leaves the whole body to
// protobuf.
Status ParseGenerateRequest(std::string body, GenerateRequestParts& out);

}  // namespace tandem::proxy
