// The OTLP/gRPC exporter of common/tracing.h (docs/observability.md), and
// the one call each process makes to turn tracing on from its config.
#pragma once

#include <string>

#include "common/config.h"
#include "common/status.h"
#include "common/tls.h"
#include "common/tracing.h"

namespace tandem::tracing {

// An ExportFn sending each batch as one
// opentelemetry.proto.collector.trace.v1.TraceService/Export call to
// `endpoint` (5 s deadline per call): over TLS when tls.ca_file is set (the
// collector's certificate verified against it and the dialled host; with
// tls.cert_file/key_file as the client's certificate), plaintext gRPC when
// `tls` is empty. The files are read here: an unreadable or non-PEM file,
// or a key that is not the certificate's, is an error naming it.
Result<ExportFn> MakeOtlpGrpcExporter(const std::string& endpoint, const TlsFiles& tls = {});

// Starts Tracer::Get() from `config.observability` for this process
// (`service_name` tandem-proxy | tandem-prefill | tandem-decode, the
// instance id its name). A no-op when otlp_endpoint is empty.
Status StartTracing(const ObservabilityConfig& config, std::string service_name,
                    std::string instance_id);

}  // namespace tandem::tracing
