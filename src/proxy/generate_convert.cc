#include "proxy/generate_convert.h"

#include <fmt/format.h>

#include "common/tracing.h"

namespace tandem::proxy {

namespace pb = ::tandem::v1;

ClientRequest ClientRequestFromProto(pb::wire::GenerateRequestBytes& r, std::vector<uint32_t> ids,
                                     PromptVarints varints) {
  ClientRequest c;
  c.request_id = std::move(*r.mutable_request_id());
  c.model = std::move(*r.mutable_model());
  c.has_prompt = !r.prompt().empty();
  c.prompt = std::move(*r.mutable_prompt());
  if (r.prompt_token_ids().empty()) {
    c.prompt_token_ids = std::move(ids);
    if (!c.prompt_token_ids.empty()) c.prompt_varints = std::move(varints);
  } else {
    c.prompt_token_ids.assign(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
  }
  if (r.has_max_tokens()) c.max_tokens = r.max_tokens();
  if (r.has_sampling()) {
    const auto& s = r.sampling();
    if (s.has_temperature()) c.temperature = s.temperature();
    if (s.has_top_p()) c.top_p = s.top_p();
    if (s.has_top_k()) c.top_k = s.top_k();
    if (s.has_seed()) c.seed = s.seed();
  }
  c.stop.assign(r.stop().begin(), r.stop().end());
  c.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  c.ignore_eos = r.ignore_eos();
  if (r.has_ttft_slo_ms()) c.ttft_slo_ms = r.ttft_slo_ms();
  if (r.has_tpot_slo_ms()) c.tpot_slo_ms = r.tpot_slo_ms();
  if (r.has_priority()) c.priority = r.priority();
  return c;
}

Status ExplainEmptyPrompt(const pb::wire::GenerateRequestBytes& r, bool has_ids) {
  if (r.prompt().empty() && r.prompt_token_ids().empty() && !has_ids) {
    return InvalidArgumentError(
        "prompt is empty and prompt_token_ids is empty: give exactly one of them");
  }
  return Status::Ok();
}

pb::FinishReason FinishToProto(Finish f) {
  switch (f) {
    case Finish::kStop: return pb::FINISH_REASON_STOP;
    case Finish::kLength: return pb::FINISH_REASON_LENGTH;
    default: return pb::FINISH_REASON_UNSPECIFIED;
  }
}

Status RequestTooLarge(const Frontend& fe, uint64_t bytes) {
  return InvalidArgumentError(fmt::format(
      "the request has {} bytes; the limit is {} (proxy.limits.max_request_bytes)", bytes,
      fe.limits().max_request_bytes));
}

namespace {

Result<ValidatedRequest> Prepare(Frontend& fe, Status parsed, pb::wire::GenerateRequestBytes& req,
                                 std::vector<uint32_t> ids, PromptVarints varints,
                                 const Tenant* tenant, const std::string& traceparent,
                                 double* retry_after) {
  if (parsed.ok()) parsed = ExplainEmptyPrompt(req, !ids.empty());
  if (!parsed.ok()) return parsed;
  Result<ValidatedRequest> v = fe.Validate(
      ClientRequestFromProto(req, std::move(ids), std::move(varints)), tenant, retry_after);
  if (v.ok()) v->trace = tracing::Tracer::Get().StartRequest(traceparent);
  return v;
}

}  // namespace

Result<ValidatedRequest> PrepareGenerate(Frontend& fe, Status parsed,
                                         pb::wire::GenerateRequestBytes& req, const Tenant* tenant,
                                         const std::string& traceparent, double* retry_after) {
  return Prepare(fe, std::move(parsed), req, {}, {}, tenant, traceparent, retry_after);
}

Result<ValidatedRequest> PrepareGenerate(Frontend& fe, Status parsed, GenerateRequestParts& req,
                                         const Tenant* tenant, const std::string& traceparent,
                                         double* retry_after) {
  return Prepare(fe, std::move(parsed), req.rest, std::move(req.prompt_token_ids),
                 std::move(req.prompt_varints), tenant, traceparent, retry_after);
}

}  // namespace tandem::proxy
