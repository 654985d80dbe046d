// The prefill's trace spans (docs/tracing.md): queue, reserve, compute and
// KV push as children of the proxy's span, written as the job ends.
#include "prefiller/prefiller.h"

namespace tandem::prefiller {

void Prefiller::TraceLocked(const Job& job, const Result<PrefillResult>& result) const {
  using tracing::SpanBuilder;
  using tracing::SpanKind;
  const std::chrono::steady_clock::time_point none{};
  const tracing::SpanContext& ctx = job.spec.trace;
  const tracing::ClockMap unix_ns;  // one reading of both clocks for every span here
  const uint64_t now = unix_ns.now();
  const std::string error = result.ok() ? "" : result.status().ToString();
  auto child = [&](const char* name, std::chrono::steady_clock::time_point from) {
    SpanBuilder b(name, tracing::ChildOf(ctx), SpanKind::kInternal, unix_ns(from));
    b.Attr("tandem.decoder", job.spec.decoder_name);
    return b;
  };
  // Queue: Submit until the dispatcher sent the reservation (or the end).
  const uint64_t dispatched = job.reserve_sent != none ? unix_ns(job.reserve_sent) : now;
  child("tandem.prefill.queue", job.queued_at).End(dispatched);
  if (job.reserve_sent != none) {
    const uint64_t reserved = job.submitted != none ? unix_ns(job.submitted) : now;
    auto b = child("tandem.prefill.reserve", job.reserve_sent);
    if (job.have_target) b.Attr("tandem.decoder_cached_blocks", static_cast<int64_t>(job.target.cached_blocks));
    b.End(reserved);
  }
  if (job.submitted != none) {
    const uint64_t computed = job.transfer_started != none ? unix_ns(job.transfer_started) : now;
    auto b = child("tandem.prefill.compute", job.submitted);
    b.Attr("tandem.prompt_tokens", static_cast<int64_t>(job.spec.prompt_ids.size()));
    if (result.ok()) b.Attr("tandem.cached_prompt_tokens", static_cast<int64_t>(result->cached_prompt_tokens));
    if (job.transfer_started == none && !error.empty()) b.Error(error);
    b.End(computed);
  }
  if (job.push && job.submitted != none) {
    // The KV push to the decoder: streaming starts with the compute,
    // after_prefill once it is done; it ends with the notice sent.
    const bool streaming = options_.push_mode == PushMode::kStreaming;
    const std::chrono::steady_clock::time_point from = streaming ? job.submitted : job.transfer_started;
    if (from != none) {
      auto b = child("tandem.kv.push", from);
      b.Attr("tandem.push_mode", streaming ? "streaming" : "after_prefill")
          .Attr("tandem.kv.blocks", static_cast<int64_t>(job.result.transferred_blocks))
          .Attr("tandem.kv.bytes", static_cast<int64_t>(job.push->bytes_posted()))
          .Attr("tandem.kv.transfers", static_cast<int64_t>(job.push->transfers_posted()))
          .Attr("tandem.kv.decoder_cached_blocks", static_cast<int64_t>(job.result.decoder_cached_blocks));
      if (!error.empty()) b.Error(error);
      b.End(now);
    }
  }
  SpanBuilder root("tandem.prefill", ctx, SpanKind::kServer, unix_ns(job.queued_at));
  root.Attr("tandem.prefiller", options_.name)
      .Attr("tandem.decoder", job.spec.decoder_name)
      .Attr("tandem.prompt_tokens", static_cast<int64_t>(job.spec.prompt_ids.size()));
  if (result.ok()) {
    root.Attr("tandem.cached_prompt_tokens", static_cast<int64_t>(result->cached_prompt_tokens));
  } else {
    root.Error(error);
  }
  root.End(now);
}

}  // namespace tandem::prefiller
