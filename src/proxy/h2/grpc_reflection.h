// grpc.reflection.v1alpha.ServerReflection for the native front end
// (docs/grpc-frontend.md): what grpcurl asks, answered from protobuf's
// generated descriptor pool. The messages are read and written by hand
// (gRPC's generated reflection code is inside libgrpc++_reflection, its
// headers are not installed, and the same messages compiled here would
// clash with it in the pool).
#pragma once

#include <string>

namespace tandem::proxy::h2 {

// The serialized ServerReflectionResponse for one serialized
// ServerReflectionRequest.
std::string AnswerReflection(const std::string& request);

}  // namespace tandem::proxy::h2
