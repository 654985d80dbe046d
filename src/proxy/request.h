// A client's generation request as the proxy's lifecycle sees it, and its
// validation. The public proto (and the OpenAI JSON) are converted into
// `ClientRequest` by their adapters; validation happens once, here, for
// both front ends, and every error names the field and the limit.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tracing.h"

namespace tandem::proxy {

// The client's own encoding of its prompt_token_ids (issue 23, session 14;
// docs/serving-workers.md "Prompt and hash encoding"): the packed varints of
// the native gRPC front end's request, kept in the request's body, which
// this owns. The workers are sent these bytes as their prompt_token_ids
// (the same ids, half the bytes of fixed32, no encoding pass) when they are
// exactly what protobuf writes for the ids the proxy decoded and validated:
// one packed field, every varint in its shortest form.
struct PromptVarints {
  std::string owner;  // the request's bytes, which hold the varints
  size_t at = 0;      // offset of the varints in `owner`
  size_t size = 0;    // 0: none (a text prompt, the HTTP API, another encoding)
  std::string_view bytes() const { return std::string_view(owner).substr(at, size); }
};

// Mirrors tandem.v1.GenerateRequest: optional fields stay optional, so
// "unset" (take the default) and "set to 0" (an error for max_tokens) differ.
struct ClientRequest {
  std::string request_id;  // empty: the proxy assigns one
  std::string model;       // empty: the fleet's default model
  bool has_prompt = false;
  std::string prompt;
  std::vector<uint32_t> prompt_token_ids;  // non-empty means "given"
  PromptVarints prompt_varints;            // prompt_token_ids as the client encoded them, if kept
  std::optional<uint32_t> max_tokens;
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<uint32_t> top_k;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  // Latency objectives in ms (issue 22); unset: the fleet's proxy.slo.
  std::optional<uint32_t> ttft_slo_ms;
  std::optional<uint32_t> tpot_slo_ms;
  // Scheduling priority (lower = served earlier, as vLLM); unset: the
  // tenant's default (docs/scheduling.md).
  std::optional<int32_t> priority;
};

// What the proxy serves and allows.
struct ServingLimits {
  std::string model;            // the served model's name
  uint32_t vocab_size = 0;      // token ids must be below this
  uint32_t max_model_len = 0;   // prompt + completion tokens
  uint32_t default_max_tokens = 128;
  uint32_t max_tokens_limit = 1024;
  // proxy.limits (common/config.h ProxyLimitsConfig); errors name the key.
  uint64_t max_request_bytes = 4u << 20;  // one encoded gRPC request (checked by its adapter)
  uint32_t max_prompt_tokens = 0;  // 0: the model's context (max_model_len - 1)
  uint32_t max_stop_strings = 16;
  uint32_t max_stop_string_bytes = 256;
  uint32_t max_stop_token_ids = 64;
  uint32_t max_request_id_bytes = 128;
};

// A request with every default resolved, ready for routing.
struct ValidatedRequest {
  // The fleet id (common/request_id.h): unique and unguessable; what the
  // workers key the request by. Never shown to the client.
  std::string request_id;
  // What responses echo: the client's request_id, or the fleet id's nonce
  // when the client gave none.
  std::string client_request_id;
  std::string model;
  std::vector<uint32_t> prompt_ids;
  // prompt_ids as the client encoded them (ClientRequest::prompt_varints),
  // kept only when the client gave ids and they passed validation.
  PromptVarints prompt_varints;
  uint32_t max_tokens = 0;
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint32_t top_k = 0;  // 0 = off
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  // The tenant's cache salt (HashContext::tenant_salt); "" for the default
  // tenant. Set by the front end after authentication, not by validation.
  std::string tenant_salt;
  // Latency objectives in ms, 0: none. The client's values after
  // validation; the fleet's proxy.slo defaults are filled in by the
  // admission step (proxy/slo_admission.h).
  uint32_t ttft_slo_ms = 0;
  uint32_t tpot_slo_ms = 0;
  // SLO admission's predicted TTFT in ms when it admitted the request with
  // a prediction (proxy/ttft_calibration.h compares it with the actual
  // one); -1: none.
  double predicted_ttft_ms = -1;
  // Scheduling (docs/scheduling.md), resolved by the front end from the
  // request and its tenant: priority (lower = earlier), the tenant's name
  // and its fair-share weight.
  int32_t priority = 0;
  std::string tenant;
  double tenant_weight = 1.0;
  // The proxy's span for this request (common/tracing.h); set by the front
  // end from the client's traceparent. Not sampled: no span, no cost.
  tracing::SpanContext trace;
  // The prompt's block hashes when admission already made them (SLO
  // admission), under `block_hashes_root` with `block_hashes_block_size`:
  // routing reuses them instead of hashing the prompt again. Empty: none.
  std::vector<uint64_t> block_hashes;
  uint64_t block_hashes_root = 0;
  uint32_t block_hashes_block_size = 0;
};

// Largest ttft_slo_ms / tpot_slo_ms a request may give (one hour).
inline constexpr uint32_t kMaxSloMs = 3'600'000;

using EncodeFn = std::function<std::vector<uint32_t>(std::string_view text)>;

// Checks `req` against `limits`, tokenizes a text prompt with `encode`, and
// fills defaults: max_tokens from limits, temperature/top_p 1.0, top_k off,
// `random_seed` when no seed is given; gives the request a new fleet id.
// INVALID_ARGUMENT names the field and the limit; NOT_FOUND for an unknown
// model.
// `req` is taken by value: its prompt ids move into the result.
Result<ValidatedRequest> ValidateRequest(ClientRequest req, const ServingLimits& limits,
                                         const EncodeFn& encode, uint64_t random_seed);

}  // namespace tandem::proxy
