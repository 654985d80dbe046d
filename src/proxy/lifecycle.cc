#include "proxy/lifecycle.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "common/block_hash.h"
#include "common/delivery_scope.h"
#include "common/logging.h"
#include "common/tracing.h"

namespace tandem::proxy {
namespace {

using SteadyClock = std::chrono::steady_clock;

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

uint64_t TenantRoot(const LifecycleDeps& deps, const std::string& tenant_salt) {
  if (tenant_salt.empty()) return deps.root_hash;
  HashContext ctx = deps.hash_context;
  ctx.tenant_salt = tenant_salt;
  return RootHash(ctx);
}

// `sent`: completion tokens already produced (and part of the prompt).
EngineArgs ToEngineArgs(const ValidatedRequest& r, uint32_t sent) {
  EngineArgs a;
  a.max_tokens = r.max_tokens - sent;
  a.first_sample_index = sent;
  a.temperature = r.temperature;
  a.top_p = r.top_p;
  a.top_k = r.top_k;
  a.seed = r.seed;
  a.stop_token_ids = r.stop_token_ids;
  a.ignore_eos = r.ignore_eos;
  a.priority = r.priority;
  a.tenant = r.tenant;
  a.tenant_weight = r.tenant_weight;
  return a;
}

}  // namespace

std::shared_ptr<RequestLifecycle> RequestLifecycle::Start(
    const LifecycleDeps& deps, ValidatedRequest request, ResponseSink sink,
    std::chrono::system_clock::time_point deadline, SteadyClock::time_point arrival) {
  auto self = std::make_shared<RequestLifecycle>(deps, std::move(request), std::move(sink),
                                                 deadline, arrival);
  self->Launch();
  return self;
}

RequestLifecycle::RequestLifecycle(const LifecycleDeps& deps, ValidatedRequest request,
                                   ResponseSink sink,
                                   std::chrono::system_clock::time_point deadline,
                                   SteadyClock::time_point arrival)
    : deps_(deps),
      req_(std::move(request)),
      deadline_(deadline),
      arrival_(arrival),
      root_hash_(TenantRoot(deps_, req_.tenant_salt)),
      out_(deps.tokenizer, req_.stop),
      sink_(std::move(sink)) {
  if (deps_.metrics) {
    deps_.metrics->inflight.Increment();
    deps_.metrics->prompt_tokens.Increment(static_cast<double>(req_.prompt_ids.size()));
  }
  LogRequest(spdlog::level::debug, req_.request_id, "arrived: {} prompt tokens, max_tokens {}",
             req_.prompt_ids.size(), req_.max_tokens);
  if (req_.trace.sampled) {
    // Admission: arrival to here (admission slot, parsing, tokenization, validation).
    tracing::SpanBuilder("tandem.admission", tracing::ChildOf(req_.trace),
                         tracing::SpanKind::kInternal, tracing::ToUnixNs(arrival_))
        .Attr("tandem.prompt_tokens", static_cast<int64_t>(req_.prompt_ids.size()))
        .Attr("tandem.max_tokens", static_cast<int64_t>(req_.max_tokens))
        .End();
  }
}

void RequestLifecycle::Relaunch() {
  if (!deps_.defer_launch) {
    Launch();
    return;
  }
  deps_.defer_launch([self = shared_from_this()] { self->Launch(); });
}

void RequestLifecycle::Launch() {
  std::unique_lock lock(mu_);
  if (done_) return;
  const uint32_t attempt = ++attempt_;
  ++route_attempts_;
  registered_ = false;
  if (prompt_len_ != req_.prompt_ids.size() + base_) {
    // First attempt, or the first after a migration: the prompt grows by
    // the tokens already sent, and so do its block hashes.
    if (base_ > 0) {
      auto grown = std::make_shared<std::vector<uint32_t>>(req_.prompt_ids);
      sent_.CopyPrefixTo(base_, grown.get());
      migrated_ = std::move(grown);
    }
    if (base_ == 0 && !req_.block_hashes.empty() && req_.block_hashes_root == root_hash_ &&
        req_.block_hashes_block_size == deps_.block_size) {
      hashes_ = req_.block_hashes;  // admission hashed it already
    } else {
      hashes_ = HashBlocks(root_hash_, PromptLocked(), deps_.block_size);
    }
    prompt_len_ = PromptLocked().size();
  }
  const uint64_t route_start = req_.trace.sampled ? tracing::NowUnixNs() : 0;
  const uint32_t max_tokens = req_.max_tokens > base_ ? req_.max_tokens - base_ : 0;  // left
  auto route = deps_.fleet->Route(hashes_, static_cast<uint32_t>(prompt_len_), excluded_,
                                  req_.ttft_slo_ms, max_tokens);
  // A deterministic policy may keep choosing an excluded worker that is
  // still registered (a lost decoder's Watch ends at about the same time as
  // its Decode stream): give the registry a moment to drop it (bounded).
  // Not after a refusal for lack of room: that answer goes out at once.
  for (int wait = 0; wait < 10 && !route.ok() && !excluded_.empty() &&
                     last_error_.code() != StatusCode::kResourceExhausted &&
                     route.status().code() == StatusCode::kResourceExhausted;
       ++wait) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    lock.lock();
    if (done_ || attempt != attempt_) return;
    route = deps_.fleet->Route(hashes_, static_cast<uint32_t>(prompt_len_), excluded_,
                               req_.ttft_slo_ms, max_tokens);
  }
  // Exclusion is a preference, not a verdict: a worker excluded for a
  // failure that is still in routing after that wait passes the liveness
  // check, so it answers (e.g. a prefiller whose prefill outlasted a short
  // lease on a loaded host: slow, not lost). With no other pair, the retry
  // goes back to it rather than failing the request (a 1P fleet failed every
  // such request with UNAVAILABLE). A worker that is really gone has left
  // routing by now, so it is not chosen; nor is a decoder whose stream broke
  // mid-stream (never_again_). Not after a refusal for lack of room.
  if (!route.ok() && !excluded_.empty() &&
      last_error_.code() != StatusCode::kResourceExhausted &&
      route.status().code() == StatusCode::kResourceExhausted) {
    auto again = deps_.fleet->Route(hashes_, static_cast<uint32_t>(prompt_len_), never_again_,
                                    req_.ttft_slo_ms, max_tokens);
    if (again.ok()) {
      LogRequest(spdlog::level::info, req_.request_id,
                 "no pair without {}; attempt {} goes to prefiller '{}' and decoder '{}', "
                 "still in routing", fmt::join(excluded_, ", "), attempt,
                 again->local ? again->decode_name : again->prefill_name, again->decode_name);
      route = std::move(again);
    }
  }
  if (!route.ok()) {
    if (req_.trace.sampled) {
      tracing::SpanBuilder("tandem.route", tracing::ChildOf(req_.trace),
                           tracing::SpanKind::kInternal, route_start)
          .Attr("tandem.attempt", static_cast<int64_t>(attempt))
          .Error(route.status().ToString())
          .End();
    }
    // After a refusal, the client hears what went wrong with the last pair.
    Calls c = FailLocked(last_error_.ok() ? route.status()
                                          : last_error_.WithContext(route.status().message()));
    lock.unlock();
    CancelAll(c);
    return;
  }
  route_ = *route;
  prefill_open_ = attempt_open_ = true;
  if (req_.trace.sampled) TraceRoute(attempt, route_start);
  // DebugString formats every score (snprintf of floats): only when logged.
  if (spdlog::should_log(spdlog::level::debug)) {
    LogRequest(spdlog::level::debug, req_.request_id, "attempt {} {}", attempt,
               route_.decision.DebugString());
  }

  DecodeArgs args;
  args.request_id = req_.request_id;
  args.prompt_ids = PromptRefLocked();
  args.prompt_varints = PromptVarintsLocked();
  args.params = ToEngineArgs(req_, base_);
  args.deadline = deadline_;
  args.prefill_locally = route_.local;
  args.tenant_salt = req_.tenant_salt;
  args.attempt = attempt;
  if (req_.trace.sampled) args.traceparent = tracing::FormatTraceparent(req_.trace);
  // Session 38 (docs/decode-stream.md, "Prefill with the start"): to a
  // decoder whose Reserve waits for the registration, the Prefill goes out
  // right after the start instead of a round trip later, and the decoder
  // says `registered` with the request's first item.
  prefill_with_start_ = !route_.local && route_.decode_waits_for_registration;
  args.registered_with_first_item = prefill_with_start_;
  // Session 39 (docs/decode-stream.md, "The prompt goes once"): a decoder
  // that takes the prompt from the prefiller's Reserve gets its length and
  // digest, not its tokens: the proxy sends the prompt once, to the prefiller.
  args.prompt_by_reference = !route_.local && route_.decode_takes_prompt_from_reserve;
  // Session 41 (docs/decode-stream.md, "The quiet end"): with one token to
  // go, the Prefill's reply ends the request here (OnPrefillDone), so the
  // decoder need not say anything about it: no item, no wake-up of the
  // stream's reader. Never after a local prefill (no Prefill reply).
  args.quiet_end_on_first_token = QuietEndLocked();
  std::weak_ptr<RequestLifecycle> weak = weak_from_this();
  DecodeEvents ev;
  // What a token reads first: the reference count and deps_ (make_shared
  // puts the count just before the object), the per-token members, and
  // what the sink reads.
  ev.hot[0] = {reinterpret_cast<const char*>(this) - 16, 64};
  ev.hot[1] = {&mu_, static_cast<uint32_t>(reinterpret_cast<const char*>(&sink_.on_delta + 1) -
                                           reinterpret_cast<const char*>(&mu_))};
  ev.hot[2] = sink_.hot[0];
  ev.hot[3] = sink_.hot[1];
  ev.on_registered = [weak, attempt] {
    if (auto s = weak.lock()) s->OnRegistered(attempt);
  };
  ev.on_tokens = [weak, attempt](uint32_t idx, std::span<const uint32_t> ids) {
    if (auto s = weak.lock()) s->OnTokens(attempt, idx, ids);
  };
  ev.on_finished = [weak, attempt](Finish reason, uint32_t, uint32_t decoder_cached,
                                   uint32_t prefill_cached) {
    if (auto s = weak.lock()) s->OnFinished(attempt, reason, decoder_cached, prefill_cached);
  };
  ev.on_error = [weak, attempt](Status st, bool from_worker) {
    if (auto s = weak.lock()) s->OnDecodeError(attempt, std::move(st), from_worker);
  };
  const std::string address = route_.decode_address;
  lock.unlock();
  // The callbacks take mu_, so the call starts outside it.
  auto call = deps_.client->Decode(address, std::move(args), std::move(ev));
  lock.lock();
  if (done_ || attempt != attempt_) {
    lock.unlock();
    call->Cancel();
    return;
  }
  decode_call_ = std::move(call);
  if (prefill_with_start_) StartPrefill(lock, attempt);
}

void RequestLifecycle::OnRegistered(uint32_t attempt) {
  std::unique_lock lock(mu_);
  if (done_ || attempt != attempt_) return;
  registered_ = true;
  if (route_.local || prefill_with_start_) return;  // no Prefill, or it went out already
  StartPrefill(lock, attempt);
}

void RequestLifecycle::StartPrefill(std::unique_lock<std::mutex>& lock, uint32_t attempt) {
  PrefillArgs args;
  args.request_id = req_.request_id;
  args.prompt_ids = PromptRefLocked();
  args.prompt_varints = PromptVarintsLocked();
  args.params = ToEngineArgs(req_, base_);
  args.deadline = deadline_;
  args.decoder_address = route_.decode_address;
  args.decoder_reserve_address = route_.decode_reserve_address;  // reserve-tcp (issue 23)
  args.decoder_name = route_.decode_name;
  args.tenant_salt = req_.tenant_salt;
  args.attempt = attempt;
  args.waited =
      std::chrono::duration_cast<std::chrono::microseconds>(SteadyClock::now() - arrival_);
  if (req_.trace.sampled) args.traceparent = tracing::FormatTraceparent(req_.trace);
  const std::string address = route_.prefill_address;
  lock.unlock();
  std::weak_ptr<RequestLifecycle> weak = weak_from_this();
  auto call = deps_.client->Prefill(address, std::move(args),
                                    [weak, attempt](Result<PrefillResult> r) {
                                      if (auto s = weak.lock()) {
                                        s->OnPrefillDone(attempt, std::move(r));
                                      }
                                    });
  lock.lock();
  if (done_ || attempt != attempt_) {
    lock.unlock();
    call->Cancel();
    return;
  }
  prefill_call_ = std::move(call);
}

void RequestLifecycle::OnPrefillDone(uint32_t attempt, Result<PrefillResult> r) {
  std::unique_lock lock(mu_);
  if (done_ || attempt != attempt_) return;
  EndPrefillLocked();
  // The call is over: nothing to cancel at the request's end (a cancel of
  // an ended call only looks it up, on the decode stream's reader: issue
  // 23). (A reply that came before Launch kept the call is cancelled then,
  // harmlessly, as before.)
  prefill_call_.reset();
  Calls to_cancel;
  if (!r.ok() && out_.next_index() > base_) {
    // The decoder already has the KV and streams: only the reply was lost
    // (e.g. the prefiller died right after its push). Nothing to do.
    LogRequest(spdlog::level::info, req_.request_id,
               "prefill reply lost after the decoder started ({}); going on",
               r.status().ToString());
    return;
  }
  if (!r.ok()) {
    // A decoder without room, or a prefiller that is gone: try another pair.
    // Anything else (bad input, deadline) is the request's own error.
    const bool no_room = r.status().code() == StatusCode::kResourceExhausted;
    // A CANCELLED here is not the proxy's own: its cancels end the request
    // or move it to a new attempt first, so their callbacks are ignored.
    // The worker cut the call (a draining worker's server shutdown cancels
    // what is still open): as a lost prefiller.
    const bool lost = r.status().code() == StatusCode::kUnavailable ||
                      r.status().code() == StatusCode::kCancelled;
    // The prefiller names the decoder in every error about reaching it
    // (src/prefiller: "... decoder 'NAME' ..."): then the decoder is the
    // one to avoid, not the prefiller that reported it.
    const bool decoder_lost =
        lost && r.status().message().find(fmt::format("decoder '{}'", route_.decode_name)) !=
                    std::string::npos;
    const std::string culprit =
        no_room || decoder_lost ? route_.decode_name : route_.prefill_name;
    if (!((no_room || lost) && RetryLocked(r.status(), culprit, to_cancel))) {
      to_cancel = FailLocked(r.status());
    }
    const bool relaunch = !done_;
    lock.unlock();
    CancelAll(to_cancel);
    if (relaunch) Relaunch();
    return;
  }
  if (base_ == 0) cached_tokens_ = r->cached_prompt_tokens;
  if (deps_.metrics) {
    deps_.metrics->ObservePrefillTimes(req_.request_id, r->prefill_seconds, r->transfer_seconds);
  }
  const uint32_t first = r->first_token_id;
  to_cancel = DeliverLocked(base_, std::span<const uint32_t>(&first, 1));
  Finish reason = Finish::kNone;
  std::shared_ptr<Call> ending;
  if (!done_ && EndsAfterLastTokenLocked(&reason)) {
    // The first token is also the last (max_tokens 1, or a stop token):
    // the decoder ends the request on it by itself, so the client gets the
    // token and the end in one write now instead of a write now and one
    // when the decoder's finished item comes (issue 23). The decode call
    // is left to end on its own (cancelling it would cost a message to
    // the decoder); its events find this lifecycle done. After a quiet
    // start it is forgotten instead: no events come.
    ending = std::move(decode_call_);
    decode_call_.reset();
    to_cancel = CompleteLocked(reason);
  }
  const bool forget = ending && QuietEndLocked();
  lock.unlock();
  // The quiet end: the decoder sends nothing more for it; the call keeps
  // nothing (a decode stream's handle), without a message.
  if (forget) ending->Forget();
  CancelAll(to_cancel);
}

bool RequestLifecycle::QuietEndLocked() const {
  return !route_.local && req_.max_tokens == base_ + 1;  // base_ < max_tokens: no wrap
}

bool RequestLifecycle::EndsAfterLastTokenLocked(Finish* reason) const {
  if (sent_.empty()) return false;
  const uint32_t last = sent_.back();
  const auto has = [last](const std::vector<uint32_t>& v) {
    return std::find(v.begin(), v.end(), last) != v.end();
  };
  // The engine's order (engine_step.cc AppendToken): stop, then length.
  if (has(req_.stop_token_ids) || (!req_.ignore_eos && has(deps_.eos_token_ids))) {
    *reason = Finish::kStop;
    return true;
  }
  if (out_.next_index() >= req_.max_tokens) {
    *reason = Finish::kLength;
    return true;
  }
  return false;
}

void RequestLifecycle::OnTokens(uint32_t attempt, uint32_t first_index,
                                std::span<const uint32_t> ids) {
  std::unique_lock lock(mu_);
  if (done_ || attempt != attempt_) return;
  Calls to_cancel = DeliverLocked(base_ + first_index, ids);
  lock.unlock();
  CancelAll(to_cancel);
}

void RequestLifecycle::OnFinished(uint32_t attempt, Finish reason,
                                  uint32_t decoder_cached_tokens, uint32_t prefill_cached_tokens) {
  std::unique_lock lock(mu_);
  if (done_ || attempt != attempt_) return;
  // The usage's cached tokens: the local prefill's hits, or the prefiller's
  // (relayed by the decoder from the KV notice: with a short completion the
  // decoder can finish before the prefill reply reaches us).
  if (base_ == 0) cached_tokens_ = route_.local ? decoder_cached_tokens : prefill_cached_tokens;
  // The decode call ended with this item (the stream dropped its handle):
  // no cancel for it (issue 23: a lookup under the stream's mutex per request).
  decode_call_.reset();
  // Nor for the prefill: the decoder finished, so it had the KV and the
  // prefiller's work is over; its reply is on its way and will find this
  // request done. A cancel would cost a frame to the prefiller and a
  // wake-up of the proxy's frame loop (a quarter of 8k prompts with one
  // output token finish at the decoder first: issue 23).
  prefill_call_.reset();
  Calls to_cancel = CompleteLocked(reason == Finish::kNone ? Finish::kStop : reason);
  lock.unlock();
  CancelAll(to_cancel);
}

void RequestLifecycle::OnDecodeError(uint32_t attempt, Status st, bool from_worker) {
  std::unique_lock lock(mu_);
  if (done_ || attempt != attempt_) return;
  Calls to_cancel;
  // A broken stream (not an in-band error) means the decoder or the way to
  // it is gone, whatever code gRPC chose for it. A CANCELLED, in band or
  // not, is not the proxy's own either (its cancels end the request or move
  // it to a new attempt first, so their callbacks are ignored): the decoder
  // cut the stream (a drain's server shutdown, its engine stopping).
  const bool lost = (!from_worker && st.code() != StatusCode::kDeadlineExceeded) ||
                    st.code() == StatusCode::kCancelled;
  const bool retry = lost || st.code() == StatusCode::kUnavailable ||
                     st.code() == StatusCode::kResourceExhausted;
  if (out_.next_index() > base_) {
    // Tokens of this attempt reached the client: only a migration can go on.
    if (!(lost || st.code() == StatusCode::kUnavailable) || !MigrateLocked(st, to_cancel)) {
      if (!done_) to_cancel = FailLocked(st);
    }
  } else {
    // A registered request whose KV never came (the decoder says so, in
    // band: its lease expired) points at the prefiller; anything else at
    // the decoder.
    const std::string culprit =
        from_worker && registered_ && !route_.local && st.code() == StatusCode::kUnavailable
            ? route_.prefill_name
            : route_.decode_name;
    if (!(retry && RetryLocked(st, culprit, to_cancel))) to_cancel = FailLocked(st);
  }
  const bool relaunch = !done_;
  lock.unlock();
  CancelAll(to_cancel);
  if (relaunch) Relaunch();
}

bool RequestLifecycle::RetryLocked(const Status& st, const std::string& exclude,
                                   Calls& to_cancel) {
  if (out_.next_index() > base_ || route_attempts_ >= deps_.max_attempts) return false;
  LogRequest(spdlog::level::info, req_.request_id, "{} on attempt {}; re-routing", st.ToString(),
               attempt_);
  if (!exclude.empty()) excluded_.insert(exclude);
  last_error_ = st;
  if (deps_.metrics) deps_.metrics->retries.Increment();
  ++attempt_;  // callbacks of the abandoned attempt (e.g. its cancel) are ignored from now
  to_cancel = TakeCallsLocked();
  return true;
}

bool RequestLifecycle::MigrateLocked(const Status& st, Calls& to_cancel) {
  const uint32_t sent = out_.next_index();
  const std::string lost = route_.decode_name;
  // The stream broke after the last token but before its finish message.
  const uint32_t last = sent_.empty() ? 0 : sent_.back();
  const auto has = [last](const std::vector<uint32_t>& v) {
    return std::find(v.begin(), v.end(), last) != v.end();
  };
  if (sent >= req_.max_tokens) {
    to_cancel = CompleteLocked(Finish::kLength);
    return false;
  }
  if (!sent_.empty() && (has(req_.stop_token_ids) || (!req_.ignore_eos && has(deps_.eos_token_ids)))) {
    to_cancel = CompleteLocked(Finish::kStop);
    return false;
  }
  if (migrations_ >= deps_.max_migrations) {
    to_cancel = FailLocked(UnavailableError(fmt::format(
        "decoder '{}' was lost after {} completion tokens ({}); {}", lost, sent, st.message(),
        deps_.max_migrations == 0
            ? std::string("migration is off (proxy.max_migrations = 0)")
            : fmt::format("the request was already migrated {} times (proxy.max_migrations = {})",
                          migrations_, deps_.max_migrations))));
    return false;
  }
  ++migrations_;
  LogRequest(spdlog::level::warn, req_.request_id,
             "decoder '{}' lost after {} tokens ({}); migrating ({} of {})",
             lost, sent, st.ToString(), migrations_, deps_.max_migrations);
  base_ = sent;
  route_attempts_ = 0;
  excluded_ = {lost};  // earlier refusals may not hold any more; the lost one does
  never_again_.insert(lost);  // its stream broke: not even when no other pair exists
  last_error_ = UnavailableError(fmt::format(
      "decoder '{}' was lost after {} completion tokens and no other pair could continue",
      lost, sent));
  if (deps_.metrics) deps_.metrics->migrations.Increment();
  ++attempt_;  // as in RetryLocked
  to_cancel = TakeCallsLocked();
  return true;
}

RequestLifecycle::Calls RequestLifecycle::DeliverLocked(uint32_t first_index,
                                                        std::span<const uint32_t> ids) {
  OutputAssembler::Delta* d = &delta_;
  d->Clear();
  if (Status st = out_.PushTo(first_index, ids, d); !st.ok()) return FailLocked(std::move(st));
  if (d->token_ids.empty()) return {};
  EndPrefillLocked();  // a token of this attempt: its prefill is done
  sent_.Append(d->token_ids);
  // The batch's arrival time (one clock reading per decode stream frame,
  // not per token); every token still gets its own ITL sample.
  const auto now = DeliveryScope::Now();
  if (deps_.metrics) {
    for (size_t i = 0; i < d->token_ids.size(); ++i) {
      if (first_token_at_ == SteadyClock::time_point{}) {
        FirstTokenLocked(now);
      } else {
        // (Never below 0: the first token may have been stamped by another
        // thread's batch clock, microseconds off this one.)
        deps_.metrics->ObserveItl(i == 0 ? std::max(0.0, Seconds(now - last_token_at_)) : 0.0);
      }
    }
    deps_.metrics->CountGenerationTokens(d->token_ids.size());
  } else if (first_token_at_ == SteadyClock::time_point{}) {
    FirstTokenLocked(now);
  }
  last_token_at_ = now;
  if (sink_.on_delta) sink_.on_delta(d->token_ids, d->text);
  if (d->stopped) return CompleteLocked(Finish::kStop);
  return {};
}

void RequestLifecycle::FirstTokenLocked(SteadyClock::time_point now) {
  first_token_at_ = now;
  if (deps_.metrics) deps_.metrics->ttft.Observe(Seconds(now - arrival_));
  if (deps_.calibration != nullptr && req_.predicted_ttft_ms >= 0) {
    deps_.calibration->Observe(req_.predicted_ttft_ms, 1e3 * Seconds(now - arrival_),
                               req_.ttft_slo_ms, now);
  }
}

RequestLifecycle::Calls RequestLifecycle::CompleteLocked(Finish reason) {
  std::string tail = out_.Flush();
  if (!tail.empty() && sink_.on_delta) sink_.on_delta({}, tail);
  done_ = true;
  Usage usage;
  usage.prompt_tokens = static_cast<uint32_t>(req_.prompt_ids.size());
  usage.completion_tokens = out_.next_index();
  usage.cached_prompt_tokens = cached_tokens_;
  LogRequest(spdlog::level::debug, req_.request_id,
             "finished: {} prompt tokens ({} cached), {} completion tokens, TTFT {:.4f} s, "
             "e2e {:.4f} s",
             usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens,
             Seconds(first_token_at_ - arrival_), Seconds(SteadyClock::now() - arrival_));
  if (deps_.metrics) {
    const auto now = SteadyClock::now();
    const double e2e = Seconds(now - arrival_);
    deps_.metrics->e2e.Observe(e2e);
    if (usage.completion_tokens > 1) {
      deps_.metrics->tpot.Observe((e2e - Seconds(first_token_at_ - arrival_)) /
                                  (usage.completion_tokens - 1));
    }
    deps_.metrics->CountOutcome("ok");
    deps_.metrics->inflight.Decrement();
  }
  if (req_.trace.sampled) TraceEndLocked("");
  if (sink_.on_finish) sink_.on_finish(reason, usage);
  sink_ = {};
  return TakeCallsLocked();
}

RequestLifecycle::Calls RequestLifecycle::FailLocked(Status st) {
  done_ = true;
  if (deps_.metrics) {
    deps_.metrics->CountOutcome(st.code() == StatusCode::kResourceExhausted ? "rejected"
                                : st.code() == StatusCode::kDeadlineExceeded ? "cancelled"
                                                                             : "failed");
    // Its deadline passed while it waited (a worker dropped it from its
    // queue, before any compute) or while it was computed.
    if (st.code() == StatusCode::kDeadlineExceeded && first_token_at_ == SteadyClock::time_point{}) {
      deps_.metrics->CountRefusal(Refusal::kDeadline);
    }
    deps_.metrics->inflight.Decrement();
  }
  LogRequest(spdlog::level::warn, req_.request_id, "failed: {}", st.ToString());
  if (req_.trace.sampled) TraceEndLocked(st.ToString());
  if (sink_.on_error) sink_.on_error(std::move(st));
  sink_ = {};
  return TakeCallsLocked();
}

void RequestLifecycle::TraceRoute(uint32_t attempt, uint64_t start_unix_ns) const {
  const router::RouteDecision& d = route_.decision;
  tracing::SpanBuilder("tandem.route", tracing::ChildOf(req_.trace), tracing::SpanKind::kInternal,
                       start_unix_ns)
      .Attr("tandem.attempt", static_cast<int64_t>(attempt))
      .Attr("tandem.route.prefill", route_.local ? route_.decode_name : route_.prefill_name)
      .Attr("tandem.route.decode", route_.decode_name)
      .Attr("tandem.route.local_prefill", route_.local)
      .Attr("tandem.route.predicted_hit_tokens",
            static_cast<int64_t>(std::min<uint64_t>(
                uint64_t{d.prefill_overlap_blocks} * deps_.block_size, prompt_len_)))
      .Attr("tandem.route.predicted_prefill_hit_blocks", static_cast<int64_t>(d.prefill_overlap_blocks))
      .Attr("tandem.route.predicted_decode_hit_blocks", static_cast<int64_t>(d.decode_overlap_blocks))
      .Attr("tandem.route.prompt_blocks", static_cast<int64_t>(d.prompt_blocks))
      .Attr("tandem.route.cost", d.cost)
      .End();
}

void RequestLifecycle::TraceEndLocked(const std::string& error) {
  const tracing::ClockMap unix_ns;
  const uint64_t now = unix_ns.now();
  const int64_t completion = out_.next_index();
  if (first_token_at_ != SteadyClock::time_point{}) {
    // The stream to the client: first token to the end.
    tracing::SpanBuilder stream("tandem.stream", tracing::ChildOf(req_.trace),
                                tracing::SpanKind::kInternal, unix_ns(first_token_at_));
    stream.Attr("tandem.completion_tokens", completion);
    if (!error.empty()) stream.Error(error);
    stream.End(now);
  }
  tracing::SpanBuilder b("tandem.request", req_.trace, tracing::SpanKind::kServer,
                         unix_ns(arrival_));
  b.Attr("tandem.request_id", req_.client_request_id)
      .Attr("tandem.prompt_tokens", static_cast<int64_t>(req_.prompt_ids.size()))
      .Attr("tandem.completion_tokens", completion)
      .Attr("tandem.cached_prompt_tokens", static_cast<int64_t>(cached_tokens_))
      .Attr("tandem.attempts", static_cast<int64_t>(attempt_))
      .Attr("tandem.migrations", static_cast<int64_t>(migrations_));
  if (!error.empty()) b.Error(error);
  b.End(now);
}

void RequestLifecycle::EndPrefillLocked() {
  if (!prefill_open_) return;
  prefill_open_ = false;
  deps_.fleet->router().EndPrefill(route_.decision.prefill_ticket);
}

void RequestLifecycle::EndAttemptLocked() {
  if (!attempt_open_) return;
  attempt_open_ = false;
  const bool prefill_ended = !prefill_open_;
  prefill_open_ = false;
  deps_.fleet->router().EndAttempt(route_.decision.prefill_ticket, prefill_ended);
}

RequestLifecycle::Calls RequestLifecycle::TakeCallsLocked() {
  EndAttemptLocked();
  Calls c;
  if (decode_call_) c.push_back(std::move(decode_call_));
  if (prefill_call_) c.push_back(std::move(prefill_call_));
  decode_call_.reset();
  prefill_call_.reset();
  return c;
}

void RequestLifecycle::CancelAll(const Calls& calls) {
  for (const auto& c : calls) c->Cancel();
}

void RequestLifecycle::Cancel() {
  std::unique_lock lock(mu_);
  if (done_) return;
  done_ = true;
  sink_ = {};
  if (deps_.metrics) {
    deps_.metrics->CountOutcome("cancelled");
    // The client's deadline ends the call (its gRPC library cancels it a
    // network hop before our copy of the deadline expires, hence the
    // slack): before the first token, it was dropped for its deadline.
    constexpr auto kDeadlineSlack = std::chrono::milliseconds(100);
    if (deadline_ != std::chrono::system_clock::time_point::max() &&
        std::chrono::system_clock::now() + kDeadlineSlack >= deadline_ &&
        first_token_at_ == SteadyClock::time_point{}) {
      deps_.metrics->CountRefusal(Refusal::kDeadline);
    }
    deps_.metrics->inflight.Decrement();
  }
  if (req_.trace.sampled) TraceEndLocked("cancelled by the client");
  Calls c = TakeCallsLocked();
  lock.unlock();
  CancelAll(c);
}

}  // namespace tandem::proxy
