// tandem.v1.Generate's messages <-> the lifecycle's plain structs, shared by
// the public gRPC front ends (generation_service.cc, h2/grpc_calls.cc).
#pragma once

#include "common/status.h"
#include "proxy/lifecycle.h"
#include "proxy/request.h"
#include "tandem/v1/generation.pb.h"
#include "tandem/v1/wire/generation_wire.pb.h"

namespace tandem::proxy {

// Takes the strings out of `r`.
ClientRequest ClientRequestFromProto(v1::wire::GenerateRequestBytes& r);

// An empty prompt string is "not set" in proto3; says "empty" when the
// client clearly sent neither ids nor text.
Status ExplainEmptyPrompt(const v1::wire::GenerateRequestBytes& r);

v1::FinishReason FinishToProto(Finish f);

}  // namespace tandem::proxy
