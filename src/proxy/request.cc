#include "proxy/request.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/request_id.h"
#include "model/tokenizer.h"

namespace tandem::proxy {

Result<ValidatedRequest> ValidateRequest(ClientRequest req, const ServingLimits& limits,
                                         const EncodeFn& encode, uint64_t random_seed) {
  ValidatedRequest out;
  if (req.request_id.size() > limits.max_request_id_bytes) {
    return InvalidArgumentError(fmt::format("request_id has {} bytes; the limit is {}",
                                            req.request_id.size(), limits.max_request_id_bytes));
  }
  if (!model::IsValidUtf8(req.request_id)) {
    return InvalidArgumentError("request_id is not valid UTF-8");
  }
  out.request_id = NewFleetRequestId(req.request_id);
  out.client_request_id =
      req.request_id.empty() ? std::string(SplitFleetRequestId(out.request_id).nonce)
                             : req.request_id;
  if (!model::IsValidUtf8(req.model)) return InvalidArgumentError("model is not valid UTF-8");
  if (!req.model.empty() && req.model != limits.model) {
    return NotFoundError(
        fmt::format("model '{}' is not served here; this fleet serves '{}'", req.model,
                    limits.model));
  }
  out.model = limits.model;

  const bool has_ids = !req.prompt_token_ids.empty();
  if (req.has_prompt && has_ids) {
    return InvalidArgumentError("give exactly one of prompt and prompt_token_ids, not both");
  }
  if (!req.has_prompt && !has_ids) {
    return InvalidArgumentError("give exactly one of prompt and prompt_token_ids; neither is set");
  }
  // The context leaves room for at least one completion token.
  const uint32_t context_prompt = limits.max_model_len > 0 ? limits.max_model_len - 1 : 0;
  const bool own_prompt_limit =
      limits.max_prompt_tokens > 0 && limits.max_prompt_tokens < context_prompt;
  const uint32_t max_prompt = own_prompt_limit ? limits.max_prompt_tokens : context_prompt;
  auto too_long = [&](size_t n, std::string_view what) {
    return InvalidArgumentError(
        own_prompt_limit
            ? fmt::format("{} has {} tokens; the limit is {} (proxy.limits.max_prompt_tokens)",
                          what, n, max_prompt)
            : fmt::format("{} has {} tokens; this model accepts at most {} (prompt + completion; "
                          "proxy.limits.max_prompt_tokens)",
                          what, n, limits.max_model_len));
  };
  if (req.has_prompt) {
    if (req.prompt.empty()) return InvalidArgumentError("prompt is empty");
    if (!model::IsValidUtf8(req.prompt)) return InvalidArgumentError("prompt is not valid UTF-8");
    out.prompt_ids = encode(req.prompt);
    if (out.prompt_ids.empty()) return InvalidArgumentError("prompt encodes to no tokens");
    if (out.prompt_ids.size() > max_prompt) return too_long(out.prompt_ids.size(), "prompt");
    for (uint32_t id : out.prompt_ids) {  // a tokenizer larger than the model (fuzz_request)
      if (id >= limits.vocab_size) {
        return InvalidArgumentError(fmt::format(
            "prompt encodes to token id {}, outside the model's vocabulary of {} (the tokenizer "
            "and the model disagree)", id, limits.vocab_size));
      }
    }
  } else {
    // Counted before anything scans them.
    if (req.prompt_token_ids.size() > max_prompt) {
      return too_long(req.prompt_token_ids.size(), "prompt_token_ids");
    }
    // The largest id first: a pass with no exit in it, which the compiler
    // vectorizes (8 ids an instruction; issue 23: the loop that stopped
    // at the first offender took one compare and branch per id of every
    // 8k prompt). The offender's index is looked for only when there is one.
    uint32_t largest = 0;
    for (const uint32_t id : req.prompt_token_ids) largest = std::max(largest, id);
    if (largest >= limits.vocab_size) {
      for (size_t i = 0; i < req.prompt_token_ids.size(); ++i) {
        if (req.prompt_token_ids[i] >= limits.vocab_size) {
          return InvalidArgumentError(fmt::format(
              "prompt_token_ids[{}] is {}; token ids must be below the vocabulary size {}", i,
              req.prompt_token_ids[i], limits.vocab_size));
        }
      }
    }
    out.prompt_ids = std::move(req.prompt_token_ids);
    // The ids just checked are these bytes' (ParseGenerateRequest decoded
    // them): what is validated is what the workers are sent.
    out.prompt_varints = std::move(req.prompt_varints);
  }

  if (req.max_tokens.has_value()) {
    if (*req.max_tokens == 0) return InvalidArgumentError("max_tokens must be at least 1, got 0");
    if (*req.max_tokens > limits.max_tokens_limit) {
      return InvalidArgumentError(fmt::format("max_tokens is {}; this fleet allows at most {}",
                                              *req.max_tokens, limits.max_tokens_limit));
    }
  }
  for (const auto& [value, name] : {std::pair{req.ttft_slo_ms, "ttft_slo_ms"},
                                    std::pair{req.tpot_slo_ms, "tpot_slo_ms"}}) {
    if (value.has_value() && (*value == 0 || *value > kMaxSloMs)) {
      return InvalidArgumentError(fmt::format(
          "{} is {}; it must be 1..{} ms (unset: the fleet's proxy.slo default)", name, *value,
          kMaxSloMs));
    }
  }
  out.ttft_slo_ms = req.ttft_slo_ms.value_or(0);
  out.tpot_slo_ms = req.tpot_slo_ms.value_or(0);
  out.max_tokens = req.max_tokens.value_or(limits.default_max_tokens);
  const size_t prompt_tokens = out.prompt_ids.size();
  if (prompt_tokens >= limits.max_model_len) return too_long(prompt_tokens, "prompt");
  if (prompt_tokens + out.max_tokens > limits.max_model_len) {
    if (req.max_tokens.has_value()) {
      return InvalidArgumentError(fmt::format(
          "prompt ({} tokens) + max_tokens ({}) = {} exceeds the model's context of {} tokens",
          prompt_tokens, out.max_tokens, prompt_tokens + out.max_tokens, limits.max_model_len));
    }
    // An unset max_tokens shrinks to what fits, as vLLM does.
    out.max_tokens = static_cast<uint32_t>(limits.max_model_len - prompt_tokens);
  }

  if (req.temperature.has_value()) {
    const float t = *req.temperature;
    if (!std::isfinite(t) || t < 0.0f) {
      return InvalidArgumentError(
          fmt::format("sampling.temperature must be >= 0 (0 is greedy), got {}", t));
    }
    out.temperature = t;
  }
  if (req.top_p.has_value()) {
    const float p = *req.top_p;
    if (!std::isfinite(p) || p <= 0.0f || p > 1.0f) {
      return InvalidArgumentError(fmt::format("sampling.top_p must be in (0, 1], got {}", p));
    }
    out.top_p = p;
  }
  if (req.top_k.has_value()) {
    if (*req.top_k > limits.vocab_size) {
      return InvalidArgumentError(fmt::format(
          "sampling.top_k is {}; it must be at most the vocabulary size {} (0 = off)",
          *req.top_k, limits.vocab_size));
    }
    out.top_k = *req.top_k;
  }
  out.seed = req.seed.value_or(random_seed);

  if (req.stop.size() > limits.max_stop_strings) {
    return InvalidArgumentError(
        fmt::format("stop has {} strings; the limit is {} (proxy.limits.max_stop_strings)",
                    req.stop.size(), limits.max_stop_strings));
  }
  for (size_t i = 0; i < req.stop.size(); ++i) {
    const auto& s = req.stop[i];
    if (s.empty()) return InvalidArgumentError(fmt::format("stop[{}] is empty", i));
    if (s.size() > limits.max_stop_string_bytes) {
      return InvalidArgumentError(fmt::format(
          "stop[{}] has {} bytes; the limit is {} (proxy.limits.max_stop_string_bytes)", i,
          s.size(), limits.max_stop_string_bytes));
    }
    if (!model::IsValidUtf8(s)) {
      return InvalidArgumentError(fmt::format("stop[{}] is not valid UTF-8", i));
    }
  }
  out.stop = std::move(req.stop);
  // Every generated token is checked against these on the engine thread.
  if (req.stop_token_ids.size() > limits.max_stop_token_ids) {
    return InvalidArgumentError(fmt::format(
        "stop_token_ids has {} ids; the limit is {} (proxy.limits.max_stop_token_ids)",
        req.stop_token_ids.size(), limits.max_stop_token_ids));
  }
  for (size_t i = 0; i < req.stop_token_ids.size(); ++i) {
    if (req.stop_token_ids[i] >= limits.vocab_size) {
      return InvalidArgumentError(fmt::format(
          "stop_token_ids[{}] is {}; token ids must be below the vocabulary size {}", i,
          req.stop_token_ids[i], limits.vocab_size));
    }
  }
  out.stop_token_ids = req.stop_token_ids;
  out.ignore_eos = req.ignore_eos;
  if (req.priority) out.priority = *req.priority;
  return out;
}

}  // namespace tandem::proxy
