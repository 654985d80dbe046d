// tandem.v1.Generate's messages <-> the lifecycle's plain structs, and the
// request steps both public gRPC front ends take alike
// (generation_service.cc, h2/grpc_calls.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "proxy/frontend.h"
#include "proxy/lifecycle.h"
#include "proxy/request.h"
#include "tandem/v1/generation.pb.h"
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

// Takes the strings out of `r`, and the prompt's ids from `ids` (and
// their bytes from `varints`) when `r` has none.
ClientRequest ClientRequestFromProto(v1::wire::GenerateRequestBytes& r,
                                     std::vector<uint32_t> ids = {}, PromptVarints varints = {});

// An empty prompt string is "not set" in proto3; says "empty" when the
// client clearly sent neither ids nor text.
Status ExplainEmptyPrompt(const v1::wire::GenerateRequestBytes& r, bool has_ids = false);

v1::FinishReason FinishToProto(Finish f);

// INVALID_ARGUMENT naming proxy.limits.max_request_bytes for a request of
// `bytes`.
Status RequestTooLarge(const Frontend& fe, uint64_t bytes);

// `parsed`: how parsing `req` went. Validates (tokenizing a text prompt)
// and starts the request's trace.
Result<ValidatedRequest> PrepareGenerate(Frontend& fe, Status parsed,
                                         v1::wire::GenerateRequestBytes& req, const Tenant* tenant,
                                         const std::string& traceparent, double* retry_after);
// The same for a request parsed by ParseGenerateRequest (its ids are moved).
Result<ValidatedRequest> PrepareGenerate(Frontend& fe, Status parsed, GenerateRequestParts& req,
                                         const Tenant* tenant, const std::string& traceparent,
                                         double* retry_after);

}  // namespace tandem::proxy
