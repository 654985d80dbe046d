// The OTLP/gRPC exporter of common/tracing.h (docs/observability.md), and
// the one call each process makes to turn tracing on from its config.
#pragma once

#include <string>

#include "common/config.h"
#include "common/status.h"
#include "common/tracing.h"

namespace tandem::tracing {

// An ExportFn sending each batch as one
// opentelemetry.proto.collector.trace.v1.TraceService/Export call to
// opts.otlp_endpoint (plaintext gRPC; 5 s deadline per call).
ExportFn MakeOtlpGrpcExporter(const std::string& endpoint);

// Starts Tracer::Get() from `config.observability` for this process
// (`service_name` tandem-proxy | tandem-prefill | tandem-decode, the
// instance id its name). A no-op when otlp_endpoint is empty.
Status StartTracing(const ObservabilityConfig& config, std::string service_name,
                    std::string instance_id);

}  // namespace tandem::tracing
