// Decoder.DecodeStream at the proxy: one stream per decoder, demultiplexed
// by handle.
#include "proxy/decode_mux_client.h"

#include <atomic>
#include <utility>
#include <vector>

#include "common/delivery_scope.h"
#include "common/rpc_server.h"
#include "proxy/prompt_parts.h"
#include "proxy/proxy_metrics.h"

namespace tandem::proxy {

namespace pb = ::tandem::v1;

namespace {

// A token's entry (8 bytes) and its bytes are in tables of the whole
// vocabulary: after a decode step each is a miss of its own, one after the
// other in every detokenizer. Prefetched for the whole batch (Deliver),
// the entries' misses overlap, then the bytes' (read from the entries,
// which the pass over the requests in between gave time to arrive). Only
// prefetched: an id past the table is skipped (the detokenizer gives it no
// bytes). Always inlined: GCC finds a function that only prefetches free
// of side effects and drops a call to it.
[[gnu::always_inline]] inline void PrefetchTokenEntries(const model::TokenBytesTable* table,
                                                        std::span<const DecodeItem> items) {
  if (table == nullptr) return;
  const auto& entries = table->entries;
  for (const DecodeItem& item : items) {
    for (uint32_t id : item.token_ids) {
      if (id < entries.size()) __builtin_prefetch(&entries[id]);
    }
  }
}

[[gnu::always_inline]] inline void PrefetchTokenBytes(const model::TokenBytesTable* table,
                                                      std::span<const DecodeItem> items) {
  if (table == nullptr) return;
  const auto& entries = table->entries;
  const char* bytes = table->bytes.data();
  for (const DecodeItem& item : items) {
    for (uint32_t id : item.token_ids) {
      if (id < entries.size()) __builtin_prefetch(bytes + entries[id].offset);
    }
  }
}

}  // namespace

class DecodeMux::Request final : public Call {
 public:
  Request(std::weak_ptr<DecodeMux> mux, uint64_t handle, DecodeEvents events)
      : handle_(handle), mux_(std::move(mux)), events_(std::move(events)) {}

  // Starts loading what Deliver reads of a token item: the reference count
  // (make_shared's control block, just before the object), done_ and the
  // token callback. Cache-cold after a decode step; loaded for the whole
  // batch at once, the misses overlap instead of following one another.
  void Prefetch() const {
    const char* from = reinterpret_cast<const char*>(this) - 16;
    const char* to = reinterpret_cast<const char*>(&events_.on_tokens + 1);
    HotBytes{from, static_cast<uint32_t>(to - from)}.Prefetch();
  }
  // Then what its token callback reads first (DecodeEvents::hot), once
  // Prefetch's lines are on their way.
  void PrefetchReceiver() const {
    for (const HotBytes& h : events_.hot) h.Prefetch();
  }

  void Cancel() override {
    if (auto m = mux_.lock()) m->CancelRequest(handle_);
  }
  void Forget() override {
    done_.store(true, std::memory_order_relaxed);  // an item read meanwhile
    if (auto m = mux_.lock()) m->ForgetRequest(handle_);
  }

  // One item of a batch, on the reader thread.
  void Deliver(const DecodeItem& item) {
    if (done_.load(std::memory_order_relaxed)) return;
    if (item.registered && events_.on_registered) events_.on_registered();
    if (!item.token_ids.empty() && events_.on_tokens) {
      events_.on_tokens(item.first_index, item.token_ids);
    }
    if (item.end == DecodeItem::End::kFinished) {
      if (done_.exchange(true)) return;
      if (events_.on_finished) {
        events_.on_finished(FinishFromProto(static_cast<pb::FinishReason>(item.finish_reason)),
                            item.completion_tokens, item.decoder_cached_prompt_tokens,
                            item.prefill_cached_prompt_tokens);
      }
    } else if (item.end == DecodeItem::End::kError) {
      Fail(Status(static_cast<StatusCode>(item.error->code()), item.error->message()),
           /*from_worker=*/true);
    }
  }
  void Fail(const Status& status, bool from_worker) {
    if (done_.exchange(true)) return;
    if (events_.on_error) events_.on_error(status, from_worker);
  }

 private:
  // What a token item reads first (done_, events_.hot, events_.on_tokens).
  std::atomic<bool> done_{false};
  const uint64_t handle_;
  const std::weak_ptr<DecodeMux> mux_;
  // Never reset: the reader may be inside one of them while another thread
  // ends the request (the lifecycle serializes its own callbacks).
  const DecodeEvents events_;
};

bool DecodeStartInParts(const DecodeArgs& args, DecodeStartParts* out) {
  if (args.prompt_by_reference) return false;  // no prompt to send apart: a small message
  const PackedPrompt prompt =
      PromptForParts(args.prompt_ids, args.prompt_varints, args.prompt_fixed32);
  if (prompt.bytes.empty()) return false;
  pb::DecodeRequest req;
  FillDecodeRequestFields(args, &req);
  out->head.clear();
  out->bytes = AppendPromptMessageField(
      pb::DecodeStreamStart::kRequestFieldNumber, req,
      prompt.varints ? pb::DecodeRequest::kPromptTokenIdsFieldNumber
                     : pb::DecodeRequest::kPromptTokenIdsFixed32FieldNumber,
      prompt.bytes.size(), &out->head);
  out->prompt = prompt.bytes;
  out->tail.clear();
  if (!args.traceparent.empty() || args.registered_with_first_item ||
      args.quiet_end_on_first_token) {
    // Only the fields after the request.
    pb::DecodeStreamStart after;
    after.set_traceparent(args.traceparent);
    after.set_registered_with_first_item(args.registered_with_first_item);
    after.set_quiet_end_on_first_token(args.quiet_end_on_first_token);
    after.AppendToString(&out->tail);
  }
  out->bytes += out->tail.size();
  return true;
}

std::string DecodeStartPrefix(uint64_t handle, const DecodeStartParts& parts) {
  std::string handle_field;
  AppendVarintFieldTag(pb::DecodeStreamStart::kHandleFieldNumber, &handle_field);
  AppendVarint(handle, &handle_field);
  std::string out;
  AppendLengthDelimitedTag(pb::DecodeStreamRequest::kStartFieldNumber, &out);
  AppendVarint(handle_field.size() + parts.bytes, &out);
  out += handle_field;
  return out;
}

std::shared_ptr<Call> DecodeMux::Start(const DecodeArgs& args, DecodeEvents& events) {
  // Built outside the lock: the start in parts (the prompt copied once,
  // into the connection's output) where the transport takes them, else as
  // a message.
  DecodeStartParts parts;
  const bool in_parts = SendsParts() && DecodeStartInParts(args, &parts);
  pb::DecodeStreamRequest msg;
  if (!in_parts) {
    auto* start = msg.mutable_start();
    FillDecodeRequest(args, start->mutable_request());
    start->set_traceparent(args.traceparent);
    start->set_registered_with_first_item(args.registered_with_first_item);
    start->set_quiet_end_on_first_token(args.quiet_end_on_first_token);
  }
  std::unique_lock lock(mu_);
  if (ended_) return nullptr;
  const uint64_t handle = next_handle_++;
  auto req = std::make_shared<Request>(weak_from_this(), handle, std::move(events));
  requests_.Insert(handle, req);
  if (in_parts) {
    const std::string prefix = DecodeStartPrefix(handle, parts);
    SendPartsLocked(lock, {prefix, parts.head, parts.prompt, parts.tail});
  } else {
    msg.mutable_start()->set_handle(handle);
    SendLocked(lock, std::move(msg));
  }
  return req;
}

bool DecodeMux::ended() const {
  std::lock_guard lock(mu_);
  return ended_;
}

size_t DecodeMux::num_requests() const {
  std::lock_guard lock(mu_);
  return requests_.size();
}

void DecodeMux::CancelRequest(uint64_t handle) {
  std::unique_lock lock(mu_);
  std::shared_ptr<Request> req = requests_.Take(handle);
  if (!req) return;  // ended already
  if (!ended_) {
    pb::DecodeStreamRequest msg;
    msg.set_cancel(handle);
    SendLocked(lock, std::move(msg));
  }
  // As a cancelled Decode RPC: the request's last event, off this thread's
  // locks (the caller holds none of the lifecycle's: see lifecycle.h).
  if (lock.owns_lock()) lock.unlock();
  req->Fail(CancelledError("cancelled by the proxy"), /*from_worker=*/false);
}

void DecodeMux::ForgetRequest(uint64_t handle) {
  std::shared_ptr<Request> req;
  {
    std::lock_guard lock(mu_);
    req = requests_.Take(handle);  // null: it ended already
  }
  // Released outside the lock: the last reference may be this one.
}

void DecodeMux::Deliver(const pb::DecodeStreamResponse& batch) {
  ItemsOf(batch, &items_);
  Deliver(items_);
}

void DecodeMux::Deliver(std::span<const DecodeItem> items) {
  // One lock for the whole batch, then the events outside it.
  batch_.clear();
  {
    std::lock_guard lock(mu_);
    for (const DecodeItem& item : items) {
      if (std::shared_ptr<Request>* req = requests_.Find(item.handle)) (*req)->Prefetch();
    }
    for (const DecodeItem& item : items) {
      if (item.token_ids.empty()) continue;
      if (std::shared_ptr<Request>* req = requests_.Find(item.handle)) (*req)->PrefetchReceiver();
    }
    PrefetchTokenEntries(token_table_, items);
    for (const DecodeItem& item : items) {
      if (item.end != DecodeItem::End::kNone) {  // its last item: the handle is over
        if (std::shared_ptr<Request> req = requests_.Take(item.handle)) {
          batch_.emplace_back(std::move(req), &item);
        }
        continue;
      }
      std::shared_ptr<Request>* req = requests_.Find(item.handle);
      if (req == nullptr) continue;  // cancelled meanwhile
      batch_.emplace_back(*req, &item);
    }
    PrefetchTokenBytes(token_table_, items);
  }
  // One batch: a front end that buffers per connection (the native gRPC
  // server, docs/grpc-frontend.md) sends once at its end, not per item;
  // the token metrics are applied once at its end too, before that send
  // (declared after the scope: a client that has its token finds it in a
  // scrape).
  DeliveryScope scope;
  TokenMetricsBatch metrics_batch;
  for (auto& [req, item] : batch_) req->Deliver(*item);
  batch_.clear();
}

void DecodeMux::SetTokenTable(const model::TokenBytesTable* table) {
  std::lock_guard lock(mu_);
  token_table_ = table;
}

void DecodeMux::EndAll(const Status& status) {
  HandleTable<std::shared_ptr<Request>> left;
  {
    std::lock_guard lock(mu_);
    ended_ = true;
    left.swap(requests_);
  }
  const std::string why = abandoned();
  const Status st = !why.empty() ? UnavailableError(why) : status;
  left.ForEach([&st](uint64_t, std::shared_ptr<Request>& req) {
    req->Fail(st, /*from_worker=*/false);
  });
}

std::shared_ptr<DecodeMuxClient> DecodeMuxClient::Open(const std::shared_ptr<grpc::Channel>& channel) {
  auto mux = std::make_shared<DecodeMuxClient>();
  mux->stub_ = pb::Decoder::NewStub(channel);
  mux->self_ = mux;
  mux->stub_->async()->DecodeStream(&mux->ctx_, mux.get());
  mux->StartRead(&mux->resp_);
  mux->StartCall();
  return mux;
}

void DecodeMuxClient::SendLocked(std::unique_lock<std::mutex>& lock, pb::DecodeStreamRequest msg) {
  queue_.push_back(std::move(msg));
  Pump(lock);
}

void DecodeMuxClient::Pump(std::unique_lock<std::mutex>& lock) {
  if (writing_ || ended_ || queue_.empty()) return;
  current_ = std::move(queue_.front());
  queue_.pop_front();
  writing_ = true;
  lock.unlock();
  StartWrite(&current_);
}

void DecodeMuxClient::OnWriteDone(bool ok) {
  std::unique_lock lock(mu_);
  writing_ = false;
  if (!ok) {  // the stream is broken: OnDone follows and ends every request
    queue_.clear();
    return;
  }
  Pump(lock);
}

void DecodeMuxClient::OnReadDone(bool ok) {
  if (!ok) return;  // the stream is over; OnDone follows
  Deliver(resp_);
  StartRead(&resp_);
}

void DecodeMuxClient::OnDone(const grpc::Status& status) {
  {
    std::lock_guard lock(mu_);
    queue_.clear();
  }
  EndAll(status.ok() ? UnavailableError("the decoder ended the decode stream")
                     : FromGrpcStatus(status));
  self_.reset();  // may delete this
}

}  // namespace tandem::proxy
