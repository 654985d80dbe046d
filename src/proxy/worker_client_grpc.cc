// RPC adapter: the only proxy file that builds and reads worker.proto
// messages for Decode and Prefill.
#include "proxy/worker_client_grpc.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <atomic>

#include "common/block_hash.h"
#include "common/rpc_server.h"
#include "proxy/decode_mux_client.h"
#include "proxy/decode_mux_tcp_client.h"
#include "proxy/prefill_tcp_client.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::proxy {
namespace {

namespace pb = ::tandem::v1;

void FillParams(const EngineArgs& a, pb::EngineParams* p) {
  p->set_max_tokens(a.max_tokens);
  p->set_temperature(a.temperature);
  p->set_top_p(a.top_p);
  p->set_top_k(a.top_k);
  p->set_seed(a.seed);
  p->mutable_stop_token_ids()->Add(a.stop_token_ids.begin(), a.stop_token_ids.end());
  p->set_ignore_eos(a.ignore_eos);
  p->set_first_sample_index(a.first_sample_index);
}

int64_t UnixMs(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return 0;
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}


}  // namespace

Finish FinishFromProto(pb::FinishReason r) {
  switch (r) {
    case pb::FINISH_REASON_STOP: return Finish::kStop;
    case pb::FINISH_REASON_LENGTH: return Finish::kLength;
    default: return Finish::kNone;
  }
}

// The prompt into the field the worker reads (docs/serving-workers.md,
// "Prompt and hash encoding"): fixed32 is one copy to write and to parse;
// the packed varints of an older worker's field cost a size pass and an
// encoding pass per token here and a decoding pass there.
template <typename Req>
void AddPrompt(const PromptIds& ids, bool fixed32, Req* req) {
  if (!ids) return;
  auto* out = fixed32 ? req->mutable_prompt_token_ids_fixed32() : req->mutable_prompt_token_ids();
  out->Add(ids->begin(), ids->end());
}

void FillDecodeRequest(const DecodeArgs& args, pb::DecodeRequest* req) {
  if (!args.prompt_by_reference) AddPrompt(args.prompt_ids, args.prompt_fixed32, req);
  FillDecodeRequestFields(args, req);
}

void FillDecodeRequestFields(const DecodeArgs& args, pb::DecodeRequest* req) {
  req->set_request_id(args.request_id);
  if (args.prompt_by_reference && args.prompt_ids) {
    req->set_prompt_length(static_cast<uint32_t>(args.prompt_ids->size()));
    req->set_prompt_digest(PromptDigest(*args.prompt_ids));
  }
  FillParams(args.params, req->mutable_params());
  req->set_deadline_unix_ms(UnixMs(args.deadline));
  req->set_prefill_locally(args.prefill_locally);
  req->set_tenant_salt(args.tenant_salt);
  req->set_attempt(args.attempt);
  req->set_priority(args.params.priority);
  req->set_tenant(args.params.tenant);
  req->set_tenant_weight(args.params.tenant_weight);
}

namespace {

class DecodeCall final : public grpc::ClientReadReactor<pb::DecodeResponse>,
                         public Call,
                         public GrpcWorkerClient::Tracked {
 public:
  DecodeCall(DecodeArgs args, DecodeEvents events) : events_(std::move(events)) {
    FillDecodeRequest(args, &req_);
    if (!args.traceparent.empty()) ctx_.AddMetadata("traceparent", args.traceparent);
    if (args.deadline != std::chrono::system_clock::time_point::max()) {
      ctx_.set_deadline(args.deadline);
    }
  }

  ReactorDrain::Token& token() { return token_; }

  void Begin(std::unique_ptr<pb::Decoder::Stub> stub, std::shared_ptr<DecodeCall> self) {
    self_ = std::move(self);
    stub_ = std::move(stub);
    stub_->async()->Decode(&ctx_, &req_, this);
    StartRead(&resp_);
    StartCall();
  }

  void Cancel() override { ctx_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone follows
    switch (resp_.kind_case()) {
      case pb::DecodeResponse::kRegistered:
        if (events_.on_registered) events_.on_registered();
        break;
      case pb::DecodeResponse::kTokens: {
        const auto& t = resp_.tokens().token_ids();
        if (events_.on_tokens) {
          events_.on_tokens(resp_.tokens().first_index(),
                            std::span<const uint32_t>(t.data(), static_cast<size_t>(t.size())));
        }
        break;
      }
      case pb::DecodeResponse::kFinished:
        if (!done_.exchange(true) && events_.on_finished) {
          events_.on_finished(FinishFromProto(resp_.finished().finish_reason()),
                              resp_.finished().completion_tokens(),
                              resp_.finished().decoder_cached_prompt_tokens(),
                              resp_.finished().prefill_cached_prompt_tokens());
        }
        break;
      case pb::DecodeResponse::kError:
        error_ = Status(static_cast<StatusCode>(resp_.error().code()), resp_.error().message());
        break;
      default:
        break;
    }
    StartRead(&resp_);
  }

  void OnDone(const grpc::Status& s) override {
    if (!done_.exchange(true) && events_.on_error) {
      const std::string abandoned_why = abandoned();
      if (!abandoned_why.empty()) {
        events_.on_error(UnavailableError(abandoned_why), /*from_worker=*/false);
      } else {
        Status st = !error_.ok() ? error_
                    : s.ok()     ? UnavailableError("decode stream ended without finishing")
                                 : FromGrpcStatus(s);
        events_.on_error(st, !error_.ok());
      }
    }
    events_ = {};
    self_.reset();  // may delete this
  }

 private:
  void CancelRpc() override { ctx_.TryCancel(); }

  ReactorDrain::Token token_;  // first: destroyed after the stub and the context
  std::unique_ptr<pb::Decoder::Stub> stub_;
  grpc::ClientContext ctx_;
  pb::DecodeRequest req_;
  pb::DecodeResponse resp_;
  DecodeEvents events_;
  Status error_;
  std::atomic<bool> done_{false};
  std::shared_ptr<DecodeCall> self_;  // keeps the reactor alive until OnDone
};

class PrefillCall final : public Call, public GrpcWorkerClient::Tracked {
 public:
  void Cancel() override { ctx.TryCancel(); }
  void CancelRpc() override { ctx.TryCancel(); }
  ReactorDrain::Token token;  // first: destroyed after the stub and the context
  std::unique_ptr<pb::Prefiller::Stub> stub;
  grpc::ClientContext ctx;
  pb::PrefillRequest req;
  pb::PrefillResponse resp;
};

}  // namespace

void GrpcWorkerClient::Tracked::Abandon(const std::string& why) {
  {
    std::lock_guard lock(mu_);
    if (why_.empty()) why_ = why.empty() ? "worker abandoned" : why;
  }
  CancelRpc();
}

std::string GrpcWorkerClient::Tracked::abandoned() const {
  std::lock_guard lock(mu_);
  return why_;
}

void GrpcWorkerClient::Track(const std::string& address, const std::shared_ptr<Tracked>& call) {
  std::string why;
  {
    std::lock_guard lock(mu_);
    if (auto a = abandoned_.empty() ? abandoned_.end() : abandoned_.find(address);
        a != abandoned_.end()) {
      why = a->second;
    } else {
      auto& v = calls_[address];
      std::erase_if(v, [](const std::weak_ptr<Tracked>& w) { return w.expired(); });
      v.push_back(call);
      return;
    }
  }
  // Started after the worker was given up (routed to it just before): it
  // ends as the calls in flight then did, instead of waiting for a worker
  // that may never answer. Its callback runs later, on the call's thread.
  call->Abandon(why);
}

size_t GrpcWorkerClient::AbandonCalls(const std::string& address, const std::string& why) {
  std::vector<std::shared_ptr<Tracked>> live;
  size_t n = 0;  // calls, counting each request on a decode stream
  {
    std::lock_guard lock(mu_);
    // The decode stream ends every request on it (a new one is opened for
    // the next request to that address).
    if (auto m = muxes_.find(address); m != muxes_.end()) {
      n += m->second->num_requests();
      live.push_back(std::move(m->second));
      muxes_.erase(m);
    }
    auto it = calls_.find(address);
    if (it != calls_.end()) {
      for (auto& w : it->second) {
        if (auto c = w.lock()) {
          live.push_back(std::move(c));
          ++n;
        }
      }
      calls_.erase(it);
    }
    abandoned_[address] = why.empty() ? "worker abandoned" : why;
  }
  for (auto& c : live) c->Abandon(why);
  return n;
}

void GrpcWorkerClient::Reachable(const std::string& address) {
  std::lock_guard lock(mu_);
  abandoned_.erase(address);
}

GrpcWorkerClient::GrpcWorkerClient(RpcCredentials credentials, bool decode_stream, bool decode_tcp,
                                   bool tcp_deliver_on_grpc_thread)
    : credentials_(std::move(credentials)),
      decode_stream_(decode_stream),
      decode_tcp_(decode_tcp),
      tcp_deliver_on_grpc_thread_(tcp_deliver_on_grpc_thread) {
  if (!decode_stream_ || !decode_tcp_) return;
  auto tls = InternalFrameTls(credentials_);
  if (!tls.ok()) {
    spdlog::warn("proxy.decode_transport tcp: {}; decode streams use gRPC", tls.status().message());
    decode_tcp_ = false;
    return;
  }
  frame_tls_ = std::move(tls).value();
  frame_tls_ready_ = true;
}

void GrpcWorkerClient::SetTokenTable(const model::TokenBytesTable* table) {
  std::lock_guard lock(mu_);
  token_table_ = table;
}

void GrpcWorkerClient::SetPrefillTransport(bool tcp) {
  std::lock_guard lock(mu_);
  prefill_tcp_ = false;
  if (!tcp) return;
  if (!frame_tls_ready_) {
    auto tls = InternalFrameTls(credentials_);
    if (!tls.ok()) {
      spdlog::warn("proxy.prefill_transport tcp: {}; Prefill calls use gRPC", tls.status().message());
      return;
    }
    frame_tls_ = std::move(tls).value();
    frame_tls_ready_ = true;
  }
  prefill_tcp_ = true;
}

void GrpcWorkerClient::SetPrefillFrameAddress(const std::string& address,
                                              const std::string& frame_address) {
  std::lock_guard lock(mu_);
  if (frame_address.empty()) {
    prefill_tcp_addresses_.erase(address);
  } else {
    prefill_tcp_addresses_[address] = frame_address;
  }
}

GrpcWorkerClient::~GrpcWorkerClient() {
  std::vector<std::weak_ptr<DecodeMuxTcpClient>> tcp;
  std::vector<std::weak_ptr<PrefillTcpClient>> prefill_tcp;
  {
    std::lock_guard lock(mu_);
    tcp.swap(tcp_muxes_);
    muxes_.clear();
    prefill_tcp.swap(prefill_tcp_clients_);
    prefill_clients_.clear();
  }
  for (auto& w : tcp) {
    if (auto m = w.lock()) m->Stop();
  }
  for (auto& w : prefill_tcp) {
    if (auto c = w.lock()) c->Stop();
  }
  // The channels go with this client: the Decode and Prefill reactors it
  // started go first (a finished call's reactor is destroyed on a gRPC
  // thread just after its last callback), so that the last reference to a
  // channel is never dropped on a gRPC callback thread
  // (proxy/reactor_drain.h). A call still in flight is not ended here;
  // past the bound the client goes as it did before.
  if (const size_t left = drain_.WaitForNone(kReactorDrainBound); left > 0) {
    spdlog::warn("worker client: {} gRPC call(s) still in flight after {} ms; closing anyway", left,
                 kReactorDrainBound.count());
  }
}

void GrpcWorkerClient::SetDecodeMuxAddress(const std::string& address,
                                           const std::string& mux_address) {
  std::lock_guard lock(mu_);
  if (mux_address.empty()) {
    tcp_addresses_.erase(address);
  } else {
    tcp_addresses_[address] = mux_address;
  }
}

void GrpcWorkerClient::SetPromptFixed32(const std::string& address, bool reads) {
  std::lock_guard lock(mu_);
  if (reads) {
    fixed32_prompt_addresses_.insert(address);
  } else {
    fixed32_prompt_addresses_.erase(address);
  }
}

bool GrpcWorkerClient::PromptFixed32(const std::string& address) {
  std::lock_guard lock(mu_);
  return fixed32_prompt_addresses_.count(address) > 0;
}

void GrpcWorkerClient::SetDecodeStream(const std::string& address, bool served) {
  std::lock_guard lock(mu_);
  if (served) {
    mux_addresses_.insert(address);
  } else {
    mux_addresses_.erase(address);
  }
}

std::shared_ptr<DecodeMux> GrpcWorkerClient::Mux(const std::string& address,
                                                 const DecodeMux* stale) {
  std::lock_guard lock(mu_);
  if (!decode_stream_) return nullptr;
  // No new stream to a decoder given up: the Decode RPC below is tracked,
  // and so ends at once (Track).
  if (abandoned_.count(address) > 0) return nullptr;
  const auto tcp = decode_tcp_ ? tcp_addresses_.find(address) : tcp_addresses_.end();
  if (tcp == tcp_addresses_.end() && mux_addresses_.count(address) == 0) return nullptr;
  auto& mux = muxes_[address];
  if (mux && mux.get() != stale && !mux->ended()) return mux;
  if (tcp != tcp_addresses_.end()) {
    auto m = DecodeMuxTcpClient::Open(tcp->second, frame_tls_, tcp_deliver_on_grpc_thread_);
    std::erase_if(tcp_muxes_, [](const auto& w) { return w.expired(); });
    tcp_muxes_.push_back(m);
    mux = std::move(m);
  } else {
    mux = DecodeMuxClient::Open(ChannelLocked(address));
  }
  mux->SetTokenTable(token_table_);
  return mux;
}

std::shared_ptr<grpc::Channel> GrpcWorkerClient::Channel(const std::string& address) {
  std::lock_guard lock(mu_);
  return ChannelLocked(address);
}

std::shared_ptr<grpc::Channel> GrpcWorkerClient::ChannelLocked(const std::string& address) {
  auto& ch = channels_[address];
  if (!ch) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    // No HTTP/2 BDP probing on the connections to workers (issue 23): gRPC
    // pinged each one about once a second from its timer thread, idle or
    // not (a wake-up here for the ping and one for its ack, one at the
    // worker), to size the window of what the proxy receives — small
    // messages (Watch updates, decode-stream items, prefill replies) that
    // the default 64 KiB stream window carries without waiting. What the
    // proxy sends (prompts) is governed by the worker's window, unchanged.
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    ch = credentials_.Dial(address, args);
  }
  return ch;
}

std::shared_ptr<Call> GrpcWorkerClient::Decode(const std::string& address, DecodeArgs args,
                                               DecodeEvents events) {
  args.prompt_fixed32 = PromptFixed32(address);
  // The decoder's multiplexed stream (issue 23); a stream that just ended
  // is replaced once.
  if (auto mux = Mux(address)) {
    if (auto call = mux->Start(args, events)) return call;
    if (auto fresh = Mux(address, mux.get())) {
      if (auto call = fresh->Start(args, events)) return call;
    }
  }
  auto stub = pb::Decoder::NewStub(Channel(address));
  auto call = std::make_shared<DecodeCall>(std::move(args), std::move(events));
  drain_.Arm(call->token());
  Track(address, call);
  call->Begin(std::move(stub), call);
  return call;
}

void FillPrefillRequest(const PrefillArgs& args, pb::PrefillRequest* req) {
  AddPrompt(args.prompt_ids, args.prompt_fixed32, req);
  FillPrefillRequestFields(args, req);
}

void FillPrefillRequestFields(const PrefillArgs& args, pb::PrefillRequest* req) {
  req->set_request_id(args.request_id);
  FillParams(args.params, req->mutable_params());
  req->set_deadline_unix_ms(UnixMs(args.deadline));
  req->set_decoder_address(args.decoder_address);
  req->set_decoder_reserve_address(args.decoder_reserve_address);  // reserve-tcp (issue 23)
  req->set_decoder_name(args.decoder_name);
  req->set_tenant_salt(args.tenant_salt);
  req->set_attempt(args.attempt);
  req->set_priority(args.params.priority);
  req->set_tenant(args.params.tenant);
  req->set_tenant_weight(args.params.tenant_weight);
  if (args.waited.count() > 0) req->set_waited_us(static_cast<uint64_t>(args.waited.count()));
}

PrefillResult ToPrefillResult(const pb::PrefillResponse& resp) {
  PrefillResult r;
  r.first_token_id = resp.first_token_id();
  r.cached_prompt_tokens = resp.cached_prompt_tokens();
  r.decoder_cached_blocks = resp.decoder_cached_blocks();
  r.transferred_blocks = resp.transferred_blocks();
  r.transferred_bytes = resp.transferred_bytes();
  r.prefill_seconds = resp.prefill_seconds();
  r.transfer_seconds = resp.transfer_seconds();
  return r;
}

std::shared_ptr<PrefillTcpClient> GrpcWorkerClient::PrefillClient(const std::string& address,
                                                                  const PrefillTcpClient* stale) {
  std::shared_ptr<PrefillTcpClient> moved;  // stopped outside the lock (Stop joins its reader)
  std::shared_ptr<PrefillTcpClient> fresh;
  {
    std::lock_guard lock(mu_);
    if (!prefill_tcp_) return nullptr;
    // Nothing is written to a prefiller given up: the gRPC call below is
    // tracked, and so ends at once (Track).
    if (abandoned_.count(address) > 0) return nullptr;
    const auto tcp = prefill_tcp_addresses_.find(address);
    if (tcp == prefill_tcp_addresses_.end()) return nullptr;
    auto& client = prefill_clients_[address];
    if (client && client.get() != stale && !client->ended() && client->address() == tcp->second) {
      return client;
    }
    // A worker that registered again elsewhere gets a new connection; the
    // one to its old address is closed (its calls end UNAVAILABLE), not left
    // open until that peer goes away.
    if (client && !client->ended() && client->address() != tcp->second) moved = client;
    client = PrefillTcpClient::Open(tcp->second, frame_tls_);
    std::erase_if(prefill_tcp_clients_, [](const auto& w) { return w.expired(); });
    prefill_tcp_clients_.push_back(client);
    fresh = client;
  }
  if (moved) moved->Stop();
  return fresh;
}

std::shared_ptr<Call> GrpcWorkerClient::Prefill(const std::string& address, PrefillArgs args,
                                                std::function<void(Result<PrefillResult>)> done) {
  args.prompt_fixed32 = PromptFixed32(address);
  // The prefiller's framed TCP listener (issue 23); a connection that just
  // ended is replaced once.
  if (auto client = PrefillClient(address)) {
    std::shared_ptr<PrefillTcpCall> call = client->Start(args, done);
    if (!call) {
      if (auto fresh = PrefillClient(address, client.get())) call = fresh->Start(args, done);
    }
    if (call) {
      Track(address, call);
      return call;
    }
  }
  auto call = std::make_shared<PrefillCall>();
  drain_.Arm(call->token);
  call->stub = pb::Prefiller::NewStub(Channel(address));
  FillPrefillRequest(args, &call->req);
  if (!args.traceparent.empty()) call->ctx.AddMetadata("traceparent", args.traceparent);
  if (args.deadline != std::chrono::system_clock::time_point::max()) {
    call->ctx.set_deadline(args.deadline);
  }
  Track(address, call);
  call->stub->async()->Prefill(&call->ctx, &call->req, &call->resp,
                         [call, done = std::move(done)](grpc::Status s) {
                           if (const std::string why = call->abandoned(); !why.empty()) {
                             done(UnavailableError(why));
                             return;
                           }
                           if (!s.ok()) {
                             done(FromGrpcStatus(s));
                             return;
                           }
                           done(ToPrefillResult(call->resp));
                         });
  return call;
}

}  // namespace tandem::proxy
