// The life of one request at the proxy (DESIGN.md section 2), shared by the
// gRPC and HTTP front ends:
//   route → open Decode on the decoder (registered, no KV yet) → Prefill on
//   the prefiller, naming the decoder → first token from the Prefill reply
//   or the decode stream, whichever comes first, exactly once → tokens from
//   the decode stream → finish with usage.
// Aggregated workers (and conditional disaggregation) get one Decode with
// prefill_locally. A decoder without room (RESOURCE_EXHAUSTED) or a worker
// lost before the first token makes the proxy re-route, a bounded number of
// times, without the client noticing. A decoder lost mid-stream makes it
// migrate (docs/failure-handling.md): prompt + the tokens already sent go
// to a new pair as the prompt, the new decoder's token i is completion token
// sent + i, and the random stream continues at index `sent`, so the client
// sees neither a gap nor a duplicate; at most `max_migrations` times.
//
// Thread-safety: Start from any thread; the worker callbacks arrive on gRPC
// threads and are serialized by the lifecycle's mutex; the sink is called
// under that mutex, in order, and must only enqueue (never block or call
// back into the lifecycle). Cancel may be called from any thread, any time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_hash.h"
#include "common/inline_function.h"
#include "common/status.h"
#include "model/tokenizer.h"
#include "proxy/fleet.h"
#include "proxy/output_assembler.h"
#include "proxy/proxy_metrics.h"
#include "proxy/request.h"
#include "proxy/sent_tokens.h"
#include "proxy/ttft_calibration.h"
#include "proxy/worker_client.h"

namespace tandem::proxy {

struct Usage {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint32_t cached_prompt_tokens = 0;
};

struct ResponseSink {
  // `token_ids` and `text` are valid during the call only (views of the
  // request's reused delta buffer: nothing is allocated per token).
  // Kept inline (common/inline_function.h: no heap block to read per call).
  InlineFunction<void(std::span<const uint32_t> token_ids, std::string_view text)> on_delta;
  std::function<void(Finish reason, Usage usage)> on_finish;  // last call on success
  std::function<void(Status status)> on_error;                // last call on failure
  // Optional: what on_delta reads first (worker_client.h HotBytes); the
  // decode stream's reader prefetches it with the batch.
  std::array<HotBytes, 2> hot{};
};

struct LifecycleDeps {
  Fleet* fleet = nullptr;
  WorkerClient* client = nullptr;
  const model::Tokenizer* tokenizer = nullptr;
  ProxyMetrics* metrics = nullptr;  // may be null (tests)
  // Told each first token of a request SLO admission predicted (may be null).
  TtftCalibration* calibration = nullptr;
  uint64_t root_hash = 0;  // RootHash(hash_context): requests without a tenant salt
  HashContext hash_context;  // the fleet's; a request's tenant salt is added to it
  uint32_t block_size = 16;
  uint32_t max_attempts = 3;  // routes tried before the client gets the error
  uint32_t max_migrations = 3;  // proxy.max_migrations
  // The model's eos ids: a stream that broke right after an eos is complete.
  std::vector<uint32_t> eos_token_ids;
  // Runs a new attempt after a failed one. The worker calls' callbacks come
  // on transport threads (the shared frame loop serves every Watch and
  // Prefill connection; a decode stream's reader serves all its requests),
  // and an attempt may wait for the registry (up to ~1 s) or connect to a
  // worker, so the frontend hands it to its work pool. Unset (tests): inline.
  std::function<void(std::function<void()>)> defer_launch;
};

class RequestLifecycle : public std::enable_shared_from_this<RequestLifecycle> {
 public:
  static std::shared_ptr<RequestLifecycle> Start(
      const LifecycleDeps& deps, ValidatedRequest request, ResponseSink sink,
      std::chrono::system_clock::time_point deadline,
      std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now());

  // The client went away: both workers are told, nothing more reaches the sink.
  void Cancel();

  RequestLifecycle(const LifecycleDeps& deps, ValidatedRequest request, ResponseSink sink,
                   std::chrono::system_clock::time_point deadline,
                   std::chrono::steady_clock::time_point arrival);

 private:
  using Calls = std::vector<std::shared_ptr<Call>>;

  void Launch();  // one routing attempt
  void Relaunch();  // Launch, through deps_.defer_launch when set
  void OnRegistered(uint32_t attempt);
  // Starts this attempt's Prefill; `lock` holds mu_ and is released.
  void StartPrefill(std::unique_lock<std::mutex>& lock, uint32_t attempt);
  void OnPrefillDone(uint32_t attempt, Result<PrefillResult> r);
  void OnTokens(uint32_t attempt, uint32_t first_index, std::span<const uint32_t> ids);
  void OnFinished(uint32_t attempt, Finish reason, uint32_t decoder_cached_tokens,
                  uint32_t prefill_cached_tokens);
  void OnDecodeError(uint32_t attempt, Status st, bool from_worker);

  // With mu_ held. Each returns the calls to cancel once the lock is released.
  Calls DeliverLocked(uint32_t first_index, std::span<const uint32_t> ids);
  // The request's first token reached the client at `now`: TTFT metric and
  // the admission's calibration.
  void FirstTokenLocked(std::chrono::steady_clock::time_point now);
  Calls CompleteLocked(Finish reason);
  // Whether the last token sent ends the request the way the decoder's
  // engine would end it (a stop or EOS token, or max_tokens reached), and
  // with which reason.
  bool EndsAfterLastTokenLocked(Finish* reason) const;
  // This attempt's decode start asks for the quiet end
  // (DecodeArgs::quiet_end_on_first_token): a remote prefill with one token
  // to go, so the Prefill's reply ends the request. Fixed for an attempt
  // (a migration, which moves base_, is a new attempt).
  bool QuietEndLocked() const;
  Calls FailLocked(Status st);
  // Re-routes when nothing reached the client yet and attempts remain.
  bool RetryLocked(const Status& st, const std::string& exclude, Calls& to_cancel);
  // The decoder was lost after tokens of this attempt reached the client:
  // finishes the request when nothing was left to generate, re-routes
  // prompt + sent tokens when migrations remain (true: Launch again), and
  // fails it with UNAVAILABLE naming the reason otherwise.
  bool MigrateLocked(const Status& st, Calls& to_cancel);
  // The calls of this attempt end, and with them the attempt.
  Calls TakeCallsLocked();
  // Tells the router this attempt's prefill is over (once), so that its
  // tokens leave the prefiller's predicted queue now: the prefill reply,
  // a local prefill's first token, or the attempt's end, whichever first.
  void EndPrefillLocked();
  // Tells the router this attempt is over (once): finished, failed or
  // abandoned. Its prefill ends if still open, and its decode blocks stop
  // counting on its decoder if no load report counted them yet.
  void EndAttemptLocked();
  static void CancelAll(const Calls& calls);
  // Tracing (only when req_.trace.sampled): the routing span of an attempt,
  // and at the end the stream and request spans ("" error: success).
  void TraceRoute(uint32_t attempt, uint64_t start_unix_ns) const;
  void TraceEndLocked(const std::string& error);

  const LifecycleDeps deps_;
  const ValidatedRequest req_;
  const std::chrono::system_clock::time_point deadline_;
  const std::chrono::steady_clock::time_point arrival_;
  const uint64_t root_hash_;  // deps_.root_hash, or the tenant-salted root
  std::vector<uint64_t> hashes_;

  // What every token reads (OnTokens, DeliverLocked) comes first, together:
  // after a decode step (~6 ms) it is cache-cold, one miss per line.
  std::mutex mu_;
  bool done_ = false;                // guarded by mu_
  bool prefill_open_ = false;        // guarded by mu_: route_'s prefill not yet ended at the router
  bool attempt_open_ = false;        // guarded by mu_: route_'s attempt not yet ended at the router
  uint32_t attempt_ = 0;             // guarded by mu_: every route tried, a generation number
  uint32_t base_ = 0;                // guarded by mu_: completion index of this attempt's token 0
  std::chrono::steady_clock::time_point first_token_at_{};  // guarded by mu_
  std::chrono::steady_clock::time_point last_token_at_{};   // guarded by mu_
  SentTokens sent_;                  // guarded by mu_: completion tokens sent to the client
  OutputAssembler::Delta delta_;     // guarded by mu_: the delivery's, reused
  OutputAssembler out_;              // guarded by mu_
  ResponseSink sink_;                // guarded by mu_
  uint32_t route_attempts_ = 0;      // guarded by mu_: routes tried since the last migration
  uint32_t migrations_ = 0;          // guarded by mu_
  bool registered_ = false;          // guarded by mu_: this attempt's decoder registered it
  // guarded by mu_: this attempt's Prefill went out with the decode start
  // (its decoder's WorkerInfo.reserve_waits_for_registration), not after
  // `registered`
  bool prefill_with_start_ = false;
  // This attempt's prompt: the request's own ids, or after a migration
  // those + the tokens already sent (migrated_, immutable once made).
  PromptIds migrated_;               // guarded by mu_: null before any migration
  size_t prompt_len_ = 0;            // guarded by mu_: length hashes_ were made for (0: none)
  const std::vector<uint32_t>& PromptLocked() const {
    return migrated_ ? *migrated_ : req_.prompt_ids;
  }
  // For a worker call (with mu_ held): shares the ids, no copy. The
  // request's own ids are shared through this lifecycle's ownership, never
  // kept in a member (that would keep the lifecycle alive forever).
  PromptIds PromptRefLocked() {
    return migrated_ ? migrated_ : PromptIds(shared_from_this(), &req_.prompt_ids);
  }
  // The client's bytes of this attempt's prompt, alive as long as
  // PromptRefLocked()'s reference; none after a migration (the prompt grew).
  std::string_view PromptVarintsLocked() const {
    return migrated_ ? std::string_view() : req_.prompt_varints.bytes();
  }
  std::set<std::string> excluded_;   // guarded by mu_
  // guarded by mu_: decoders lost mid-stream, excluded even when no other
  // pair exists (excluded_ alone is a preference: see Launch)
  std::set<std::string> never_again_;
  Status last_error_;                // guarded by mu_: why the last attempt was abandoned
  RoutedPair route_;                 // guarded by mu_
  std::shared_ptr<Call> decode_call_;   // guarded by mu_
  std::shared_ptr<Call> prefill_call_;  // guarded by mu_
  uint32_t cached_tokens_ = 0;          // guarded by mu_
};

}  // namespace tandem::proxy
