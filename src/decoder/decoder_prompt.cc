// The registered request's prompt (docs/decode-stream.md, "The prompt goes
// once"): what Register checks of it, whether it came as ids or by
// reference (length and digest), and whether a Reserve's prompt is it.
#include <fmt/format.h>

#include <algorithm>

#include "common/block_hash.h"
#include "decoder/decoder.h"

namespace tandem::decoder {

Status Decoder::CheckRegisteredPrompt(const DecodeSpec& spec) const {
  if (!spec.prompt_ref) {
    return engine_.CheckPrompt(spec.prompt_ids, spec.sampling, /*prefill_only=*/false);
  }
  // The prompt by reference (docs/decode-stream.md, "The prompt goes once"):
  // what its length tells now; the tokens' range when the Reserve brings them.
  if (!spec.prompt_ids.empty()) {
    return InvalidArgumentError(fmt::format(
        "request '{}' carries both the prompt's {} tokens and a prompt reference (prompt_length "
        "{}); send one",
        spec.request_id, spec.prompt_ids.size(), spec.prompt_ref->length));
  }
  if (spec.prefill_locally) {
    return InvalidArgumentError(fmt::format(
        "request '{}': prefill_locally needs the prompt's tokens, not a reference (prompt_length "
        "{})",
        spec.request_id, spec.prompt_ref->length));
  }
  return engine_.CheckPromptLength(spec.prompt_ref->length, spec.sampling, /*prefill_only=*/false);
}

Status Decoder::SamePrompt(const DecodeSpec& spec, std::span<const uint32_t> prompt_ids) {
  if (spec.prompt_ref) {
    // Length first: a digest is read only over a prompt of the right length.
    const DecodeSpec::PromptRef& ref = *spec.prompt_ref;
    if (prompt_ids.size() == ref.length && PromptDigest(prompt_ids) == ref.digest) {
      return Status::Ok();
    }
    return InvalidArgumentError(fmt::format(
        "request '{}': the prompt to reserve ({} tokens) differs from the registered one ({} "
        "tokens, digest {:016x})",
        spec.request_id, prompt_ids.size(), ref.length, ref.digest));
  }
  const auto& prompt = spec.prompt_ids;
  if (std::equal(prompt.begin(), prompt.end(), prompt_ids.begin(), prompt_ids.end())) {
    return Status::Ok();
  }
  return InvalidArgumentError(fmt::format(
      "request '{}': the prompt to reserve ({} tokens) differs from the registered one ({})",
      spec.request_id, prompt_ids.size(), prompt.size()));
}

}  // namespace tandem::decoder
