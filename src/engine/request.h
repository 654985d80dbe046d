// What callers hand the engine and what it hands back, per request.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
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

// Which of a prefill-only request's prompt KV bytes are final (the
// streaming KV push, docs/kvtransfer.md). After a call: every layer of
// positions [0, final_tokens) is final, and layers [0, layers_done) of
// positions [final_tokens, chunk_end). Reported after each layer group of
// each prefill chunk, and once more with layers_done == num_layers when the
// chunk's forward pass returned.
struct KvProgress {
  uint32_t final_tokens = 0;
  uint32_t chunk_end = 0;
  uint32_t layers_done = 0;
  uint32_t num_layers = 0;
  // Bumped when the engine preempted the request (its blocks were freed and
  // it recomputes): everything reported under an earlier attempt is void.
  uint32_t attempt = 0;
  std::span<const uint32_t> block_table;  // [blocks covering chunk_end]; valid during the call
};
// Runs on the engine thread inside the step, without the engine lock; it
// must be quick (it delays the forward pass) and must not call the engine.
using KvProgressCallback = std::function<void(const KvProgress&)>;

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
  // The tenant's salt (HashContext::tenant_salt): the request's blocks hash
  // under RootHash(engine context + this salt), so they are shared only with
  // requests of the same salt (docs/security.md, "Tenants and limits").
  std::string cache_salt;
  // Scheduling (docs/scheduling.md): lower priority values are served
  // first and may preempt higher ones; within a priority, tenants share by
  // weighted fair queueing on tokens ("" is the default tenant).
  int32_t priority = 0;
  std::string tenant;
  double tenant_weight = 1.0;  // <= 0 counts as 1
  // Since when the request waits (a prefiller: its service queue); unset:
  // from Submit. Ends at its first scheduled step (EngineOptions::on_queue_time).
  std::optional<std::chrono::steady_clock::time_point> queued_since;
  OutputCallback on_output;
  // Prefill-only requests: told as the prompt's KV becomes final (optional).
  KvProgressCallback on_kv_progress;
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
