#include "common/tracing_otlp.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <type_traits>
#include <variant>

#include "otlp/trace_service.grpc.pb.h"

namespace tandem::tracing {
namespace {

namespace otlp_common = ::opentelemetry::proto::common::v1;
namespace otlp_trace = ::opentelemetry::proto::trace::v1;
namespace otlp_collector = ::opentelemetry::proto::collector::trace::v1;

void SetAttr(otlp_common::KeyValue* kv, const Attribute& a) {
  kv->set_key(a.key);
  auto* v = kv->mutable_value();
  std::visit(
      [v](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) v->set_string_value(x);
        else if constexpr (std::is_same_v<T, int64_t>) v->set_int_value(x);
        else if constexpr (std::is_same_v<T, double>) v->set_double_value(x);
        else v->set_bool_value(x);
      },
      a.value);
}

void AddStringAttr(google::protobuf::RepeatedPtrField<otlp_common::KeyValue>* out,
                   const std::string& key, const std::string& value) {
  auto* kv = out->Add();
  kv->set_key(key);
  kv->mutable_value()->set_string_value(value);
}

otlp_trace::Span::SpanKind ToProto(SpanKind k) {
  switch (k) {
    case SpanKind::kServer: return otlp_trace::Span::SPAN_KIND_SERVER;
    case SpanKind::kClient: return otlp_trace::Span::SPAN_KIND_CLIENT;
    default: return otlp_trace::Span::SPAN_KIND_INTERNAL;
  }
}

template <size_t N>
bool AllZero(const std::array<uint8_t, N>& a) {
  for (uint8_t b : a) {
    if (b != 0) return false;
  }
  return true;
}

class OtlpGrpcExporter {
 public:
  OtlpGrpcExporter(const std::string& endpoint, std::shared_ptr<grpc::ChannelCredentials> creds)
      : stub_(otlp_collector::TraceService::NewStub(grpc::CreateChannel(endpoint, creds))) {}

  Status Export(const TracerOptions& opts, std::vector<SpanRecord> spans) {
    otlp_collector::ExportTraceServiceRequest req;
    auto* rs = req.add_resource_spans();
    auto* attrs = rs->mutable_resource()->mutable_attributes();
    AddStringAttr(attrs, "service.name", opts.service_name);
    AddStringAttr(attrs, "service.instance.id", opts.instance_id);
    AddStringAttr(attrs, "telemetry.sdk.name", "tandem");
    auto* ss = rs->add_scope_spans();
    ss->mutable_scope()->set_name("tandem");
    for (const SpanRecord& s : spans) {
      auto* p = ss->add_spans();
      p->set_trace_id(s.ctx.trace_id.data(), s.ctx.trace_id.size());
      p->set_span_id(s.ctx.span_id.data(), s.ctx.span_id.size());
      if (!AllZero(s.ctx.parent_span_id)) {
        p->set_parent_span_id(s.ctx.parent_span_id.data(), s.ctx.parent_span_id.size());
      }
      p->set_flags(1);  // W3C sampled
      p->set_name(s.name);
      p->set_kind(ToProto(s.kind));
      p->set_start_time_unix_nano(s.start_unix_ns);
      p->set_end_time_unix_nano(s.end_unix_ns);
      for (const Attribute& a : s.attributes) SetAttr(p->add_attributes(), a);
      if (s.error) {
        p->mutable_status()->set_code(otlp_trace::Status::STATUS_CODE_ERROR);
        p->mutable_status()->set_message(s.status_message);
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    otlp_collector::ExportTraceServiceResponse resp;
    grpc::Status st = stub_->Export(&ctx, req, &resp);
    if (!st.ok()) {
      return UnavailableError(fmt::format("OTLP export: {} ({})", st.error_message(),
                                          static_cast<int>(st.error_code())));
    }
    return Status::Ok();
  }

 private:
  std::unique_ptr<otlp_collector::TraceService::Stub> stub_;
};

}  // namespace

Result<ExportFn> MakeOtlpGrpcExporter(const std::string& endpoint, const TlsFiles& tls) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls.empty()) {
    if (tls.ca_file.empty()) {
      return InvalidArgumentError("OTLP over TLS needs the CA that verifies the collector");
    }
    auto pem = ReadTlsFiles(tls);
    if (!pem.ok()) return pem.status();
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = pem->ca;
    o.pem_cert_chain = pem->cert;
    o.pem_private_key = pem->key;
    creds = grpc::SslCredentials(o);
  }
  auto exporter = std::make_shared<OtlpGrpcExporter>(endpoint, std::move(creds));
  return ExportFn([exporter](const TracerOptions& opts, std::vector<SpanRecord> spans) {
    return exporter->Export(opts, std::move(spans));
  });
}

Status StartTracing(const ObservabilityConfig& config, std::string service_name,
                    std::string instance_id) {
  if (config.otlp_endpoint.empty()) return Status::Ok();
  TracerOptions o;
  o.otlp_endpoint = config.otlp_endpoint;
  o.sample_ratio = config.trace_sample_ratio;
  o.service_name = std::move(service_name);
  o.instance_id = std::move(instance_id);
  const TlsFiles tls{config.otlp_ca_file, config.otlp_cert_file, config.otlp_key_file};
  auto exporter = MakeOtlpGrpcExporter(config.otlp_endpoint, tls);
  if (!exporter.ok()) return exporter.status().WithContext("observability.otlp_tls");
  TANDEM_RETURN_IF_ERROR(Tracer::Get().Start(o, std::move(exporter).value()));
  spdlog::info("tracing: OTLP/gRPC spans to {} ({}), sample ratio {}", o.otlp_endpoint,
               tls.empty()               ? "plaintext"
               : tls.cert_file.empty()   ? "TLS"
                                         : "mutual TLS",
               o.sample_ratio);
  return Status::Ok();
}

}  // namespace tandem::tracing
