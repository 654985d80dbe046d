// RPC adapter: the only file of tandem_loadgen that sees protobuf types.
#include "loadgen/grpc_client.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <sstream>
#include <mutex>
#include <unordered_set>

#include "common/rpc_server.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::loadgen {
namespace {

namespace pb = ::tandem::v1;

class GrpcClient;

// One streamed call; deletes itself after OnDone.
class Call final : public grpc::ClientReadReactor<pb::GenerateResponse> {
 public:
  Call(GrpcClient* owner, std::function<void(Reply)> done) : owner_(owner), done_(std::move(done)) {}

  void Go(pb::Generation::Stub* stub, const Request& r, const std::string& api_key) {
    ctx_.set_deadline(std::chrono::system_clock::now() + r.timeout);
    const std::string& key = r.api_key.empty() ? api_key : r.api_key;
    if (!key.empty()) ctx_.AddMetadata("authorization", "Bearer " + key);
    if (r.priority) req_.set_priority(*r.priority);
    req_.set_request_id(r.request_id);
    req_.set_model(r.model);
    req_.mutable_prompt_token_ids()->Add(r.prompt_token_ids.begin(), r.prompt_token_ids.end());
    req_.set_max_tokens(r.max_tokens);
    if (r.temperature) req_.mutable_sampling()->set_temperature(*r.temperature);
    if (r.seed) req_.mutable_sampling()->set_seed(*r.seed);
    req_.set_ignore_eos(r.ignore_eos);
    reply_.chunks.reserve(r.max_tokens);
    reply_.token_ids.reserve(r.max_tokens);
    stub->async()->Generate(&ctx_, &req_, this);
    StartRead(&resp_);
    reply_.sent = Clock::now();
    StartCall();
  }

  void Cancel() { ctx_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    const auto now = Clock::now();
    if (resp_.token_ids_size() > 0) {
      reply_.chunks.push_back({now, uint32_t(resp_.token_ids_size())});
      reply_.token_ids.insert(reply_.token_ids.end(), resp_.token_ids().begin(),
                              resp_.token_ids().end());
    }
    if (resp_.finish_reason() != pb::FINISH_REASON_UNSPECIFIED) {
      reply_.finish_reason = resp_.finish_reason() == pb::FINISH_REASON_STOP ? "stop" : "length";
    }
    if (resp_.has_usage()) {
      reply_.has_usage = true;
      reply_.prompt_tokens = resp_.usage().prompt_tokens();
      reply_.completion_tokens = resp_.usage().completion_tokens();
      reply_.cached_prompt_tokens = resp_.usage().cached_prompt_tokens();
    }
    StartRead(&resp_);
  }

  void OnDone(const grpc::Status& s) override;

 private:
  GrpcClient* owner_;
  std::function<void(Reply)> done_;
  grpc::ClientContext ctx_;
  pb::GenerateRequest req_;
  pb::GenerateResponse resp_;
  Reply reply_;
};

class GrpcClient final : public Client {
 public:
  explicit GrpcClient(const GrpcClientOptions& o) : o_(o) {
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!o.tls_ca_file.empty()) {
      std::ifstream in(o.tls_ca_file, std::ios::binary);
      std::stringstream ca;
      ca << in.rdbuf();
      grpc::SslCredentialsOptions so;
      so.pem_root_certs = ca.str();
      creds = grpc::SslCredentials(so);
    }
    for (int i = 0; i < std::max(1, o.channels); ++i) {
      grpc::ChannelArguments args;
      // Distinct channel args keep gRPC from sharing one subchannel.
      args.SetInt("tandem.loadgen.channel", i);
      args.SetMaxReceiveMessageSize(64 << 20);
      stubs_.push_back(pb::Generation::NewStub(
          grpc::CreateCustomChannel(o.address, creds, args)));
    }
  }

  ~GrpcClient() override {
    CancelAll();
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return live_.empty(); });
  }

  void Start(Request request, std::function<void(Reply)> done) override {
    auto* call = new Call(this, std::move(done));
    {
      std::lock_guard lk(mu_);
      live_.insert(call);
    }
    const size_t i = next_.fetch_add(1) % stubs_.size();
    call->Go(stubs_[i].get(), request, o_.api_key);
  }

  void CancelAll() override {
    std::lock_guard lk(mu_);
    for (Call* c : live_) c->Cancel();
  }

  Result<ModelInfo> GetModelInfo(const std::string& model) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!o_.api_key.empty()) ctx.AddMetadata("authorization", "Bearer " + o_.api_key);
    pb::ListModelsRequest req;
    pb::ListModelsResponse resp;
    const grpc::Status st = stubs_[0]->ListModels(&ctx, req, &resp);
    if (!st.ok()) {
      return FromGrpcStatus(st).WithContext(fmt::format("ListModels on {}", o_.address));
    }
    if (resp.models_size() == 0) {
      return NotFoundError(fmt::format("the server at {} lists no models", o_.address));
    }
    for (const auto& m : resp.models()) {
      if (model.empty() || m.id() == model) {
        return ModelInfo{m.id(), m.max_model_len(), m.vocab_size(), m.block_size()};
      }
    }
    return NotFoundError(fmt::format("the server at {} does not serve model '{}'", o_.address, model));
  }

  std::string Describe() const override { return "gRPC tandem.v1.Generation at " + o_.address; }

  void Finished(Call* c) {
    std::lock_guard lk(mu_);
    live_.erase(c);
    if (live_.empty()) cv_.notify_all();
  }

 private:
  GrpcClientOptions o_;
  std::vector<std::unique_ptr<pb::Generation::Stub>> stubs_;
  std::atomic<size_t> next_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_set<Call*> live_;
};

void Call::OnDone(const grpc::Status& s) {
  reply_.done = Clock::now();
  reply_.status = s.ok() ? Status::Ok() : FromGrpcStatus(s);
  auto done = std::move(done_);
  Reply reply = std::move(reply_);
  GrpcClient* owner = owner_;
  // Unregister before running `done`: the runner may destroy the client
  // right after its last `done`.
  owner->Finished(this);
  delete this;
  done(std::move(reply));
}

}  // namespace

std::unique_ptr<Client> MakeGrpcClient(const GrpcClientOptions& o) {
  return std::make_unique<GrpcClient>(o);
}

}  // namespace tandem::loadgen
