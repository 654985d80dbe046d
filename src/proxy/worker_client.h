// How the proxy's request lifecycle talks to workers, in plain structs: the
// gRPC adapter (worker_client_grpc.cc) is the only place that sees
// worker.proto. Tests can substitute their own WorkerClient.
//
// Thread-safety: calls may be made from any thread; callbacks run on gRPC's
// callback threads, one at a time per call, and must not block.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/inline_function.h"
#include "common/status.h"

namespace tandem::proxy {

enum class Finish { kNone, kStop, kLength };

struct EngineArgs {
  uint32_t max_tokens = 0;
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint32_t top_k = 0;
  uint64_t seed = 0;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  // Migration: the prompt ends with this many tokens already sent to the
  // client; the random stream continues at this index.
  uint32_t first_sample_index = 0;
  // Scheduling (docs/scheduling.md): DecodeRequest/PrefillRequest fields
  // priority, tenant, tenant_weight.
  int32_t priority = 0;
  std::string tenant;
  double tenant_weight = 1.0;
};

// A request's prompt, shared by the lifecycle and both worker calls (one
// copy per request: each call copies it only into its own message).
using PromptIds = std::shared_ptr<const std::vector<uint32_t>>;

struct DecodeArgs {
  std::string request_id;
  PromptIds prompt_ids;  // never null when the lifecycle makes the call
  // prompt_ids as the client encoded them, packed varints in their
  // shortest form (ValidatedRequest::prompt_varints), in memory that
  // prompt_ids keeps alive (the lifecycle's); empty: none. The framed
  // transports send these bytes as the prompt_token_ids field (issue 23,
  // session 14); the others encode prompt_ids.
  std::string_view prompt_varints;
  EngineArgs params;
  std::chrono::system_clock::time_point deadline;  // max(): none
  bool prefill_locally = false;
  std::string tenant_salt;  // HashContext::tenant_salt of the request's tenant
  // The routing attempt (from 1): workers key the request by it, so a
  // retry never meets an earlier attempt's state (worker/attempt_key.h).
  uint32_t attempt = 0;
  std::string traceparent;  // W3C trace context for the worker; "" = not traced
  // The worker reads the prompt as fixed32 (WorkerInfo.reads_fixed32_prompt;
  // set by the worker client from the worker's registration).
  bool prompt_fixed32 = false;
  // The Prefill goes out with the start, not after `registered` (the
  // decoder advertised WorkerInfo.reserve_waits_for_registration:
  // docs/decode-stream.md, "Prefill with the start"): the decode stream's start asks for
  // `registered` with the request's first item
  // (DecodeStreamStart.registered_with_first_item). Other transports ignore it.
  bool registered_with_first_item = false;
  // Session 39 (docs/decode-stream.md, "The prompt goes once"): the decoder
  // takes the prompt from the prefiller's Reserve (it advertised
  // WorkerInfo.takes_prompt_from_reserve; never with prefill_locally): the
  // request names it by length and digest (DecodeRequest.prompt_length,
  // prompt_digest) instead of carrying its tokens.
  bool prompt_by_reference = false;
  // Session 41 (docs/decode-stream.md, "The quiet end"): the proxy ends
  // the request on the prefiller's reply (max_tokens 1, remote prefill)
  // and then Forget()s the call, so the decode stream's start asks the
  // decoder to send nothing for a request that ends on that first token
  // (DecodeStreamStart.quiet_end_on_first_token). Other transports ignore it.
  bool quiet_end_on_first_token = false;
};

// Memory a callback reads first (issue 23, mux-deliver): a caller that
// hands a batch of events to many receivers (the decode stream's reader)
// prefetches it for the whole batch before the first call, so that the
// receivers' cache misses overlap instead of following one another. Only
// ever prefetched, never read: a stale address costs nothing.
struct HotBytes {
  const void* addr = nullptr;
  uint32_t bytes = 0;  // 0: none

  // Prefetches the lines (at most kMaxBytes), for writing.
  static constexpr uint32_t kMaxBytes = 512;
  void Prefetch() const {
    const char* p = static_cast<const char*>(addr);
    for (uint32_t off = 0; off < bytes && off < kMaxBytes; off += 64) {
      __builtin_prefetch(p + off, 1);
    }
  }
};

struct DecodeEvents {
  // Optional: what on_tokens reads first (its receiver's state).
  std::array<HotBytes, 4> hot{};
  std::function<void()> on_registered;
  // `first_index`: index in the completion of ids[0]. `ids` is valid during
  // the call only (a view of the message read: no copy per delivery).
  // Kept inline (common/inline_function.h: no heap block to read per call).
  InlineFunction<void(uint32_t first_index, std::span<const uint32_t> ids)> on_tokens;
  // `prefill_cached_tokens`: the prefiller's prefix-cache hits as its KV
  // notice told the decoder (the prefill reply may arrive later).
  std::function<void(Finish reason, uint32_t completion_tokens, uint32_t decoder_cached_tokens,
                     uint32_t prefill_cached_tokens)>
      on_finished;
  // The stream ended without DecodeFinished (error, cancel, worker lost).
  // `from_worker`: the decoder itself sent the error in-band (it is alive);
  // false when the stream broke (the decoder or the network is lost).
  std::function<void(Status, bool from_worker)> on_error;
};

struct PrefillArgs {
  std::string request_id;
  PromptIds prompt_ids;  // as in DecodeArgs
  std::string_view prompt_varints;  // as in DecodeArgs
  EngineArgs params;
  std::chrono::system_clock::time_point deadline;
  std::string decoder_address;
  std::string decoder_reserve_address;  // issue 23: PrefillRequest.decoder_reserve_address
  std::string decoder_name;
  std::string tenant_salt;  // as in DecodeArgs
  uint32_t attempt = 0;  // as in DecodeArgs: the same for both calls of one attempt
  std::string traceparent;  // as in DecodeArgs
  bool prompt_fixed32 = false;  // as in DecodeArgs
  // Since the proxy received the request (PrefillRequest.waited_us): a
  // retry keeps its place in the prefiller's queue.
  std::chrono::microseconds waited{0};
};

struct PrefillResult {
  uint32_t first_token_id = 0;
  uint32_t cached_prompt_tokens = 0;
  uint32_t decoder_cached_blocks = 0;
  uint32_t transferred_blocks = 0;
  uint64_t transferred_bytes = 0;
  double prefill_seconds = 0;
  double transfer_seconds = 0;
};

// A call in flight; Cancel() is idempotent and safe after completion.
class Call {
 public:
  virtual ~Call() = default;
  virtual void Cancel() = 0;
  // The request ended at the proxy and the worker ends it by itself (a
  // decode stream's quiet end): its events stop and the call keeps nothing
  // for it, with no message to the worker (a Cancel would be one). Calls
  // that end on their own anyway (a per-request RPC) do nothing.
  virtual void Forget() {}
};

class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  // Exactly one of on_finished / on_error runs, last, once.
  virtual std::shared_ptr<Call> Decode(const std::string& address, DecodeArgs args,
                                       DecodeEvents events) = 0;
  // `done` runs once.
  virtual std::shared_ptr<Call> Prefill(const std::string& address, PrefillArgs args,
                                        std::function<void(Result<PrefillResult>)> done) = 0;
};

}  // namespace tandem::proxy
