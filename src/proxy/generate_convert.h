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
#include "proxy/generate_parse.h"
#include "proxy/lifecycle.h"
#include "proxy/request.h"
#include "tandem/v1/generation.pb.h"
#include "tandem/v1/wire/generation_wire.pb.h"

namespace tandem::proxy {

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
