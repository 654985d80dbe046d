// What callers hand the engine and what it hands back, per request.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/sampler.h"

namespace tandem::engine {

enum class FinishReason {
  kNone,         // not finished
  kStop,         // eos, a stop token id or a stop string
  kLength,       // max_tokens or the model's context
  kAbort,        // Abort() or engine stop
  kDeadline,     // the deadline passed (queued or running)
  kError,        // see RequestOutput::status
  kPrefillDone,  // prefill-only request: first token sampled, blocks pinned
};
std::string_view FinishReasonName(FinishReason reason);

// One delivery to a request's callback: the tokens new since the last one;
// the last delivery has finished == true.
struct RequestOutput {
  std::string request_id;
  std::vector<uint32_t> token_ids;  // new tokens
  std::string text;  // new text (only when the engine has a tokenizer); stop strings cut out
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status status;  // non-OK for kAbort, kDeadline, kError
  // Usage (valid on every delivery).
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint32_t cached_prompt_tokens = 0;  // prompt tokens served by the prefix cache
  // Prefill-only requests, on the finishing delivery: the pinned blocks
  // holding the prompt's KV (block i holds positions [i*block_size,
  // (i+1)*block_size)), valid until ReleasePrefill / Abort.
  std::vector<uint32_t> block_ids;
};

// Runs on the engine thread (or the thread calling Abort/Stop/AddPrefilled),
// never under the engine's lock: it may call the engine, but must not block
// for long (it holds up every other request).
using OutputCallback = std::function<void(const RequestOutput&)>;

struct GenerateRequest {
  std::string request_id;  // unique among the engine's live requests
  std::vector<uint32_t> prompt_ids;
  SamplingParams sampling;
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // Stop after the first sampled token and keep the blocks pinned (a
  // prefiller then pushes them) until ReleasePrefill.
  bool prefill_only = false;
  // Output tokens already produced elsewhere (migration): the random draw
  // for the next token is this index, so a migrated request continues the
  // same random stream.
  uint32_t first_sample_index = 0;
  OutputCallback on_output;
};

// A decoder's reservation of KV blocks for a prompt whose KV is written
// externally (by a prefiller's push).
struct Reservation {
  uint64_t reservation_id = 0;     // random, unique among the engine's live reservations
  std::vector<uint32_t> block_ids;  // [ceil(prompt / block_size)]
  uint32_t num_cached_blocks = 0;   // leading blocks already holding the prompt's KV
  uint32_t num_cached_tokens() const;  // num_cached_blocks * block_size
  uint32_t block_size = 0;
};

}  // namespace tandem::engine
