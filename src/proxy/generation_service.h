// The public gRPC API (tandem.v1.Generation) over the request lifecycle.
#pragma once

#include "proxy/frontend.h"
#include "tandem/v1/generation.grpc.pb.h"
#include "tandem/v1/wire/generation_wire.pb.h"

namespace tandem::proxy {

// Serves /tandem.v1.Generation/Generate from the request's raw bytes (bounded
// by proxy.limits.max_request_bytes before parsing), parsed as the
// wire-identical GenerateRequestBytes (see generation_wire.proto), so that
// invalid UTF-8 reaches validation instead of failing inside protobuf.
class GenerationService final : public tandem::v1::Generation::CallbackService {
 public:
  explicit GenerationService(Frontend* frontend);

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* GenerateBytes(
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request);
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const tandem::v1::ListModelsRequest* request,
                                       tandem::v1::ListModelsResponse* response) override;

 private:
  Frontend* frontend_;
};

}  // namespace tandem::proxy
